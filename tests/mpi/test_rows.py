"""parallel.rows under mpirun: rows reach their ranks and answers come back in the caller's
order, including the no-traffic case (every row already home), which skips the copies."""

from __future__ import annotations

import pytest
import torch

from sparsepipe_hpc.parallel.rows import send_list, send_rows


def rows_for(comm, n, rng):
    ids = torch.arange(n) + 1000 * comm.rank
    return ids, torch.stack([ids.double(), -ids.double()], 1)


@pytest.mark.parametrize("how", ["random", "home", "one_away"])
def test_rows_arrive_and_answers_return(comm, rng, how):
    n = 50 + 7 * comm.rank
    ids, vals = rows_for(comm, n, rng)
    if how == "random":
        dest = torch.from_numpy(rng.integers(0, comm.size, n))
    else:
        dest = torch.full((n,), comm.rank)
        if how == "one_away" and comm.rank == comm.size - 1:
            dest[3] = 0  # a single row leaves one rank: every rank must still exchange
    moved = send_rows(comm, dest, ids, vals)
    got_ids, got_vals = moved.rows
    every = comm.allgather((ids, dest))
    want = torch.cat([i[d == comm.rank] for i, d in every])
    assert torch.equal(got_ids, want)
    assert torch.equal(got_vals[:, 0].long(), got_ids)
    assert moved.local == (how == "home" or comm.size == 1)
    (back,) = moved.reply(got_ids * 2)
    assert torch.equal(back, ids * 2)


def test_send_list_consumes_its_tensors(comm):
    ids = torch.arange(10)
    tensors = [ids.clone(), ids.clone()]
    moved = send_list(comm, torch.full((10,), comm.rank), tensors)
    assert tensors == [] and torch.equal(moved.rows[0], ids)


def test_bad_rows_on_one_rank_raise_on_every_rank(comm):
    """A rank's bad destinations or answer lengths used to raise on that rank alone, before the
    exchange the others had entered: every rank raises now, and they stay in step."""
    last = comm.rank == comm.size - 1
    dest = torch.tensor([0, comm.size if last else 0])  # the last rank names no rank
    with pytest.raises(ValueError, match=r"destinations must lie in \[0, \d+\)|rank \d+ passed "
                                         r"bad rows"):
        send_rows(comm, dest, torch.arange(2.0))
    moved = send_rows(comm, torch.zeros(2, dtype=torch.long), torch.arange(2.0))
    n = len(moved.rows[0])
    with pytest.raises(ValueError, match="an answer has|another rank passed an answer"):
        moved.reply(torch.zeros(n + 1 if last else n))
    back, = moved.reply(torch.arange(float(n)))  # still in step afterwards
    assert len(back) == 2
