"""Spatial parallelism on CUDA tensors under real mpirun: halos and reductions on the device.

Every rank computes on a GPU (ranks share one when there are fewer GPUs than ranks, as on the
one-H100 machines here) and its spatial grid's halos move through StagedTransport (device ->
pinned host -> MPI -> pinned host -> device, on a communication stream) or IPCTransport (CUDA IPC,
CuPy); BatchNorm statistics and gradient buckets through StagedReducer (the reducer of both); the
serial float64 run on the CPU is the oracle, as in test_spatial.py. NCCL is not run
here unless every rank has a GPU of its own: it refuses two ranks on one GPU.
Skipped, with the reason, without CUDA (the CPU suite runs the same code on the stand-in device:
test_spatial.py::test_device_transport_equals_serial).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from test_spatial import TOL, grids_for, make_cloud, rows_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: device transports run on GPUs only")


def device_comm(comm, name: str):
    """The trainer's DeviceComm (halo, reducer and stage makers) for ``name`` on this GPU."""
    from sparsepipe_hpc.train.transport import device_comm as makers

    if name in ("ipc", "nccl") and importlib.util.find_spec("cupy") is None:
        pytest.skip(f"CuPy is not installed (the gpu extra): no {name}")
    if name == "nccl" and torch.cuda.device_count() < comm.size:
        pytest.skip(f"{comm.size} ranks but {torch.cuda.device_count()} GPU(s): NCCL refuses two "
                    f"ranks on one GPU ('Duplicate GPU detected')")
    return makers(name, torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(autouse=True)
def _my_gpu(comm):
    """This rank's GPU; and an MPI that autograd's CUDA thread may call (halo adjoints, BatchNorm
    sums and gradient buckets run there), as the trainer checks at start-up."""
    from sparsepipe_hpc.train.transport import check_mpi_threads

    check_mpi_threads(comm)
    torch.cuda.set_device(comm.rank % torch.cuda.device_count())


@pytest.mark.parametrize("name", ["staged", "ipc", "nccl"])
@pytest.mark.parametrize("engine", ["torch", "spconv", "spconv_explicit"])
def test_unet_on_cuda_equals_serial(comm, name, engine):
    """float64 with the own engine (exact to rounding); float32 with spconv's CUDA kernels
    (implicit GEMM for the local part and the strided layers) to float32 tolerance;
    ``spconv_explicit``: the strided layers by explicit gather-GEMM-scatter instead
    (engine.spconv_igemm switched off)."""
    import contextlib

    from sparsepipe_hpc.engine import spconv_igemm

    dtype = torch.float64 if engine == "torch" else torch.float32
    switch = spconv_igemm.only_on() if engine == "spconv_explicit" else contextlib.nullcontext()
    engine = "spconv" if engine == "spconv_explicit" else engine
    with switch:
        _unet_on_cuda_equals_serial(comm, name, engine, dtype)


def _unet_on_cuda_equals_serial(comm, name: str, engine: str, dtype: torch.dtype) -> None:
    def close(actual, expected, **kw):
        """float64: to rounding; float32: to 2e-4 relative, and absolute 2e-5 of the tensor's
        largest value (float32 sums err with the magnitude of what they add up, so the small
        entries of a weight gradient reaching ~100 are off by more than a fixed 2e-5)."""
        top = float(expected.abs().amax()) if expected.numel() else 0.0
        tol = TOL if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5 * max(1.0, top))
        torch.testing.assert_close(actual.cpu().double(), expected, **tol, **kw)

    x = make_cloud(5, "random", batch=2)
    for grid in grids_for(comm):
        torch.manual_seed(0)
        serial = SparseUNet(3, 5, width=4, depth=2, engine="torch").double()
        dist = SparseUNet(3, 5, width=4, depth=2, engine=engine)
        dist.load_state_dict(serial.state_dict())
        dist.to("cuda", dtype)
        dc = device_comm(comm, name)
        ctx = ParallelContext(comm, RankLayout(1, 1, grid), transport=dc.halo,
                              reducer=dc.reducer)
        fs = x.feats.clone().requires_grad_()
        ys = serial(x.replace(feats=fs, kmaps={}))
        xl, = ctx.distribute(x.replace(kmaps={}), align=4)
        fd = xl.feats.to("cuda", dtype).requires_grad_()
        yd = dist(xl.replace(coords=xl.coords.cuda(), feats=fd))
        r = torch.randn(ys.feats.shape, generator=torch.Generator().manual_seed(7),
                        dtype=torch.float64)
        (ys.feats * r).sum().backward()
        rows = rows_of(ys.coords, yd.coords.cpu())
        (yd.feats * r[rows].to("cuda", dtype)).sum().backward()
        close(yd.feats.detach(), ys.feats[rows].detach())
        in_rows = rows_of(x.coords, xl.coords)
        close(fd.grad, fs.grad[in_rows])
        buckets = ctx.gradient_reducer(dist, 256)
        buckets.finish()  # the bucketed path (one-shot here), through the reducer
        buckets.close()
        ctx.close()  # IPC buffers and NCCL communicators, not the caching allocator's
        for (n, ps), pd in zip(serial.named_parameters(), dist.parameters()):
            close(pd.grad, ps.grad, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_staged_reducer_on_cuda(comm, dtype):
    from halo.transport.staged_reduce import StagedReducer
    from halo.transport.streams import CudaDevice

    red = StagedReducer(comm, CudaDevice())
    base = torch.arange(64, device="cuda") % 16  # sums stay exact in bfloat16 (< 256)
    reqs, ts = [], []
    for k in range(3):  # three in flight, waited for in reverse
        ts.append((base * (comm.rank + 1) + k).to(dtype))
        reqs.append(red.iallreduce_(ts[-1]))
    for req in reversed(reqs):
        req.wait()
    torch.cuda.current_stream().synchronize()
    total = comm.size * (comm.size + 1) // 2
    for k, t in enumerate(ts):
        want = (base * total + k * comm.size).to(dtype)
        assert torch.equal(t, want), (k, t, want)


def test_a_halo_plan_on_cuda_waits_for_the_device_twice(comm):
    """build_plan reads the device twice: its contract checks with its send counts (one key sort
    for both), then the counts received with its edge rows' count and its send blocks' runs
    (before, the checks and the selection each read on their own: 3 waits per plan, 15 per
    2-rank U-Net step on an H100). The plan equals the CPU one."""
    import warnings

    import halo
    from halo.plan import build_plan
    from halo.transport.staged import StagedTransport
    from halo.transport.streams import CudaDevice

    if comm.size < 2:
        pytest.skip("a plan with neighbours needs 2 ranks")
    grid = halo.ProcessGrid(comm, (comm.size, 1, 1))
    x = make_cloud(5, "random", batch=2)
    cuts = halo.uniform_cuts(x.spatial_shape, grid.dims)
    mine = x.coords[halo.owner_ranks(grid, cuts, x.coords) == grid.rank]
    transport = StagedTransport(halo.MPITransport(grid.comm), CudaDevice())
    coords = mine.cuda()
    build_plan(grid, cuts, coords, 1, transport=transport)  # warm-up: first use allocates
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            plan = build_plan(grid, cuts, coords, 1, transport=transport)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [f"{w.filename}:{w.lineno}" for w in caught
             if "synchroniz" in str(w.message) and w.filename.endswith("halo/plan.py")]
    assert len(waits) == 2, waits
    ref = build_plan(grid, cuts, mine, 1)
    assert (plan.send_ranks, plan.recv_ranks) == (ref.send_ranks, ref.recv_ranks)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(plan.send_rows, ref.send_rows))
    assert torch.equal(plan.halo_coords.cpu(), ref.halo_coords) and plan.num_halo > 0
    assert plan.send_runs == ref.send_runs and torch.equal(plan.edge_rows.cpu(), ref.edge_rows)
