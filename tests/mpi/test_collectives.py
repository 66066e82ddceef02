"""halo.transport.collectives under real mpirun: all-reduce (blocking and started) and broadcast
of every dtype the layers use, contiguous or not, equal to the sum/max/min computed from an
allgather of the inputs."""

from __future__ import annotations

import pytest
import torch

from halo.transport.collectives import allreduce_, bcast_, iallreduce_

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
