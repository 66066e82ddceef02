"""halo.transport.collectives under real mpirun: all-reduce (blocking and started) and broadcast
of every dtype the layers use, contiguous or not, equal to the sum/max/min computed from an
allgather of the inputs; all-gather of rows (any dtype, row shape, ranks with no rows) equal to the
concatenation of every rank's rows, which each rank rebuilds from the seeds."""

from __future__ import annotations

import pytest
import torch

from halo.transport.base import TransportError
from halo.transport.collectives import allgatherv, allreduce_, bcast_, iallreduce_

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.float16, torch.bfloat16]


def local(comm, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(comm.rank + 7)
    return (torch.randn(3, 5, generator=g) * 4).to(dtype)


def expected(comm, t: torch.Tensor, op: str) -> torch.Tensor:
    every = torch.stack(comm.allgather(t)).double()
    return {"sum": every.sum(0), "max": every.amax(0), "min": every.amin(0)}[op]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce_every_dtype(comm, dtype, op):
    t = local(comm, dtype)
    want = expected(comm, t, op).to(dtype)
    assert allreduce_(t, comm, op) is t
    if op == "sum" and dtype in (torch.float32, torch.float64):  # MPI's order of adding ranks
        assert torch.allclose(t, want, rtol=4 * torch.finfo(dtype).eps, atol=1e-12), (t, want)
    else:  # exact: max/min, integers, and half types (summed in float64, rounded once)
        assert torch.equal(t, want), (t, want)


def test_allreduce_non_contiguous_and_bool(comm):
    base = local(comm, torch.float64)
    t = base.t()  # a transposed view: reduced through a copy, written back into the view
    want = expected(comm, t.contiguous(), "sum")
    allreduce_(t, comm)
    assert torch.allclose(base.t(), want, rtol=1e-15, atol=1e-12)
    flags = torch.tensor([comm.rank == 0, False, True])
    allreduce_(flags, comm, "max")
    assert flags.tolist() == [True, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_iallreduce_matches_allreduce(comm, dtype):
    a, b = local(comm, dtype), local(comm, dtype)
    req = iallreduce_(b, comm)
    allreduce_(a, comm)  # on the same comm while b's is in flight: started in the same order
    req.wait()
    assert torch.equal(a, b)


def test_bad_op_names_the_choices(comm):
    with pytest.raises(ValueError, match="reduction op must be one of sum, max, min; got 'avg'"):
        allreduce_(torch.zeros(2), comm, "avg")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_bcast(comm, dtype):
    t = local(comm, dtype)
    root = comm.size - 1
    want = comm.bcast(t.clone(), root=root)
    bcast_(t, comm, root=root)
    assert torch.equal(t, want)
    nc = local(comm, dtype).t()
    bcast_(nc, comm, root=0)
    assert torch.equal(nc, comm.bcast(local(comm, dtype).t().contiguous(), root=0))


# --- allgatherv ---------------------------------------------------------------------------------

def rows_of(rank: int, n: int, row: tuple[int, ...], dtype) -> torch.Tensor:
    """Rank ``rank``'s ``n`` rows: a pure function, so every rank can build the expected result."""
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (n,) + row
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:  # beyond float64's 2**53: a gather through floats would round
        return torch.randint(-2**62, 2**62, shape, generator=g, dtype=torch.int64)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


COUNTS = {"rank 1 empty": (3, 0, 5, 1), "rank 0 empty": (0, 2, 0, 4), "all empty": (0, 0, 0, 0)}


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("row", [(), (3,), (2, 3)], ids=["1d", "row3", "row2x3"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_allgatherv_is_every_ranks_rows_in_rank_order(comm, dtype, row, counts):
    mine = rows_of(comm.rank, counts[comm.rank], row, dtype)
    got = allgatherv(mine, comm)
    want = torch.cat([rows_of(r, counts[r], row, dtype) for r in range(comm.size)])
    assert got.dtype == dtype and got.shape == want.shape == (sum(counts[:comm.size]),) + row
    assert torch.equal(got, want)  # bit for bit, bfloat16 and bool included


def test_allgatherv_non_contiguous_and_detached(comm):
    base = torch.arange(12.0).reshape(3, 4).add(100 * comm.rank).requires_grad_()
    got = allgatherv(base.t(), comm)  # [4, 3] per rank, a transposed view
    want = torch.cat([torch.arange(12.0).reshape(3, 4).add(100 * r).t() for r in range(comm.size)])
    assert torch.equal(got, want) and not got.requires_grad


def test_allgatherv_rows_that_disagree_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    shape = (2, 3) if comm.rank == comm.size - 1 else (2, 2)
    with pytest.raises(TransportError, match=r"every rank must give rows of one shape and dtype; "
                       r"got rank 0: rows \[2\] torch.float32, .*rank %d: rows \[3\]"
                       % (comm.size - 1)):
        allgatherv(torch.zeros(shape), comm)
    dtype = torch.float64 if comm.rank == 0 else torch.float32
    with pytest.raises(TransportError, match="rank 0: rows \\[\\] torch.float64"):
        allgatherv(torch.zeros(2, dtype=dtype), comm)


def test_allgatherv_of_a_scalar_raises_on_every_rank(comm):
    t = torch.tensor(1.0) if comm.rank == 0 else torch.ones(1)
    with pytest.raises(TransportError, match=r"rank\(s\) \[0\] gave a 0-d tensor"):
        allgatherv(t, comm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allgatherv_device_tensor_comes_back_on_its_device(comm):
    counts = COUNTS["rank 0 empty"]
    mine = rows_of(comm.rank, counts[comm.rank], (3,), torch.bfloat16).cuda()
    got = allgatherv(mine, comm)
    want = torch.cat([rows_of(r, counts[r], (3,), torch.bfloat16) for r in range(comm.size)])
    assert got.device == mine.device and torch.equal(got.cpu(), want)


def make_reducer(comm, kind):
    """A device reducer of ``kind`` on the CPU stand-in device, and how many buffers it used."""
    from halo.transport.ipc_reduce import IPCReducer
    from halo.transport.staged_reduce import StagedReducer
    from halo.transport.streams import SimDevice

    if kind == "staged":
        red = StagedReducer(comm, SimDevice())
        return red, lambda: red.pool.allocated
    red = IPCReducer(comm, SimDevice())
    return red, lambda: red.transport.registered


@pytest.mark.parametrize("kind", ["staged", "ipc"])
def test_a_reducer_refuses_bad_buffers_before_enqueuing_anything(comm, kind):
    red, used = make_reducer(comm, kind)
    with pytest.raises(TransportError, match="Reducer: the all-reduce buffer must be a contiguous "
                                             "cpu tensor; got a non-contiguous"):
        red.iallreduce_(torch.zeros(4, 3).t())
    with pytest.raises(TransportError, match="on meta"):
        red.iallreduce_(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="reduction op must be one of sum, max, min; got 'avg'"):
        red.iallreduce_(torch.zeros(3), "avg")
    assert used() == 0
    red.close()


@pytest.mark.parametrize("kind", ["staged", "ipc"])
def test_a_reduce_group_routes_its_device_tensors_to_the_reducer(comm, kind):
    """allreduce_ / iallreduce_ over a ReduceGroup give MPI's results through its reducer (a
    non-contiguous tensor through a contiguous copy), host-staged or over CUDA IPC, here on the
    CPU stand-in device."""
    from halo.transport.collectives import ReduceGroup

    red, used = make_reducer(comm, kind)
    group = ReduceGroup(comm, red)
    a = torch.arange(12.0).reshape(3, 4) + comm.rank
    b = a.clone()
    allreduce_(a, group, "max")
    allreduce_(b, comm, "max")
    assert torch.equal(a, b)
    c = (torch.arange(12.0).reshape(3, 4) * (comm.rank + 1)).t()  # non-contiguous
    d = c.contiguous().clone()
    allreduce_(c, group)
    allreduce_(d, ReduceGroup(comm))
    assert torch.equal(c, d)
    e = torch.ones(5, dtype=torch.float64) * comm.rank
    iallreduce_(e, group).wait()
    assert torch.equal(e, torch.full((5,), float(sum(range(comm.size))), dtype=torch.float64))
    if comm.size > 1:
        assert used() > 0, "the group's tensors did not go through its reducer"
    red.close()


@pytest.mark.parametrize("kind,dtype", [("staged", torch.float32), ("staged", torch.bfloat16),
                                        ("staged", torch.float16), ("ipc", torch.float32),
                                        ("ipc", torch.bfloat16)])
def test_a_reduce_group_reads_and_writes_through_the_compute_stream(comm, kind, dtype):
    """On a device whose work lags its host (as a GPU's does), allreduce_ over a ReduceGroup
    reads a non-contiguous tensor after its producer ran and writes the sum before its consumer
    runs; so does the widening of a dtype MPI cannot reduce (bfloat16, float16). Host-side
    copies (``t.contiguous()``, ``t.to(float64)``) read the tensor before the producer ran."""
    from halo.transport.collectives import ReduceGroup
    from halo.transport.ipc_reduce import IPCReducer
    from halo.transport.staged_reduce import StagedReducer
    from halo.transport.streams import SimDevice

    dev = SimDevice(lag=3)
    red = StagedReducer(comm, dev) if kind == "staged" else IPCReducer(comm, dev)
    make = lambda r: ((torch.arange(12.0).reshape(4, 3) % 5) * (r + 1)).to(dtype).t()  # noqa: E731
    t = torch.zeros(4, 3, dtype=dtype).t()  # non-contiguous
    dev.compute.launch(lambda: t.copy_(make(comm.rank)))  # the producer, still queued
    allreduce_(t, ReduceGroup(comm, red))
    seen: list[torch.Tensor] = []
    dev.compute.launch(lambda: seen.append(t.clone()))  # the consumer
    dev.compute.record().synchronize()
    want = sum(make(r).double() for r in range(comm.size)).to(dtype)
    assert torch.equal(seen[0], want) and torch.equal(t, want)
    red.close()
