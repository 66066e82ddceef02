"""Spatially parallel sparse convolution: each rank owns a box of the voxel grid (Distconv-style).

    group = SpatialGroup(spatial_comm, dims=(2, 2, 1))           # once
    domain = group.decompose(batch_x, align=model.total_stride)  # per batch: the cuts
    # a layer on a tensor whose context has a spatial domain then asks it for its maps and
    # its convolution (sparsepipe_hpc.nn.conv):
    entry = domain.entry(x, spec, key)                     # collective when a halo plan is built
    y_feats = domain.conv(x_feats, weight, entry, engine, transposed=False)

A distributed convolution on one rank::

    start halo exchange ──► local conv (local inputs -> local outputs) ──► wait ──► + halo conv
         (features of boundary voxels travel to the neighbours that need them, while the
          interior is computed; MPI is progressed by Request.test() between kernel offsets)

Backward is the adjoint: the halo rows' gradients are computed first and sent back to their
owners while the local input and weight gradients are computed, then accumulated.

Which convolutions need a halo: a submanifold kernel k with dilation d reaches d*(k//2) voxels
beyond the box. A strided convolution reads inputs [o*s - p, o*s - p + (k-1)*d] for an output o;
with cuts aligned to every stride, kernel 2 stride 2 stays inside the box and needs none, kernel 3
stride 2 padding 1 reaches one voxel below it. An output belongs to the rank whose box (at the
output's stride) holds it, so a strided layer keeps only outputs in its own box, which may be
reached by halo inputs alone. Cuts need not be aligned: a cut m voxels past a multiple of the
stride makes outputs read m voxels further below their box, and the halo grows by m
(:func:`halo.plan.halo_radius`); aligning cuts to the model's total stride avoids that traffic. The inverse of a haloed convolution runs the same maps transposed:
its contributions to halo rows travel back to their owners (the adjoint exchange), and its
backward fetches those rows' gradients (the forward exchange).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from halo.cuts import Cuts, CutError, balanced_cuts, uniform_cuts
from halo.exchange import HaloExchange
from halo.grid import ProcessGrid
from halo.kmap import KernelMap, coord_keys, kernel_map, windows_tile
from halo.plan import build_plan, halo_radius
from halo.transport.base import Transport
from halo.transport.mpi import MPITransport
from sparsepipe_hpc import mapstream
from sparsepipe_hpc.engine.base import Engine
from sparsepipe_hpc.kmaps import ConvEntry, ConvError, ConvSpec, cached_entry
from sparsepipe_hpc.parallel.failures import run_on_all
from sparsepipe_hpc.sparse import SparseTensor, SparseTensorError
from sparsepipe_hpc.tracing import profiled, profiling, span

__all__ = ["SpatialGroup", "SpatialDomain", "check_payloads"]


@dataclass
class DistMaps:
    """A distributed convolution's split kernel maps and the exchange that feeds the halo rows."""

    local_map: Optional[KernelMap]  # local input rows -> local output rows (None: built on use)
    halo: Optional[KernelMap]  # halo rows (0..H-1) -> local output rows; None: no halo
    exchange: Any = None
    group: Any = None          # the SpatialGroup, which keeps the exposed-wait clock
    # A submanifold layer's local part is an ordinary submanifold convolution of this rank's
    # voxels: (coords, spatial_shape, batch_size, kernel_size, dilation) to build the engine's
    # own map of it (spconv: its indices and kernels, implicit GEMM on CUDA), once per engine.
    subm: Optional[tuple] = None
    native: dict = field(default_factory=dict, repr=False)

    build_local: Optional[Callable[[], KernelMap]] = None

    @property
    def local(self) -> KernelMap:
        """The local part's explicit pairs; built on first use when the engine's own map made
        them unnecessary so far."""
        if self.local_map is None:
            assert self.build_local is not None
            self.local_map = self.build_local()
        return self.local_map

    def local_for(self, engine: Engine) -> Any:
        """The local part's map for ``engine``: its own submanifold map when it has one, else
        :attr:`local` (the same pairs; tests/mpi/test_spatial_local.py proves them equal)."""
        if self.subm is None:
            return self.local
        if engine.name not in self.native:
            self.native[engine.name] = engine.subm_map(*self.subm)
        m = self.native[engine.name]
        return self.local if m is None else m

    def wait(self, pending: Any) -> Any:
        """Wait for an exchange, counting the time blocked as exposed communication."""
        t = time.perf_counter()
        with span("halo wait", "halo"):
            out = pending.wait()
        self.group.exposed_wait_s += time.perf_counter() - t
        return out


TransportSpec = Union[Transport, Callable[[Any], Transport], None]


