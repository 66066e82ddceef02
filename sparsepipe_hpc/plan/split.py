"""What a spatial split adds to a step: halo plans, the halo parts of the maps, halo pairs.

    from sparsepipe_hpc.plan.split import SplitFit, split_probe, fit_split
    rows = split_probe(list(net.blocks), x, grids=[(2, 1, 1), (2, 2, 1)], repeats=3)
    fits = fit_split(rows, len(net.blocks))     # one SplitFit per block
    fits[1](box_voxels=20000, surface=700)      # extra seconds of block 1 on a split grid

On a grid of more than one box, every submanifold convolution key (``subm:k3:d1:s2``...) of a
step builds, besides the map of its box's own voxels (the engine's, as one process builds it
for the whole batch), a halo plan (select the rows within ``r`` of each of the up to 26
neighbour boxes, :func:`halo.plan.select_sends`) and the halo part of the map: the stencils of
those edge rows looked up among the halo voxels (:meth:`halo.plan.HaloPlan.subm_halo_map`);
every such convolution then also runs the halo pairs through the engine, forward and backward.
None of that exists in a one-process profile, so :func:`split_probe` measures it in one process
by playing the busiest box of each grid (cuts: the trainer's balanced quantile cuts,
:func:`halo.cuts.cuts_from_histograms`, halo voxels found in the whole cloud as
:func:`halo.plan.build_plan` would receive them), per block::

    extra = [t(select_sends) + t(halo part's map over the edge rows)]
            summed over the keys the block creates
          + t(halo-pair forward + backward) summed over the block's haloed convolutions

The point-to-point messages of a plan build are latency (an all-reduce and two neighbour
rounds per key) and are not in it. :func:`fit_split` fits per block, by non-negative least
squares over the probed (grid, batch) pairs,

    extra(v, s) = c + a * v + b * s       (seconds on the profiled device)

with ``v`` the busiest box's input voxels and ``s`` its input-level surface voxels as the cost
model counts them (:func:`sparsepipe_hpc.plan.cost.surface_voxels`): ``c`` the fixed cost of
one haloed convolution call, ``a`` the per-voxel cost of the selection, ``b`` the per-halo-voxel
cost of the halo part's map and of the halo pairs. A grid of one box adds nothing (``extra = 0``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from sparsepipe_hpc.nn.amp import autocast_inputs
from sparsepipe_hpc.plan.cost import surface_voxels
from sparsepipe_hpc.plan.probes import clock, visit_halo_convs
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["SplitFit", "SplitRow", "split_probe", "fit_split", "nnls", "box_imbalance",
           "busiest_box", "PROBE_GRIDS"]

#: Grids the profiler plays by default: one, two and three split axes.
PROBE_GRIDS: tuple[tuple[int, int, int], ...] = ((2, 1, 1), (2, 2, 1), (2, 2, 2))


@dataclass(frozen=True)
class SplitFit:
    """``extra(v, s) = max(0, c + a * v + b * s)`` seconds for a box of ``v`` input voxels and
    ``s`` surface voxels (see the module)."""

    c: float = 0.0
    a: float = 0.0
    b: float = 0.0

    def __call__(self, box_voxels: float, surface: float) -> float:
        return max(0.0, self.c + self.a * float(box_voxels) + self.b * float(surface))


@dataclass(frozen=True)
class SplitRow:
    """One probe: grid, the batch's input voxels ``V``, the busiest box's input voxels, the
    cost model's surface voxels, and the measured extra seconds per block."""

    grid: tuple[int, int, int]
    voxels: int
    box_voxels: int
    surface: float
    extra: tuple[float, ...]


def _cuts(coords: torch.Tensor, extent: Sequence[int], dims: Sequence[int], align: int) -> Any:
    from halo.cuts import axis_histograms, cuts_from_histograms
    xyz = coords[:, 1:].cpu().numpy()
    return cuts_from_histograms(axis_histograms(xyz, extent, align), extent, dims, align)


def busiest_box(coords: torch.Tensor, extent: Sequence[int], dims: Sequence[int], align: int
                ) -> tuple[Any, tuple[int, int, int], np.ndarray]:
    """(cuts, grid position of the fullest box, voxel count per box [gx, gy, gz]) of the balanced
    quantile cuts the trainer uses. coords: int [N, 4] input voxels (batch, x, y, z)."""
    cuts = _cuts(coords, extent, dims, align)
    where = np.asarray(cuts.locate(coords[:, 1:].cpu().numpy()))
    counts = np.zeros(tuple(dims), np.int64)
    np.add.at(counts, tuple(where.T), 1)
    box = np.unravel_index(int(np.argmax(counts)), counts.shape)
    return cuts, (int(box[0]), int(box[1]), int(box[2])), counts


