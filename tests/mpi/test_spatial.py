"""Spatially parallel layers and models equal the single-process run (float64, every grid).

Every rank builds the same global cloud and runs the serial model on all of it (the oracle), then
runs the same weights on its own box. Outputs are compared row by row (matched by coordinate),
input gradients on owned rows, parameter gradients after the all-reduce.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from halo.kmap import coord_keys
from halo.transport.mpi import MPITransport
from halo.transport.staged import StagedTransport
from halo.transport.staged_reduce import StagedReducer
from halo.transport.ipc import IPCTransport
from halo.transport.ipc_reduce import IPCReducer
from halo.transport.streams import SimDevice
from sparsepipe_hpc.nn import (BatchNorm, GlobalPool, SparseConv3d, SparseInverseConv3d,
                               SparseResNet, SparseUNet, SubMConv3d)
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import LayoutError, RankLayout
from sparsepipe_hpc.sparse import SparseTensor

GRIDS = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 1, 2)], 3: [(3, 1, 1), (1, 3, 1)],
         4: [(2, 2, 1), (1, 2, 2), (4, 1, 1)]}
TOL = dict(rtol=1e-9, atol=1e-10)


def grids_for(comm):
    return GRIDS.get(comm.size, [])


def make_cloud(seed: int, kind: str, shape=(16, 16, 16), batch=2, channels=3) -> SparseTensor:
    """'random': scattered voxels plus every corner, face centre and edge midpoint of the grid;
    'clustered': everything in one octant, so uniform cuts leave boxes empty."""
    g = torch.Generator().manual_seed(seed)
    n = 350
    hi = torch.tensor(shape) if kind == "random" else torch.tensor(shape) // 2
    xyz = (torch.rand(n, 3, generator=g) * hi).long()
    if kind == "random":
        special = torch.tensor([[a, b, c] for a in (0, 7, 8, 15) for b in (0, 8, 15)
                                for c in (0, 7, 15)])
        xyz = torch.cat([xyz, special])
    rows = [torch.cat([torch.full((len(xyz), 1), b), xyz.roll(b * 17, 0)], 1) for b in range(batch)]
    coords = torch.unique(torch.cat(rows), dim=0).int()
    feats = torch.randn(len(coords), channels, generator=g, dtype=torch.float64)
    return SparseTensor(coords, feats, shape, batch)


def rows_of(ref: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    keys = coord_keys(ref)
    order = torch.argsort(keys)
    pos = torch.searchsorted(keys[order], coord_keys(sub))
    found = order[pos.clamp(max=len(order) - 1)]
    assert torch.equal(ref[found], sub), "distributed output has voxels the serial one lacks"
    return found


def run_pair(comm, grid, cuts, net, x, align, probe_seed=7, explicit=None, transport=None,
             reducer=None, bucketed=False, tol=TOL):
    """Serial and distributed forward+backward of ``net`` on ``x``; returns what to compare.
    ``explicit``: Cuts to use instead of the context's (any positions, aligned or not);
    ``transport``, ``reducer``: ParallelContext's arguments; ``bucketed``: gradients through
    its GradientReducer (started in backward), else one flat all-reduce after it; ``tol``:
    assert_close's tolerances."""
    torch.manual_seed(0)
    serial = net().double()
    dist = copy.deepcopy(serial)
    ctx = ParallelContext(comm, RankLayout(1, 1, grid), cuts=cuts, transport=transport,
                          reducer=reducer)
    buckets = ctx.gradient_reducer(dist, 64) if bucketed else None
    if buckets is not None:
        buckets.arm()
    # serial oracle
    fs = x.feats.clone().requires_grad_()
    ys = serial(x.replace(feats=fs, kmaps={}))
    # distributed
    xl, = ctx.distribute(x.replace(kmaps={}), align=align, cuts=explicit)
    fd = xl.feats.clone().requires_grad_()
    yd = dist(xl.replace(feats=fd))
    g = torch.Generator().manual_seed(probe_seed)
    if isinstance(ys, SparseTensor):
        r = torch.randn(ys.feats.shape, generator=g, dtype=torch.float64)
        (ys.feats * r).sum().backward()
        rows = rows_of(ys.coords, yd.coords)
        (yd.feats * r[rows]).sum().backward()
        torch.testing.assert_close(yd.feats, ys.feats[rows].detach(), **tol)
        n_out = comm.allreduce(len(yd.coords))
        assert n_out == len(ys.coords), "outputs lost or duplicated across ranks"
    else:  # dense per-sample output, a copy on every rank: each carries 1/size of the loss
        r = torch.randn(ys.shape, generator=g, dtype=torch.float64)
        (ys * r).sum().backward()
        ((yd * r).sum() / ctx.spatial_size).backward()
        torch.testing.assert_close(yd, ys.detach(), **tol)
    in_rows = rows_of(x.coords, xl.coords)
    torch.testing.assert_close(fd.grad, fs.grad[in_rows], **tol)
    if buckets is not None:
        buckets.finish()
        buckets.close()
    else:
        ctx.allreduce_gradients(dist)
    for (name, ps), pd in zip(serial.named_parameters(), dist.parameters()):
        torch.testing.assert_close(pd.grad, ps.grad, **tol, msg=lambda m: f"{name}: {m}")
    ctx.close()  # collective: the transports and reducers ``transport`` and ``reducer`` made


