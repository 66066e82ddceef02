"""Device transports on a real GPU (CudaDevice, StagedTransport, NCCLTransport): skipped, with the
reason, where CUDA or CuPy is missing - as in the CPU suite. Their ordering logic is tested on
the CPU stand-in in tests/test_transport_streams.py and tests/mpi/test_staged_transport.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: device transports run on GPUs only")
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="CuPy is not installed (the gpu extra): no NCCL")


@needs_cuda
def test_staged_transport_on_cuda_to_self():
    from mpi4py import MPI

    from halo.transport.mpi import MPITransport
    from halo.transport.staged import StagedTransport
    from halo.transport.streams import CudaDevice

    dev = CudaDevice()
    tr = StagedTransport(MPITransport(MPI.COMM_SELF), dev)
    send = torch.arange(1000, dtype=torch.float32, device="cuda")
    recv = torch.empty_like(send)
    tr.start([(0, send)], [(0, recv)], tag=1).wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(recv, send)


@needs_cuda
def test_a_device_delay_holds_the_compute_stream_for_its_time_and_not_the_host():
    """DelayedTransport(device=CudaDevice()): the pause is a spinning kernel of the calibrated
    length on a stream of its own; start and wait return without waiting for it, and the compute
    stream's work after the wait starts once it is over."""
    import time

    from mpi4py import MPI

    from halo.transport.delay import DelayedTransport
    from halo.transport.staged import StagedTransport
    from halo.transport.mpi import MPITransport
    from halo.transport.streams import CudaDevice

    dev = CudaDevice()
    slow = DelayedTransport(StagedTransport(MPITransport(MPI.COMM_SELF), dev), 0.05, device=dev)
    send = torch.arange(1000, dtype=torch.float32, device="cuda")
    recv = torch.empty_like(send)
    slow.start([(0, send)], [(0, recv)], tag=1).wait()  # the first pause times the spin rate
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    slow.start([(0, send)], [(0, recv)], tag=1).wait()
    host_s = time.perf_counter() - t0
    b.record()
    b.synchronize()
    assert host_s < 0.03  # the host did not sleep through the pause
    assert 0.04 <= a.elapsed_time(b) / 1e3 < 0.08  # the compute stream waited it out
    assert torch.equal(recv, send)


@needs_cuda
@needs_cupy
def test_nccl_world_of_one_send_to_self_and_allreduce():
    from mpi4py import MPI

    from halo.transport.nccl import NCCLTransport
    from halo.transport.streams import CudaDevice

    tr = NCCLTransport(MPI.COMM_SELF, CudaDevice())
    send = torch.arange(64, dtype=torch.float32, device="cuda")
    recv = torch.zeros_like(send)
    tr.start([(0, send)], [(0, recv)], tag=0).wait()
    t = send.clone()
    tr.iallreduce_(t).wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(recv, send) and torch.equal(t, send)


@needs_cuda
@needs_cupy
def test_ipc_transport_to_self():
    from mpi4py import MPI

    from halo.transport.ipc import IPCTransport
    from halo.transport.streams import CudaDevice

    tr = IPCTransport(MPI.COMM_SELF, CudaDevice())
    send = torch.arange(256, dtype=torch.int64, device="cuda")
    recv = torch.zeros_like(send)
    tr.start([(0, send)], [(0, recv)], tag=2).wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(recv, send)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_comm_bench_says_it_needs_a_gpu():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "gpu-comm"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "bench gpu-comm: no CUDA device here" in out.stderr, out.stderr