def box_imbalance(coords: torch.Tensor, extent: Sequence[int], dims: Sequence[int],
                  align: int = 1) -> float:
    """Largest box / mean box of the balanced cuts on ``coords`` (1.0 = perfect); the
    ``imbalance`` of :func:`sparsepipe_hpc.plan.cost.largest_share`."""
    _, _, counts = busiest_box(coords, extent, dims, align)
    return float(counts.max() / max(counts.mean(), 1e-30)) if counts.sum() else 1.0


def _median(fn: Any, repeats: int, now: Any) -> float:
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return statistics.median(times)


def split_probe(blocks: Sequence[Any], x: SparseTensor, grids: Sequence[Sequence[int]],
                repeats: int = 3, align: int = 1) -> list[SplitRow]:
    """Measure each block's extra seconds on the busiest box of every grid (see the module).

    x: the input batch (whole, on the profiled device); align: the model's total stride.
    """
    from halo.plan import HaloPlan, halo_boxes, halo_radius, select_sends
    from sparsepipe_hpc.engine import get_engine

    now = clock(x.feats.device)
    engine = get_engine("auto", x.feats.device)
    convs: dict[str, list[tuple[int, Any, SparseTensor]]] = {}
    visit_halo_convs(blocks, x, lambda k, m, t: convs.setdefault(m.cache_key(t), [])
                     .append((k, m, t)))
    extent = tuple(x.spatial_shape)
    rows = []
    for grid in grids:
        dims = (int(grid[0]), int(grid[1]), int(grid[2]))
        cuts, box, counts = busiest_box(x.coords, extent, dims, align)
        nbrs = [c for c in itertools.product(*(range(n) for n in dims))
                if c != box and max(abs(p - q) for p, q in zip(c, box)) <= 1]
        extra = [0.0] * len(blocks)
        for users in convs.values():
            creator, m0, t = users[0]
            s = m0.spec
            r = halo_radius(s.kernel_size, 1, s.padding, s.dilation)
            where = torch.as_tensor(np.asarray(cuts.locate(t.coords[:, 1:].cpu().numpy(),
                                                           stride=t.stride)))
            mine = (where == torch.tensor(box)).all(1).to(t.coords.device)
            local = t.coords[mine]
            near = torch.zeros(len(t.coords), dtype=torch.bool, device=t.coords.device)
            near[select_sends(t.coords, [halo_boxes(cuts, box, t.stride)], r)[0]] = True
            halo = t.coords[near & ~mine]
            boxes = [halo_boxes(cuts, c, t.stride) for c in nbrs]

            def split() -> Any:
                sends = select_sends(local, boxes, r)
                edge = torch.unique(torch.cat(sends)) if sends else None
                plan = HaloPlan([], [], [], [], halo, len(local), radius=r, edge_rows=edge)
                return plan.subm_halo_map(local, s.kernel_size, s.dilation)

            extra[creator] += _median(split, repeats, now)
            halo_map = split()
            for k, mod, tt in users:
                w, = autocast_inputs(mod.weight_matrix().detach())  # the run's compute dtype
                feats = torch.randn(len(halo), tt.num_channels, device=w.device, dtype=w.dtype)
                grad = torch.randn(len(local), w.shape[0], device=w.device, dtype=w.dtype)

                def pairs() -> None:
                    out = torch.zeros(len(local), w.shape[0], device=w.device, dtype=w.dtype)
                    engine.forward(feats, w, halo_map, out=out)
                    engine.backward(feats, w, grad, halo_map)
                extra[k] += _median(pairs, repeats, now)
        rows.append(SplitRow(dims, x.num_voxels, int(counts.max()),
                             surface_voxels(x.num_voxels, extent, dims), tuple(extra)))
    return rows


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0, for a [m, n] with few columns (n <= ~10).

    Exact, by the KKT conditions: the optimum is the least-squares solution on its own support,
    so it is the best of the non-negative least-squares solutions over every column subset
    (2^n small solves; scipy's iterative NNLS is not needed, nor scipy)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            sub = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if np.all(sub >= 0):
                x = np.zeros(n)
                x[list(cols)] = sub
                err = float(np.sum((a @ x - y) ** 2))
                if err < best_err:
                    best, best_err = x, err
    return best


def fit_split(rows: Sequence[SplitRow], blocks: int) -> tuple[SplitFit, ...]:
    """Per block, ``c, a, b >= 0`` minimising the squared error of ``c + a v + b s`` over
    ``rows`` (:func:`nnls`; columns scaled to unit size first). No rows: zero fits."""
    if not rows:
        return tuple(SplitFit() for _ in range(blocks))
    design = np.array([[1.0, r.box_voxels, r.surface] for r in rows])
    scale = np.maximum(np.abs(design).max(0), 1e-30)
    out = []
    for k in range(blocks):
        y = np.array([r.extra[k] for r in rows])
        c, a, b = (float(v) for v in nnls(design / scale, y) / scale)
        out.append(SplitFit(c, a, b) if all(map(math.isfinite, (c, a, b))) else SplitFit())
    return tuple(out)