def check_payloads(x: SparseTensor, payloads: Sequence[Any]) -> None:
    """Each payload is a tensor with one row per voxel of ``x`` (labels [N], features [N, C]);
    TypeError or ValueError naming the first that is not."""
    for i, p in enumerate(payloads):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"payload {i} is a {type(p).__name__}; payloads must be tensors")
        if p.ndim == 0 or len(p) != x.num_voxels:
            raise ValueError(f"payload {i} has shape {tuple(p.shape)}; it must have one row per "
                             f"voxel of the batch ({x.num_voxels})")


class SpatialGroup:
    """The ranks that share every sample of a replica: a Cartesian grid and its transport.

    ``transport``: what moves this group's halo rows and plan coordinates: a
    :class:`~halo.transport.base.Transport` over the grid's ranks, or a function that makes one
    from the grid's communicator (``lambda comm: make_transport("staged", comm, device)``);
    default mpi4py on host tensors. Device tensors need a device transport (staged, ipc, nccl).
    :meth:`close` closes what such a function returned; a transport passed in is its maker's
    to close.
    """

    def __init__(self, comm: Any, dims: Sequence[int], transport: TransportSpec = None,
                 overlap: bool = True, native_local: bool = True):
        self.grid = ProcessGrid(comm, dims)
        if transport is None:
            transport = MPITransport
        # A transport made here is closed here; one passed in is its maker's to close.
        self._owns_transport = not isinstance(transport, Transport)
        self.transport: Transport = (transport if isinstance(transport, Transport)
                                     else transport(self.grid.comm))
        self.overlap = overlap
        # Submanifold layers' local parts through the engine's own map (False: our KernelMap
        # for every part, the path before; kept for the equality tests and the benchmark).
        self.native_local = native_local
        self.exposed_wait_s = 0.0  # time blocked in exchange waits (what overlap did not hide)

    def close(self) -> None:
        """Close the transport made for this group and free the grid's communicator
        (collective over the group, once every exchange has completed; again: nothing)."""
        if self._owns_transport:
            self.transport.close()
        self.grid.free()

    def decompose(self, x: SparseTensor, align: int = 1, balanced: bool = True,
                  cuts: Optional[Cuts] = None, payloads: Sequence[Any] = ()
                  ) -> "SpatialDomain":
        """Cut the grid for a batch every rank of the group holds in full (collective).

        ``cuts``: explicit positions (level-0 voxels) instead of balanced or uniform ones; they
        must span the batch's extent on this group's grid (CutError otherwise, on every rank).
        ``payloads``: per-voxel tensors that will be split with the batch, checked with it
        (:func:`check_payloads`; ValueError or TypeError on every rank).
        """
        extent = [n * x.stride for n in x.spatial_shape]
        alone = self.grid.comm.Get_size() == 1  # one box: no checksum to compare, no balancing

        def check() -> tuple:
            x.validate("batch")
            check_payloads(x, payloads)
            if cuts is not None and (cuts.dims != self.grid.dims or list(cuts.extent) != extent):
                raise CutError(f"explicit cuts {cuts} are for a grid {cuts.dims} over extent "
                               f"{cuts.extent}; this group's grid is {self.grid.dims} and the "
                               f"batch's extent {tuple(extent)} (level-0 voxels)")
            checksum = 0 if alone else int(coord_keys(x.coords).sum())  # a device read
            return (x.num_voxels, checksum, tuple(x.spatial_shape), x.batch_size, x.stride,
                    align, balanced, repr(cuts), len(payloads))

        # Collective from here on: the ranks agree first (two small allgathers) that each holds
        # the same valid batch and options, so a rank that differs stops them all, by name.
        outcome = run_on_all(self.grid.comm, check)
        if outcome.failures:
            rank, kind, msg = outcome.failures[0]
            error = {"SparseTensorError": SparseTensorError, "ValueError": ValueError,
                     "TypeError": TypeError}.get(kind, CutError)
            raise error(f"{msg} (rank {rank} of the spatial group)")
        seen = self.grid.comm.allgather(outcome.value)
        if len(set(seen)) > 1:
            fields = ("voxels", "coordinate checksum", "spatial_shape", "batch_size", "stride",
                      "align", "balanced", "cuts", "payloads")
            differ = [f"{name}: " + ", ".join(f"rank {r} {v[i]}" for r, v in enumerate(seen))
                      for i, name in enumerate(fields) if len({v[i] for v in seen}) > 1]
            raise CutError(f"the ranks of the spatial group must decompose the same batch with "
                           f"the same options; they differ in {'; '.join(differ)}")
        if cuts is None and balanced and not alone:
            # Every rank holds the whole batch: let one rank contribute so each voxel counts once.
            xyz = x.coords[:, 1:] * x.stride
            if self.grid.comm.Get_rank() != 0:
                xyz = xyz[:0]
            cuts = balanced_cuts(self.grid.comm, xyz, extent, self.grid.dims, align=align)
        elif cuts is None:
            cuts = uniform_cuts(extent, self.grid.dims, align=align)
        return SpatialDomain(self, cuts)


