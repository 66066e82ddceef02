"""NCCLTransport across ranks (one GPU each): ring exchange and all-reduce equal to the host sums.
Skipped, with the reason, without CUDA and CuPy, and where the node has fewer GPUs than ranks
(NCCL refuses two ranks on one GPU: "Duplicate GPU detected")."""

from __future__ import annotations

import importlib.util

import pytest
import torch


@pytest.fixture
def nccl_transport(comm):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: NCCL runs on GPUs only")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed (the gpu extra): no NCCL")
    if torch.cuda.device_count() < comm.size:
        pytest.skip(f"{comm.size} ranks but {torch.cuda.device_count()} GPU(s): NCCL refuses two "
                    f"ranks on one GPU ('Duplicate GPU detected')")
    from halo.transport.nccl import NCCLTransport
    from halo.transport.streams import CudaDevice

    torch.cuda.set_device(comm.rank)
    return NCCLTransport(comm, CudaDevice())


def test_ring_and_allreduce(comm, nccl_transport):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = torch.full((1000,), float(comm.rank), device="cuda")
    recv = torch.empty_like(send)
    nccl_transport.start([(right, send)], [(left, recv)], tag=0).wait()
    t = torch.arange(10, dtype=torch.float64, device="cuda") * (comm.rank + 1)
    nccl_transport.iallreduce_(t).wait()
    torch.cuda.synchronize()
    assert recv.eq(float(left)).all()
    want = torch.arange(10, dtype=torch.float64) * sum(r + 1 for r in range(comm.size))
    assert torch.equal(t.cpu(), want)
    nccl_transport.close()
    nccl_transport.close()  # again: nothing
    from halo.transport.base import TransportError

    with pytest.raises(TransportError, match="after close"):
        nccl_transport.iallreduce_(t)