LAYERS = {
    "subm3": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3)), 1),
    "subm3_dil2": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3, dilation=2)), 2),
    "subm5": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 5)), 2),
    "down_up_k2": (lambda: torch.nn.Sequential(SparseConv3d(3, 4, 2, 2, indice_key="d"),
                                               SparseInverseConv3d(4, 2, 2, indice_key="d")), 2),
    "down_up_k3": (lambda: torch.nn.Sequential(SparseConv3d(3, 4, 3, 2, 1, indice_key="d"),
                                               SparseInverseConv3d(4, 2, 3, indice_key="d")), 2),
    # A stride-1 convolution that grows the voxel set: the next submanifold layer's own maps
    "subm_grow_subm": (lambda: torch.nn.Sequential(
        SubMConv3d(3, 4, 3), SparseConv3d(4, 4, 3, 1, 1), SubMConv3d(4, 4, 3)), 1),
    "bn": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3), BatchNorm(4)), 1),
    "avgpool": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3), GlobalPool("avg")), 1),
    "maxpool": (lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3), GlobalPool("max")), 1),
}


@pytest.mark.parametrize("cuts", ["uniform", "balanced"])
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_equivalence(comm, layer, kind, cuts):
    net, align = LAYERS[layer]
    x = make_cloud(11, kind)
    for grid in grids_for(comm):
        run_pair(comm, grid, cuts, net, x, align)


@pytest.mark.parametrize("cuts", ["uniform", "balanced"])
@pytest.mark.parametrize("model", ["unet", "resnet"])
def test_model_equivalence(comm, model, cuts):
    x = make_cloud(5, "random", shape=(16, 16, 16), batch=2)
    if model == "unet":
        net = lambda: SparseUNet(3, 5, width=4, depth=2)  # noqa: E731
    else:
        net = lambda: SparseResNet(3, 5, width=4, depth=2, pool="max")  # noqa: E731
    for grid in grids_for(comm):
        run_pair(comm, grid, cuts, net, x, align=4)


def staged_on_stand_in(comm):
    """The host-staged device transport, its streams on the CPU stand-in device."""
    return StagedTransport(MPITransport(comm), SimDevice())


class IPCOnStandIn:
    """Makes IPC device transports and reducers, their streams on the CPU stand-in device and
    their buffers and events in shared memory, and keeps them (to count and check). No lag: the
    layers read what a wait delivered on the host at once, where a GPU would read it on the
    stream."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def transport(self, comm):
        self.made.append(IPCTransport(comm, SimDevice()))
        return self.made[-1]

    def reducer(self, comm):
        self.made.append(CountingIPCReducer(comm, SimDevice()))
        return self.made[-1]

    def all_closed(self) -> bool:
        """Every transport and reducer made is closed, and no shared-memory file of this
        process is left (buffers and events are unlinked on close)."""
        transports = [m.transport if isinstance(m, IPCReducer) else m for m in self.made]
        return all(t.closed for t in transports) and not own_shm_files()


def own_shm_files() -> list[str]:
    """This process's SimIPCMemory files in /dev/shm."""
    import os

    from halo.transport.ipc_memory import PREFIX

    mine = f"{PREFIX}{os.getpid()}-"
    return [f for f in os.listdir("/dev/shm") if f.startswith(mine)]