class SpatialDomain:
    """One batch's decomposition: the cuts, and the distributed forms of the layers."""

    def __init__(self, group: SpatialGroup, cuts: Any):
        self.group = group
        self.grid = group.grid
        self.cuts = cuts

    def owned_rows(self, coords: torch.Tensor, stride: int = 1) -> torch.Tensor:
        """bool [N]: rows of ``coords [N, 4]`` (at ``stride``) inside this rank's box."""
        where = torch.as_tensor(self.cuts.locate(coords[:, 1:], stride=stride))
        mine = torch.tensor(self.grid.coords).to(where.device, non_blocking=True)  # no sync
        return (where == mine).all(1)

    # --- convolution -----------------------------------------------------------------------------
    def conv(self, feats: torch.Tensor, weight: torch.Tensor, entry: ConvEntry, engine: Engine,
             transposed: bool) -> torch.Tensor:
        """The distributed convolution of ``feats`` [N_in, C_in] (this rank's rows of the
        entry's inputs; its outputs' rows when ``transposed``) by ``weight`` [C_out, K, C_in]
        over ``entry``'s split maps: [N_out, C_out]. Collective over the group (the halo
        exchange), in the layer order every rank runs."""
        maps = entry.extra
        if not isinstance(maps, DistMaps):
            raise ConvError("a kernel map built without a spatial context (single-process) is "
                            "used on a spatially distributed tensor; run the whole network on "
                            "tensors from one source")
        return _DistConv.apply(feats, weight, maps, engine, self.group.overlap, transposed)

    def entry(self, x: SparseTensor, spec: ConvSpec, key: str) -> ConvEntry:
        """The distributed map of a (non-transposed) convolution ``spec`` on ``x``, cached in
        ``x.kmaps[key]`` (the build is collective over the group when the convolution needs a
        halo plan)."""
        return cached_entry(x, key, spec, lambda: self._build_entry(x, spec))

    def _build_entry(self, x: SparseTensor, s: ConvSpec) -> ConvEntry:
        geometry = s.geometry
        # Cuts off the output's stride grid make outputs read inputs below their box.
        misalign = 0 if s.subm else self.cuts.misalignment(s.stride, x.stride)
        radius = halo_radius(*geometry, misalign=misalign)
        out_shape = s.out_shape(x.spatial_shape)
        alone = self.grid.size == 1  # one box, every voxel in it: no halo, no ownership test
        plan = build_plan(self.grid, self.cuts, x.coords, radius, stride=x.stride,
                          transport=self.group.transport) if radius > 0 and not alone else None
        local: Optional[KernelMap] = None
        if s.subm:
            out = x.coords
        elif plan is not None:
            out = plan.owned_outputs(x.coords, *geometry, out_shape)
        else:  # every input an output of this box reads is in the box (one box, aligned cuts)
            out, local = mapstream.strided_map(x.coords, *geometry, out_shape, x.batch_size)
            # Windows that tile the grid from cuts on the output's grid (a U-Net's k2s2) put the
            # outputs of this box's inputs in this box: no ownership test (a device sync).
            tiles = windows_tile(s.kernel_size, s.stride, s.dilation) and s.padding == 0 \
                and misalign == 0
            mine = None if alone or tiles else self.owned_rows(out, stride=x.stride * s.stride)
            if mine is not None and not bool(mine.all()):
                out, local = out[mine], None
        # A submanifold layer's local part usually runs on the engine's own map (DistMaps.subm):
        # its explicit local pairs are then built only if an engine without one asks.
        native = s.subm and self.group.native_local
        coords = x.coords

        def build_local() -> KernelMap:
            return kernel_map(coords, out, *geometry)

        if plan is None or not (plan.send_ranks or plan.recv_ranks):
            # Nothing to exchange on this rank, and so no peer waits for it either.
            if local is None and not native:
                local = build_local()
            maps = DistMaps(local, None, build_local=build_local)
        elif native:
            # The halo pairs alone: a lookup of the edge rows' stencils among the halo voxels
            # gives exactly the halo half of the split map (each output has one input per offset).
            halo = plan.subm_halo_map(x.coords, s.kernel_size, s.dilation)
            maps = DistMaps(None, halo, HaloExchange(plan, self.group.transport), self.group,
                            build_local=build_local)
        else:
            local, halo = plan.kernel_maps(x.coords, out, *geometry)
            maps = DistMaps(local, halo, HaloExchange(plan, self.group.transport), self.group)
        if native:
            maps.subm = (x.coords, x.spatial_shape, x.batch_size, s.kernel_size, s.dilation)
        return ConvEntry(s, x.coords, out, x.spatial_shape, out_shape, x.stride, None, maps,
                         batch_size=x.batch_size)


