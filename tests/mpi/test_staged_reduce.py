"""StagedReducer's stream ordering under real mpirun, on the CPU stand-in device (SimDevice): the
D2H copy waits for the compute stream's producer; the compute stream's consumer waits for the H2D
copy; all-reduces started in one order and waited for in another (differently on each rank) still
match; dtypes MPI cannot reduce are widened and narrowed back; staging buffers are reused only
after their copies ran (bad buffers and a ReduceGroup routing its device's tensors to a
reducer: tests/mpi/test_collectives.py).

The same StagedReducer on CudaDevice (real GPU streams) is not run here (no GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import reduce_input

from halo.transport.staged_reduce import StagedReducer
from halo.transport.streams import SimDevice


def expected(comm, make, op: str) -> torch.Tensor:
    """What ``op`` over every rank's ``make(rank)`` gives (computed locally, in float64)."""
    vals = torch.stack([make(r).double() for r in range(comm.size)])
    out = {"sum": vals.sum(0), "max": vals.amax(0), "min": vals.amin(0)}[op]
    return out.to(make(0).dtype)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce_in_stream_order(comm, op):
    dev = SimDevice()
    red = StagedReducer(comm, dev)
    make = lambda r: torch.arange(6.0).reshape(2, 3) * (r + 1) - r  # noqa: E731
    t = torch.zeros(2, 3)
    dev.compute.hold()  # the producer of t is still queued on the compute stream
    dev.compute.launch(lambda: t.copy_(make(comm.rank)))
    req = red.iallreduce_(t, op)
    if comm.size > 1:
        assert not req.test(), "the all-reduce started before the D2H copy could run"
    dev.compute.release()
    seen: list[torch.Tensor] = []
    red.stream.hold()  # a slow reduce stream: the H2D copy is enqueued but does not run
    req.wait()
    dev.compute.launch(lambda: seen.append(t.clone()))  # the consumer, after wait()
    if comm.size > 1:
        assert not seen, "the consumer ran before the H2D copy"
        assert red.pool.pending == 1, "the staging buffer was freed before its H2D copy ran"
    red.stream.release()
    assert torch.equal(seen[0], expected(comm, make, op))
    assert torch.equal(t, expected(comm, make, op))


def test_out_of_order_waits_still_match(comm):
    """Eight all-reduces of different sizes and dtypes (bfloat16 and bool widened), waited for
    in reverse on even ranks and in order on odd ones: each gets its own sum."""
    dev = SimDevice()
    red = StagedReducer(comm, dev)
    dtypes = [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool]

    def make(k: int, r: int) -> torch.Tensor:
        return reduce_input(k, r, dtypes)

    ts = [make(k, comm.rank) for k in range(8)]
    ops = ["sum", "max", "min", "sum"] * 2
    red.stream.hold()  # no D2H copy runs yet, so no MPI all-reduce can start at iallreduce_
    reqs = [red.iallreduce_(t, op) for t, op in zip(ts, ops)]
    red.stream.release()
    for req in (reversed(reqs) if comm.rank % 2 == 0 else reqs):
        req.wait()
    for k, (t, op) in enumerate(zip(ts, ops)):
        want = expected(comm, lambda r: make(k, r).to(torch.float64), op).to(t.dtype)
        assert torch.equal(t, want), (k, op, t, want)
    made = red.pool.allocated
    for _ in range(3):  # every copy has run: steady state allocates nothing new
        red.iallreduce_(ts[0]).wait()
    assert red.pool.allocated == made