class CountingIPCReducer(IPCReducer):
    """An IPCReducer that counts the all-reduces started through it."""

    started = 0

    def iallreduce_(self, t, op="sum"):
        self.started += 1
        return super().iallreduce_(t, op)


class CountingReducers:
    """Makes host-staged reducers on the stand-in device and keeps them (to count their use)."""

    def __init__(self) -> None:
        self.made: list[StagedReducer] = []

    def __call__(self, comm):
        self.made.append(StagedReducer(comm, SimDevice()))
        return self.made[-1]


@pytest.mark.parametrize("transport", ["staged", "ipc"])
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("model", ["unet", "down_up_k3", "bn", "maxpool"])
def test_device_transport_equals_serial(comm, model, kind, transport):
    """Halo rows, their adjoint and the plans' coordinates through StagedTransport or
    IPCTransport, and BatchNorm statistics, pooled sums and bucketed gradients through the
    matching reducer (StagedReducer: device -> staging -> MPI -> staging -> device; IPCReducer:
    device -> peers' devices; ordered by stream events, here on the stand-in device, on a GPU
    the same code on CudaDevice): the serial result, on every grid."""
    if model == "unet":
        net, align = (lambda: SparseUNet(3, 5, width=4, depth=2)), 4  # noqa: E731
    else:
        net, align = LAYERS[model]
    x = make_cloud(3, kind)
    for grid in grids_for(comm):
        if transport == "ipc":
            ipc = IPCOnStandIn()
            run_pair(comm, grid, "balanced", net, x, align, transport=ipc.transport,
                     reducer=ipc.reducer, bucketed=True)
            assert ipc.all_closed(), "ParallelContext.close left IPC buffers or events open"
            reduced = sum(m.started for m in ipc.made if isinstance(m, IPCReducer))
        else:
            reducers = CountingReducers()
            run_pair(comm, grid, "balanced", net, x, align, transport=staged_on_stand_in,
                     reducer=reducers, bucketed=True)
            reduced = sum(r.pool.allocated for r in reducers.made)
        if comm.size > 1:  # statistics / pooling (spatial) group and the gradient buckets
            assert reduced > 0, "no reduction went through the reducer"


def test_context_closes_after_success_once_and_leaves_nothing_open(comm):
    """``with ParallelContext(...)`` closes the transports and reducers it made and frees its
    communicators; after an exception it closes nothing (a collective close would wait for
    ranks that raised nothing); a second close, or one through a bound copy, does nothing."""
    from mpi4py import MPI

    ipc = IPCOnStandIn()
    layout = RankLayout(1, 1, (comm.size, 1, 1))
    with pytest.raises(RuntimeError, match="on this rank"):
        with ParallelContext(comm, layout, transport=ipc.transport, reducer=ipc.reducer,
                             force_spatial=True) as ctx:
            raise RuntimeError("on this rank")
    assert ctx.spatial_comm != MPI.COMM_NULL and not any(t.closed for t in ipc.made
                                                         if isinstance(t, IPCTransport))
    bound = ctx.bind(None)
    with ctx:
        ctx.allreduce(torch.ones(3))  # still usable
    assert ipc.all_closed()
    assert MPI.COMM_NULL == ctx.spatial_comm == ctx.stats_comm == ctx.group.grid.comm
    bound.close()
    ctx.close()
    for use in (lambda c: c.allreduce(torch.ones(3)), lambda c: c.global_count(1),
                lambda c: c.distribute(make_cloud(3, "random"))):
        for c in (ctx, bound):
            with pytest.raises(RuntimeError, match="used after close"):
                use(c)
    # A transport passed in (not a function making one) is the caller's: close leaves it open.
    mine = IPCTransport(comm, SimDevice())
    ParallelContext(comm, layout, transport=mine, force_spatial=True).close()
    assert not mine.closed
    mine.close()