class _DistConv(torch.autograd.Function):
    """A convolution split into local and halo parts, with the exchange overlapped (see module)."""

    @staticmethod
    def forward(ctx, feats, weight, maps: DistMaps, engine: Engine, overlap: bool,
                transposed: bool):
        ctx.maps, ctx.engine, ctx.overlap, ctx.transposed = maps, engine, overlap, transposed
        local = maps.local.transpose() if transposed else maps.local_for(engine)
        if maps.halo is None:
            ctx.save_for_backward(feats, weight, None)
            with profiled(_LOCAL):
                return engine.forward(feats, weight, local)
        halo_map = maps.halo.transpose() if transposed else maps.halo
        if transposed:
            # Contributions to rows the neighbours own go first, so they travel during the rest.
            with profiled(_HALO):
                contrib = engine.forward(feats, weight, halo_map)
            pending = _start(maps.exchange.start_adjoint, contrib)
            del contrib  # not held through the local part (the exchange keeps what it sends)
            out = _overlapped(maps, pending, overlap,
                              lambda p: engine.forward(feats, weight, local, p))
            out += maps.wait(pending)
            ctx.save_for_backward(feats, weight, None)
            return out
        pending = _start(maps.exchange.start, feats.detach())
        out = _overlapped(maps, pending, overlap, lambda p: engine.forward(feats, weight, local, p))
        halo = maps.wait(pending)
        with profiled(_HALO):
            engine.forward(halo, weight, halo_map, out=out)
        ctx.save_for_backward(feats, weight, halo)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        feats, weight, halo = ctx.saved_tensors
        maps, engine, overlap = ctx.maps, ctx.engine, ctx.overlap
        grad_out = grad_out.contiguous()
        local = maps.local.transpose() if ctx.transposed else maps.local_for(engine)
        if maps.halo is None:
            with profiled(_LOCAL):
                g_in, g_w = engine.backward(feats, weight, grad_out, local)
            return g_in, g_w, None, None, None, None
        halo_map = maps.halo.transpose() if ctx.transposed else maps.halo
        if ctx.transposed:
            # The gradients of the halo rows live on their owners: fetch them meanwhile.
            pending = _start(maps.exchange.start, grad_out)
            g_in, g_w = _overlapped(maps, pending, overlap,
                                    lambda p: engine.backward(feats, weight, grad_out, local, p))
            g_halo_out = maps.wait(pending)
            with profiled(_HALO):
                g_in, g_w2 = engine.backward(feats, weight, g_halo_out, halo_map, grad_in=g_in)
            return g_in, g_w + g_w2, None, None, None, None
        with profiled(_HALO):
            g_halo, g_w_halo = engine.backward(halo, weight, grad_out, halo_map)
        pending = _start(maps.exchange.start_adjoint, g_halo)
        g_in, g_w = _overlapped(maps, pending, overlap,
                                lambda p: engine.backward(feats, weight, grad_out, local, p))
        g_in += maps.wait(pending)
        return g_in, g_w + g_w_halo, None, None, None, None


# A profile's names for the parts of a distributed convolution (tracing.profiled): in backward,
# which the profiler's Python stacks miss, they tell where a kernel or a blocking call came from.
_LOCAL, _HALO, _START = "dist_conv local part", "dist_conv halo part", "dist_conv halo start"
_PROGRESS = "dist_conv halo progress"  # the exchange's test() between the local part's kernels


def _start(start: Callable[[torch.Tensor], Any], rows: torch.Tensor) -> Any:
    with profiled(_START):
        return start(rows)


def _overlapped(maps: DistMaps, pending: Any, overlap: bool, compute):
    """Run ``compute(progress)`` while the exchange is in flight, or after it without overlap."""
    if not overlap:
        maps.wait(pending)  # idempotent: the later wait() returns the same result at once
    with profiled(_LOCAL):
        return compute(_progress(pending) if overlap else None)


def _progress(pending: Any) -> Callable[[], bool]:
    """``pending.test``, labelled in a profile (the transport's waits are not the local part's)."""
    if not profiling():
        return pending.test

    def test() -> bool:
        with profiled(_PROGRESS):
            return pending.test()
    return test