def odd_cuts(grid, extent, offset):
    """Cuts at odd positions (``offset`` voxels past a multiple of 4), so no stride-2 or stride-4
    layer sees aligned boxes; interior boxes stay >= 4 voxels thick."""
    from halo.cuts import Cuts

    bounds = []
    for n, e in zip(grid, extent):
        inner = [(i * e) // n // 4 * 4 + offset for i in range(1, n)]
        bounds.append([0, *inner, e])
    return Cuts(tuple(bounds))


def _small_net(model: str):
    """A maker of a depth-2 U-Net ("unet") or of one of LAYERS."""
    if model == "unet":
        return lambda: SparseUNet(3, 5, width=4, depth=2)
    return LAYERS[model][0]


@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("model", ["unet", "down_up_k2", "down_up_k3"])
def test_misaligned_cuts_are_exact(comm, model, offset):
    """Cuts that split a stride-2 kernel-2 window (any position, align=1) still give the serial
    result: strided layers fetch the inputs below their box through the halo."""
    x = make_cloud(5, "random", shape=(16, 16, 16), batch=2)
    net = _small_net(model)
    for grid in grids_for(comm):
        run_pair(comm, grid, "uniform", net, x, align=1,
                 explicit=odd_cuts(grid, x.spatial_shape, offset))


@pytest.mark.parametrize("cuts", ["balanced", 0, 1, 2])
def test_a_batch_at_stride_2_is_split_at_its_stride(comm, cuts):
    """A batch whose voxels are at stride 2, cut at level-0 positions (balanced, or explicit:
    on, one and two voxels past a multiple of 4), equals the serial run: each rank keeps the
    voxels its box holds at that stride. (Rows picked at stride 1 split k2s2 windows between
    ranks, and with cuts aligned at stride 2 no halo repaired it: partial sums twice.)"""
    x = make_cloud(5, "random", shape=(16, 16, 16), batch=2)
    coords = torch.unique(torch.cat([x.coords[:, :1], x.coords[:, 1:] // 2], 1), dim=0)
    feats = torch.randn(len(coords), 3, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64)
    x = SparseTensor(coords, feats, (8, 8, 8), 2, stride=2)
    for grid in grids_for(comm):
        explicit = None if cuts == "balanced" else odd_cuts(grid, (16, 16, 16), cuts)
        run_pair(comm, grid, "balanced", _small_net("down_up_k2"), x, align=1, explicit=explicit)
        run_pair(comm, grid, "balanced", lambda: torch.nn.Sequential(
            SparseConv3d(3, 4, 2, 2), GlobalPool("avg")), x, align=1, explicit=explicit)


@pytest.mark.parametrize("cuts", ["uniform", "balanced"])
def test_unaligned_default_is_exact(comm, cuts):
    """The library default align=1 (cuts anywhere) gives the serial U-Net's output and gradients."""
    x = make_cloud(8, "random", shape=(16, 16, 16), batch=2)
    for grid in grids_for(comm):
        run_pair(comm, grid, cuts, lambda: SparseUNet(3, 5, width=4, depth=2), x, align=1)


def test_hybrid_spatial_and_data_parallel(comm):
    """Replicas x spatial grid: a global batch split by samples and boxes equals the serial run."""
    if comm.size % 2:
        pytest.skip("needs an even world")
    grid = (comm.size // 2, 1, 1)
    layout = RankLayout(2, 1, grid)
    ctx = ParallelContext(comm, layout)
    x = make_cloud(3, "random", batch=4)
    torch.manual_seed(0)
    serial = SparseUNet(3, 4, width=4, depth=2).double()
    dist = copy.deepcopy(serial)
    labels = (coord_keys(x.coords) % 4)
    loss_s = torch.nn.functional.cross_entropy(serial(x).feats, labels)
    loss_s.backward()
    # replica r takes samples 2r, 2r+1 (renumbered 0, 1)
    keep = (x.coords[:, 0] // 2) == ctx.replica
    coords = x.coords[keep].clone()
    coords[:, 0] -= 2 * ctx.replica
    xr = SparseTensor(coords, x.feats[keep], x.spatial_shape, 2)
    xl, yl = ctx.distribute(xr, labels[keep], align=4)
    out = dist(xl)
    share = torch.nn.functional.cross_entropy(out.feats, yl, reduction="sum") / \
        ctx.global_count(len(yl))
    share.backward()
    total = ctx.allreduce(share.detach().clone())
    torch.testing.assert_close(total, loss_s.detach(), **TOL)
    ctx.allreduce_gradients(dist)
    for ps, pd in zip(serial.parameters(), dist.parameters()):
        torch.testing.assert_close(pd.grad, ps.grad, **TOL)


@pytest.mark.parametrize("cuts", ["uniform", "balanced"])
def test_optimizer_steps_match_serial(comm, cuts):
    """Three SGD steps on a spatial grid over all ranks give the serial run's parameters."""
    x = make_cloud(9, "random", batch=2)
    labels = coord_keys(x.coords) % 3
    torch.manual_seed(0)
    serial = SparseUNet(3, 3, width=4, depth=2).double()
    dist = copy.deepcopy(serial)
    ctx = ParallelContext(comm, RankLayout(1, 1, (comm.size, 1, 1)), cuts=cuts)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(dist.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt_s.zero_grad()
        torch.nn.functional.cross_entropy(serial(x.replace(kmaps={})).feats, labels).backward()
        opt_s.step()
        opt_d.zero_grad()
        xl, yl = ctx.distribute(x.replace(kmaps={}), labels, align=4)
        share = torch.nn.functional.cross_entropy(dist(xl).feats, yl, reduction="sum") / \
            ctx.global_count(len(yl))
        share.backward()
        ctx.allreduce_gradients(dist)
        opt_d.step()
    for ps, pd in zip(serial.parameters(), dist.parameters()):
        torch.testing.assert_close(pd, ps, **TOL)
    for bs, bd in zip(serial.buffers(), dist.buffers()):
        torch.testing.assert_close(bd.double(), bs.double(), **TOL)


def test_collect_gathers_predictions_back(comm):
    """collect() puts every rank's per-voxel results back in the full batch's row order."""
    x = make_cloud(4, "clustered")
    for grid in grids_for(comm):
        ctx = ParallelContext(comm, RankLayout(1, 1, grid))
        xl, = ctx.distribute(x, align=2)
        keys = coord_keys(xl.coords)
        full = ctx.collect(xl.coords, torch.stack([keys, keys * 2], 1), x.coords)
        k = coord_keys(x.coords)
        assert torch.equal(full, torch.stack([k, k * 2], 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float32])
def test_collect_any_dtype_and_row_shape(comm, dtype):
    """collect() of values numpy cannot hold (bfloat16) and rows of any shape, bit for bit."""
    x = make_cloud(5, "clustered")

    def value_of(coords):  # a pure function of the voxel: [n, 2, 3]
        k = coord_keys(coords).remainder(1009).double()
        v = torch.stack([k * j - 500.25 for j in range(6)], 1).reshape(-1, 2, 3)
        return v.remainder(2) > 1 if dtype == torch.bool else v.to(dtype)

    for grid in grids_for(comm):
        ctx = ParallelContext(comm, RankLayout(1, 1, grid))
        xl, = ctx.distribute(x, align=2)
        full = ctx.collect(xl.coords, value_of(xl.coords), x.coords)
        assert full.dtype == dtype and torch.equal(full, value_of(x.coords))
        # The same count of voxels, but one twice and another missing: not the same voxel set.
        twice = x.coords.clone()
        twice[1] = twice[0]
        with pytest.raises(ValueError, match=r"or different ones \(or one twice\)"):
            ctx.collect(xl.coords, value_of(xl.coords), twice)
        if ctx.group is not None:  # only the last rank's full_coords is off: all raise
            mine = twice if comm.rank == comm.size - 1 else x.coords
            with pytest.raises(ValueError, match=r"or one twice\)|another spatial rank's "
                                                 r"full_coords does not match"):
                ctx.collect(xl.coords, value_of(xl.coords), mine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_collect_returns_on_the_values_device(comm):
    x = make_cloud(6, "random")
    for grid in grids_for(comm):
        ctx = ParallelContext(comm, RankLayout(1, 1, grid))
        xl, = ctx.distribute(x, align=2)
        values = coord_keys(xl.coords).float().cuda()
        full = ctx.collect(xl.coords.cuda(), values, x.coords)
        assert full.device == values.device
        assert torch.equal(full.cpu(), coord_keys(x.coords).float())


def test_bad_input_raises_on_every_rank(comm):
    """Out-of-grid voxels and boxes thinner than a kernel's reach fail alike on all ranks."""
    from halo.cuts import CutError
    from sparsepipe_hpc.sparse import SparseTensorError

    if comm.size < 3:
        pytest.skip("needs an interior box")
    ctx = ParallelContext(comm, RankLayout(1, 1, (comm.size, 1, 1)), cuts="uniform")
    x = make_cloud(1, "random", shape=(16, 16, 16))
    bad = x.replace(coords=x.coords.clone())
    bad.coords[0, 1] = 16
    with pytest.raises(SparseTensorError, match="coordinate x spans"):
        ctx.distribute(bad)
    # 3 or 4 boxes over 4 voxels along x: interior boxes 1 voxel thick, but a 5x5x5 kernel
    # reaches 2 voxels, so a one-hop halo cannot cover it.
    thin = make_cloud(2, "random", shape=(16, 16, 16))
    keep = thin.coords[:, 1] < 4
    thin = thin.replace(coords=thin.coords[keep].contiguous(), feats=thin.feats[keep],
                        spatial_shape=(4, 16, 16))
    xl, = ctx.distribute(thin)
    with pytest.raises(CutError):
        SubMConv3d(3, 2, 5).double()(xl)


def test_distribute_refuses_a_payload_without_a_row_per_voxel(comm):
    """A payload (labels) one row short or long, a scalar or not a tensor is named on every
    rank, also where only rank 0 passes it; one of the right length is split as the voxels
    are."""
    ctx = ParallelContext(comm, RankLayout(1, 1, (comm.size, 1, 1)), cuts="uniform")
    x = make_cloud(2, "random", shape=(16, 16, 16))
    labels = coord_keys(x.coords)
    for bad in (labels[1:], torch.cat([labels, labels[:1]]), labels[0]):
        for everywhere in (True, False):
            with pytest.raises(ValueError, match=re.escape(
                    f"payload 1 has shape {tuple(bad.shape)}; it must have one row per voxel "
                    f"of the batch ({len(labels)})")):
                ctx.distribute(x, labels, bad if everywhere or comm.rank == 0 else labels)
    with pytest.raises(TypeError, match="payload 0 is a list; payloads must be tensors"):
        ctx.distribute(x, labels.tolist())
    if comm.size > 1:
        with pytest.raises(ValueError, match="they differ in payloads: rank 0 1, rank 1 2"):
            ctx.distribute(x, *([labels] * (1 + comm.rank)))
    from helpers import HostReads

    with HostReads() as reads:
        xl, yl = ctx.distribute(x, labels)
    assert torch.equal(yl, coord_keys(xl.coords))
    # The owned rows are found once for the voxels and every payload (each selection by a mask
    # would wait for a GPU); one rank holds the whole batch and selects nothing.
    assert reads.ops.count("nonzero") == (comm.size > 1) and "index" not in reads.ops, reads.ops


def test_a_convolution_on_a_context_bound_to_no_batch_is_refused(comm):
    """A tensor given the bare context (``x.replace(context=ctx)``, or built by hand) looks
    distributed but has no box: its convolutions ran serially on this rank's voxels, without a
    halo, and gave a wrong answer silently; now every rank raises, naming the remedy."""
    from sparsepipe_hpc.kmaps import ConvError

    conv = SubMConv3d(3, 4, 3).double()
    with ParallelContext(comm, RankLayout(1, 1, (comm.size, 1, 1)), force_spatial=True) as ctx:
        xl, = ctx.distribute(make_cloud(1, "random"))
        conv(xl.replace(kmaps={}))  # bound: runs
        with pytest.raises(ConvError, match=r"no batch is bound to.*ctx.distribute"):
            conv(xl.replace(context=ctx, kmaps={}))


def test_a_rank_that_cuts_another_batch_or_with_other_options_stops_every_rank(comm):
    """distribute/decompose is collective: a rank whose batch breaks the contract (here a
    repeated voxel), differs (a voxel less), or whose options differ (align, cuts mode) made its
    peers hang or cut wrongly; now every rank raises, naming the rank and what differs."""
    from halo.cuts import CutError
    from sparsepipe_hpc.sparse import SparseTensorError

    if comm.size < 2:
        pytest.skip("needs a peer")
    layout = RankLayout(1, 1, (comm.size, 1, 1))
    x = make_cloud(1, "random", shape=(16, 16, 16))
    with ParallelContext(comm, layout) as ctx:
        dup = x.replace(coords=torch.cat([x.coords, x.coords[:1]]),
                        feats=torch.cat([x.feats, x.feats[:1]]))
        with pytest.raises(SparseTensorError, match=r"repeat a voxel .* \(rank 1 of the spatial "
                                                    r"group\)"):
            ctx.distribute(dup if comm.rank == 1 else x)
        less = x.replace(coords=x.coords[1:], feats=x.feats[1:])
        with pytest.raises(CutError, match=r"must decompose the same batch .* differ in voxels: "
                                           r"rank 0 \d+, rank 1 \d+"):
            ctx.distribute(less if comm.rank == 1 else x)
        with pytest.raises(CutError, match=r"differ in align: rank 0 2, rank 1 4"):
            ctx.distribute(x, align=4 if comm.rank == 1 else 2)
        ctx.distribute(x, align=2)  # and the group goes on
    with pytest.raises(LayoutError, match=r"same layout and options .* got rank 0 and others "
                                          r"like it: .*'balanced'.*; rank 1 .*'uniform'"):
        ParallelContext(comm, layout, cuts="uniform" if comm.rank == 1 else "balanced")
    other = RankLayout(1, 1, (1, comm.size, 1))
    with pytest.raises(LayoutError, match=r"same layout and options"):
        ParallelContext(comm, other if comm.rank == 1 else layout)  # hung in comm.Split
    with ParallelContext(comm, layout) as ctx:
        net = torch.nn.Linear(3, 5 if comm.rank == 1 else 4)  # broadcast said nothing
        with pytest.raises(LayoutError, match=r"broadcast_parameters: rank 1's module differs"):
            ctx.broadcast_parameters(net)
        with pytest.raises(ValueError, match=r"global_count: a count must be >= 0; rank 1 of "
                                             r"the stage gave -5"):
            ctx.global_count(-5 if comm.rank == 1 else 3)
        assert ctx.global_count(2) == 2 * comm.size


def test_batchnorm_counts_voxels_over_the_group_on_every_rank(comm):
    """One voxel on rank 0 and none elsewhere: fewer than 2 over the group, the same error on
    every rank; one voxel on every rank of 2+, or 3 on rank 0 alone (which then does not read the
    group's count back, while the others do): enough, on every rank."""
    from sparsepipe_hpc.nn.functional import batch_norm

    c = 3
    args = (torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c), True, 0.1, 1e-5)
    x = torch.randn(1 if comm.rank == 0 else 0, c, dtype=torch.float64)
    with pytest.raises(ValueError, match="BatchNorm in training needs at least 2 voxels over its "
                                         "group to take batch statistics; got 1"):
        batch_norm(x, *args, comm=comm)
    if comm.size > 1:
        assert batch_norm(torch.randn(1, c), *args, comm=comm).shape == (1, c)
    n = 3 if comm.rank == 0 else 0
    assert batch_norm(torch.randn(n, c), *args, comm=comm).shape == (n, c)


def test_batchnorm_reads_nothing_back_where_the_rank_has_voxels(comm):
    """The group's count is read back (a device sync on CUDA) only by a rank with fewer than 2
    voxels; with 2 or more, a BatchNorm layer's forward and backward read nothing back."""
    from helpers import HostReads
    from sparsepipe_hpc.nn.functional import batch_norm

    c = 3
    args = (torch.ones(c, requires_grad=True), torch.zeros(c), torch.zeros(c), torch.ones(c),
            True, 0.1, 1e-5)
    x = torch.randn(5, c, requires_grad=True)
    with HostReads() as reads:
        batch_norm(x, *args, comm=comm).square().sum().backward()
    assert reads.count == 0, reads.ops
    if comm.size > 1:  # one voxel here, 2+ over the group: this rank reads the count
        with HostReads() as reads:
            batch_norm(x[:1], *args, comm=comm)
        assert reads.count == 1, reads.ops
