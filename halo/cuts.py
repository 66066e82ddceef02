"""Cut positions: where the global voxel extent is split along each axis, and who owns what.

    cuts = uniform_cuts(extent=(256, 256, 32), dims=(2, 2, 1), align=8)
    cuts = balanced_cuts(comm, xyz, extent=(256, 256, 32), dims=(2, 2, 1), align=8)  # collective
    lo, hi = cuts.box((1, 0, 0), stride=2)     # the box of grid position (1, 0, 0) at stride 2
    g = cuts.locate(xyz)                       # int64 [N, 3] grid position owning each voxel
    cuts.check_thickness(radius=1)             # CutError if a one-hop halo cannot reach far enough

Contract. ``bounds[a]`` is int64 of length ``dims[a] + 1``, from 0 to ``extent[a]``, in level-0
voxel units; box ``c`` along axis ``a`` is ``[bounds[a][c], bounds[a][c+1])``. Interior cuts are
multiples of ``align`` (the network's total stride), so a voxel and all its coarser parents stay
with the same owner. At stride ``s`` a box is ``bounds // s`` (the outer bound is
``ceil(extent / s)``). Ownership is clamped: coordinates below 0 belong to the first box and
coordinates past the extent to the last, so every coordinate has exactly one owner.

Balanced cuts follow the voxels, not the space: each axis is cut at the quantiles of the
all-reduced histogram of voxel positions along it (counted in units of ``align``)::

    voxels per unit   ....::|||||||||::..........::||::...     quantile cuts for 3 boxes
    cumulative        0 ---------------|-----------|----- T    at T/3 and 2T/3
    boxes             [   box 0      ) [  box 1  ) [ box 2 )

For slab grids (n, 1, 1) this balances the voxel count up to one unit's worth per cut. For 2-D
and 3-D grids the axes are cut independently (a tensor-product decomposition), which balances the
marginals but not every box; ``balanced_cuts(..., method="minmax")`` (:mod:`halo.balance`)
minimises the fullest box instead. Figures: the load-balance table of ``sparsepipe_hpc.bench.halo``.

Weighted cuts, for devices of unequal speed: ``weights[a]`` gives each box along axis ``a`` a
share of the voxels proportional to its weight (cut ``i`` at ``T * sum(w[:i]) / sum(w)``), so a
rank twice as slow can own half as many voxels::

    cuts = balanced_cuts(comm, xyz, extent, (2, 1, 1), align=8, weights=[[2, 1], None, None])
    # box 0 gets ~2/3 of the voxels, box 1 ~1/3 (``None``: equal weights on that axis)

On 2-D and 3-D grids the weights are per axis (a box's share is the product of its slabs'
shares), so they suit speeds that vary along one axis, e.g. slower nodes holding a slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch

from halo.kmap import MAX_EXTENT, value_counts

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["CutError", "Cuts", "uniform_cuts", "balanced_cuts", "axis_histograms",
           "cuts_from_histograms", "checked_xyz"]

AXES = "xyz"
ArrayLike = Union[np.ndarray, torch.Tensor]


class CutError(ValueError):
    """Cut positions break their contract, or boxes are too thin for a halo."""


def _triple(v: Union[int, Sequence[int]], name: str) -> tuple[int, int, int]:
    t = (v, v, v) if isinstance(v, (int, np.integer)) else tuple(v)
    if len(t) != 3:
        raise CutError(f"{name} {v!r} needs 3 values (x, y, z) or one int")
    return tuple(int(a) for a in t)  # type: ignore[return-value]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class Cuts:
    """Per-axis cut positions. bounds: 3 int64 arrays [dims[a] + 1], level-0 voxels; see module."""

    bounds: tuple[np.ndarray, np.ndarray, np.ndarray]
    align: int = 1

    def __post_init__(self) -> None:
        if len(self.bounds) != 3:
            raise CutError(f"Cuts.bounds has {len(self.bounds)} axes; it needs 3 (x, y, z)")
        if int(self.align) < 1:
            raise CutError(f"Cuts.align is {self.align}; it must be a positive number of voxels")
        fixed = []
        for a, b in enumerate(self.bounds):
            arr = np.array(b, dtype=np.int64).reshape(-1)
            if len(arr) < 2 or arr[0] != 0 or arr[-1] < 1:
                raise CutError(f"Cuts.bounds[{a}] ({AXES[a]}) is {arr.tolist()}; it must run from 0 "
                               f"to a positive extent with at least 2 entries")
            if np.any(np.diff(arr) < 0):
                raise CutError(f"Cuts.bounds[{a}] ({AXES[a]}) is {arr.tolist()}; cuts must not "
                               f"decrease")
            inner = arr[1:-1]
            if np.any(inner % self.align):
                raise CutError(f"Cuts.bounds[{a}] ({AXES[a]}) is {arr.tolist()}; interior cuts must "
                               f"be multiples of align={self.align}")
            arr.flags.writeable = False  # frozen means frozen: boxes must not move under a plan
            fixed.append(arr)
        object.__setattr__(self, "bounds", tuple(fixed))
        object.__setattr__(self, "align", int(self.align))
        _check_extent_dims(self.extent, self.dims, self.align)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Cuts) and self.align == other.align
                and all(np.array_equal(a, b) for a, b in zip(self.bounds, other.bounds)))

    def __hash__(self) -> int:
        return hash((self.align,) + tuple(tuple(b.tolist()) for b in self.bounds))

    def __repr__(self) -> str:
        return f"Cuts({', '.join(str(b.tolist()) for b in self.bounds)}, align={self.align})"

    @property
    def dims(self) -> tuple[int, int, int]:
        return tuple(len(b) - 1 for b in self.bounds)  # type: ignore[return-value]

    @property
    def extent(self) -> tuple[int, int, int]:
        return tuple(int(b[-1]) for b in self.bounds)  # type: ignore[return-value]

    def axis_bounds(self, axis: int, stride: int = 1) -> np.ndarray:
        """int64 [dims[axis] + 1]: the cuts along ``axis`` in voxels at ``stride``."""
        if stride < 1:
            raise CutError(f"stride is {stride}; it must be a positive integer")
        b = self.bounds[axis] // stride
        b[-1] = _ceil_div(int(self.bounds[axis][-1]), stride)
        return b

    def box(self, grid_coords: Sequence[int], stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(lo int64 [3], hi int64 [3]) of the box at ``grid_coords``, voxels at ``stride``."""
        c = [int(v) for v in grid_coords]
        if len(c) != 3 or any(not 0 <= v < d for v, d in zip(c, self.dims)):
            raise CutError(f"grid position {tuple(c)} is outside the cuts' grid {self.dims}")
        lo = np.empty(3, np.int64)
        hi = np.empty(3, np.int64)
        for a in range(3):
            b = self.axis_bounds(a, stride)
            lo[a], hi[a] = b[c[a]], b[c[a] + 1]
        return lo, hi

    def locate(self, xyz: ArrayLike, stride: int = 1) -> ArrayLike:
        """Grid position owning each voxel: int64 [N, 3], numpy or torch like ``xyz``.

        xyz: int [N, 3] global voxel coordinates at ``stride``. Out-of-extent coordinates are
        clamped to the edge boxes (see the module docstring).
        """
        if xyz.ndim != 2 or xyz.shape[1] != 3:
            raise CutError(f"locate: xyz has shape {tuple(xyz.shape)}; expected [N, 3] (x, y, z)"
                           f" - pass coords[:, 1:] for (batch, x, y, z) rows")
        inner = [self.axis_bounds(a, stride)[1:-1] for a in range(3)]
        if isinstance(xyz, torch.Tensor):  # bounds copied without waiting for the device
            bounds = [torch.from_numpy(b).to(xyz.device, non_blocking=True) for b in inner]
            return torch.stack([torch.searchsorted(bounds[a], xyz[:, a].long().contiguous(),
                                                   right=True) for a in range(3)], 1)
        x = np.asarray(xyz, np.int64)
        return np.stack([np.searchsorted(inner[a], x[:, a], side="right") for a in range(3)],
                        1).astype(np.int64).reshape(-1, 3)

    def count(self, xyz: ArrayLike, stride: int = 1) -> np.ndarray:
        """int64 array of shape ``dims``: how many of the voxels ``xyz [N, 3]`` each box owns."""
        g = self.locate(xyz, stride)
        g = g.cpu().numpy() if isinstance(g, torch.Tensor) else g
        d = self.dims
        flat = (g[:, 0] * d[1] + g[:, 1]) * d[2] + g[:, 2]
        return np.bincount(flat, minlength=d[0] * d[1] * d[2]).reshape(d)

    def misalignment(self, factor: int, stride: int = 1) -> int:
        """How far past a multiple of ``factor`` an interior box boundary can sit, at ``stride``.

        The largest ``(cut // stride) % factor`` over interior cuts: 0 when every cut is a
        multiple of ``stride * factor``. A convolution of stride ``factor`` on voxels at
        ``stride`` owns the outputs of box ``[L, H)`` at stride ``stride * factor`` and so reads
        inputs up to this many voxels below the input box (see :func:`halo.plan.halo_radius`).
        """
        if factor < 1 or stride < 1:
            raise CutError(f"misalignment: factor {factor} and stride {stride} must be >= 1")
        inner = np.concatenate([b[1:-1] for b in self.bounds])
        return int(((inner // stride) % factor).max()) if len(inner) else 0

    def check_thickness(self, radius: int, stride: int = 1) -> None:
        """Raise CutError unless a one-hop halo exchange of ``radius`` voxels (at ``stride``) is exact.

        A halo reaches ``radius`` voxels past a box. It stays within the adjacent boxes when every
        box that has boxes on both sides along an axis is at least ``radius`` thick; the first
        and last boxes may be thin (nothing lies beyond them), even empty.
        """
        if radius < 0:
            raise CutError(f"halo radius is {radius}; it must be >= 0")
        for a in range(3):
            b = self.axis_bounds(a, stride)
            w = np.diff(b)
            for c in range(1, len(w) - 1):
                if w[c] < radius:
                    raise CutError(
                        f"box {c} along axis {AXES[a]} is [{b[c]}, {b[c + 1]}), {w[c]} voxels thick "
                        f"at stride {stride} (cuts {b.tolist()}), thinner than the halo radius "
                        f"{radius}; a one-hop halo exchange needs every interior box at least that "
                        f"thick: use fewer ranks along {AXES[a]} or cuts with min_width >= "
                        f"{radius * stride}")


def _check_extent_dims(extent: Sequence[int], dims: Sequence[int], align: int) -> tuple:
    e = _triple(extent, "extent")
    d = _triple(dims, "dims")
    if min(e) < 1:
        raise CutError(f"extent {e} has an axis of {min(e)} voxels; every axis needs at least 1")
    if max(e) > MAX_EXTENT:
        raise CutError(f"extent {e} has an axis of {max(e)} voxels; at most {MAX_EXTENT} per axis "
                       f"(halo.kmap.MAX_EXTENT: the range of its voxel keys)")
    if min(d) < 1:
        raise CutError(f"dims {d} has an axis with {min(d)} boxes; every axis needs at least 1")
    if align < 1:
        raise CutError(f"align is {align}; it must be a positive number of voxels")
    return e, d


def _units_check(axis: int, extent: int, n: int, align: int, min_units: int) -> int:
    """Number of align-units on the axis; CutError when ``n`` boxes of ``min_units`` do not fit."""
    units = _ceil_div(extent, align)
    if n > 1 and n * min_units > units:  # a single box is the whole extent, however thin
        raise CutError(
            f"axis {AXES[axis]}: extent {extent} voxels is {units} unit(s) of align {align}, too few "
            f"for {n} boxes of at least {min_units * align} voxels each; use fewer ranks along "
            f"{AXES[axis]}, a smaller align or min_width, or a larger extent")
    return units


def uniform_cuts(extent: Sequence[int], dims: Sequence[int], align: int = 1) -> Cuts:
    """Cuts splitting each axis into ``dims[a]`` near-equal boxes, interior cuts multiples of ``align``.

    extent: global voxel extent (x, y, z) at level 0. Every box gets at least one unit of
    ``align`` voxels (the last may be shorter when the extent is not a multiple of ``align``).
    """
    e, d = _check_extent_dims(extent, dims, align)
    bounds = []
    for a in range(3):
        units = _units_check(a, e[a], d[a], align, 1)
        pos = np.array([(i * units) // d[a] for i in range(d[a] + 1)], np.int64) * align
        pos[-1] = e[a]
        bounds.append(pos)
    return Cuts(tuple(bounds), align)  # type: ignore[arg-type]


def checked_xyz(xyz: ArrayLike, extent: Sequence[int]) -> np.ndarray:
    """int64 [N, 3] host copy of level-0 voxel coordinates; CutError unless all lie in extent."""
    e = _triple(extent, "extent")
    x = xyz.detach().cpu().numpy() if isinstance(xyz, torch.Tensor) else np.asarray(xyz)
    if x.ndim != 2 or x.shape[1] != 3:
        raise CutError(f"xyz has shape {x.shape}; expected [N, 3] level-0 (x, y, z) voxel "
                       f"coordinates - pass coords[:, 1:] for (batch, x, y, z) rows")
    x = x.astype(np.int64, copy=False)
    bad = (x < 0) | (x >= np.array(e))
    if bad.any():
        row = int(np.nonzero(bad.any(1))[0][0])
        raise CutError(f"xyz row {row} is {x[row].tolist()}, outside the extent {e} "
                       f"({int(bad.any(1).sum())} such rows); voxels must lie in [0, extent)")
    return x


def axis_histograms(xyz: ArrayLike, extent: Sequence[int], align: int = 1,
                    axes: Sequence[int] = (0, 1, 2)) -> list[np.ndarray]:
    """Per-axis voxel counts in units of ``align``: 3 int64 arrays [ceil(extent[a] / align)].

    xyz: int [N, 3] level-0 voxel coordinates, each in [0, extent). CutError otherwise.
    ``axes``: the axes to count; the others come back as zeros (an axis cut into one part needs
    no counts). A torch tensor is counted on its device and only the counts come to the host: a
    GPU batch's coordinates are not copied (1.7 M voxels took ~40 ms of host work that way).
    """
    e = _triple(extent, "extent")
    sizes = [_ceil_div(v, align) for v in e]
    if isinstance(xyz, torch.Tensor) and xyz.ndim == 2 and xyz.shape[1] == 3:
        t = xyz.detach().long()
        outside = (t < 0).any(1)
        for a in range(3):
            outside |= t[:, a] >= e[a]
        counts = [value_counts((t[:, a] // align).clamp_(0, sizes[a] - 1), sizes[a])
                  if a in axes else t.new_zeros(sizes[a]) for a in range(3)]
        host = torch.cat([outside.sum().reshape(1), *counts]).cpu().numpy()  # one device sync
        if host[0]:
            checked_xyz(xyz, e)  # raises, naming the first such row
        return np.split(host[1:], np.cumsum(sizes)[:-1])
    x = checked_xyz(xyz, e)
    return [np.bincount(x[:, a] // align, minlength=sizes[a]).astype(np.int64) if a in axes
            else np.zeros(sizes[a], np.int64) for a in range(3)]


def _plateau_mid(cs: np.ndarray, b: int) -> int:
    """Middle of the run of boundaries with the same cumulative count as ``b`` (empty space split)."""
    v = cs[b]
    lo = int(np.searchsorted(cs, v, side="left"))
    hi = int(np.searchsorted(cs, v, side="right")) - 1
    return (lo + hi) // 2


def _quantile_axis(hist: np.ndarray, n: int, min_units: int,
                   weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """Unit positions [n + 1] of quantile cuts: each box >= min_units units, cut nearest i*T/n
    (with ``weights``: nearest ``T * sum(weights[:i]) / sum(weights)``)."""
    units = len(hist)
    cum = None if weights is None else np.cumsum(np.asarray(weights, np.float64))
    if n == 1:
        return np.array([0, units], np.int64)
    total = int(hist.sum())
    if total == 0:
        return np.array([(i * units) // n for i in range(n + 1)], np.int64)
    cs = np.concatenate([[0], np.cumsum(hist)])
    pos = [0]
    for i in range(1, n):
        t = i * total / n if cum is None else total * float(cum[i - 1] / cum[-1])
        b = int(np.searchsorted(cs, t, side="left"))
        if b > 0 and abs(cs[b - 1] - t) <= abs(cs[min(b, units)] - t):
            b -= 1
        b = _plateau_mid(cs, min(b, units))
        # Feasibility clamp: leave min_units for this box and for each box after it.
        b = max(b, pos[-1] + min_units)
        b = min(b, units - (n - i) * min_units)
        pos.append(b)
    pos.append(units)
    return np.array(pos, np.int64)


def _check_weights(weights: Optional[Sequence[Optional[Sequence[float]]]],
                   dims: Sequence[int]) -> list[Optional[list[float]]]:
    """Per axis None or ``dims[a]`` finite weights > 0; CutError naming the axis otherwise."""
    if weights is None:
        return [None, None, None]
    if len(weights) != 3:
        raise CutError(f"weights has {len(weights)} entries; give one per axis (x, y, z), each "
                       f"None or one weight per box along it")
    out: list[Optional[list[float]]] = []
    for a, w in enumerate(weights):
        if w is None:
            out.append(None)
            continue
        vals = [float(v) for v in w]
        if len(vals) != dims[a] or not all(np.isfinite(v) and v > 0 for v in vals):
            raise CutError(f"weights[{a}] ({AXES[a]}) is {list(w)}; it must hold {dims[a]} "
                           f"finite numbers > 0, one per box along {AXES[a]} (e.g. the speeds "
                           f"of the ranks there)")
        out.append(vals)
    return out


def cuts_from_histograms(hists: Sequence[np.ndarray], extent: Sequence[int], dims: Sequence[int],
                         align: int = 1, min_width: Optional[int] = None,
                         weights: Optional[Sequence[Optional[Sequence[float]]]] = None) -> Cuts:
    """Quantile cuts from per-axis histograms (pure; :func:`balanced_cuts` all-reduces them first).

    hists: 3 int arrays [ceil(extent[a] / align)], voxel counts per unit of ``align`` voxels.
    Every box is at least ``min_width`` voxels wide (rounded up to whole units; the last box may
    be shorter only by the part of a unit the extent lacks). With no voxels: uniform cuts.
    weights: per axis None (equal shares) or ``dims[a]`` weights > 0, box ``i`` getting a share
    of the voxels proportional to ``weights[a][i]`` (see the module).
    """
    e, d = _check_extent_dims(extent, dims, align)
    w = _check_weights(weights, d)
    min_width = align if min_width is None else int(min_width)
    if min_width < 1:
        raise CutError(f"min_width is {min_width}; it must be a positive number of voxels")
    m = _ceil_div(min_width, align)
    bounds = []
    for a in range(3):
        units = _units_check(a, e[a], d[a], align, m)
        h = np.asarray(hists[a], np.int64).reshape(-1)
        if len(h) != units:
            raise CutError(f"histogram {a} ({AXES[a]}) has {len(h)} bins; extent {e[a]} at align "
                           f"{align} needs {units}")
        pos = _quantile_axis(h, d[a], m, w[a]) * align
        pos[-1] = e[a]
        bounds.append(pos)
    return Cuts(tuple(bounds), align)  # type: ignore[arg-type]


def balanced_cuts(comm: "MPI.Intracomm", xyz: ArrayLike, extent: Sequence[int],
                  dims: Sequence[int], align: int = 1, min_width: Optional[int] = None,
                  method: str = "quantile",
                  weights: Optional[Sequence[Optional[Sequence[float]]]] = None) -> Cuts:
    """Load-balanced cuts from the voxels of all ranks (collective over ``comm``).

    xyz: int [N, 3] level-0 voxel coordinates this rank contributes; over ``comm`` each voxel is
    counted once (any split of the cloud among ranks gives the same cuts). Voxels outside
    [0, extent) raise CutError on every rank. method: ``"quantile"`` (per-axis histograms,
    :func:`cuts_from_histograms`; a few KiB to all-reduce) or ``"minmax"`` (a binned 3-D
    histogram of up to 2 MiB, :func:`halo.balance.minmax_cuts`: balances the fullest box of 2-D and
    3-D grids much better, see the module docstring). weights: per-axis box weights for
    unequal devices (quantile only; see the module). The settings (extent, dims, align,
    min_width, method, weights) are checked, and compared between the ranks, on every rank
    before the all-reduce, so a bad or differing one raises CutError everywhere.
    """
    from mpi4py import MPI

    from halo import balance
    from halo.agree import agree

    def settings() -> tuple[tuple[int, int, int], tuple[int, int, int], list]:
        if method not in ("quantile", "minmax"):
            raise CutError(f"balanced_cuts: method is {method!r}; use 'quantile' or 'minmax'")
        e, d = _check_extent_dims(extent, dims, align)
        w = _check_weights(weights, d)
        if method != "quantile" and any(v is not None for v in w):
            raise CutError(f"balanced_cuts: weights need method='quantile'; got method "
                           f"{method!r}")
        return e, d, w

    mine: Optional[CutError] = None
    try:
        e, d, w = settings()
    except CutError as exc:
        mine = exc
    setting = (f"extent {tuple(extent)}, dims {tuple(dims)}, align {align}, min_width "
               f"{min_width}, method {method!r}, weights {weights}")
    any_problem, same = agree(comm, mine is not None, setting)
    if mine is not None:
        raise mine
    if any_problem:
        raise CutError("balanced_cuts: another rank passed bad settings; see its error")
    if not same:
        raise CutError(f"balanced_cuts: ranks passed different settings; here {setting}; every "
                       "rank must pass the same (the extent of the whole grid, not of its own "
                       "voxels)")
    if method == "quantile":
        sizes = [_ceil_div(v, align) for v in e]
    else:
        widths = balance.bin_widths(e, d, align)
        shape = [_ceil_div(v, w) for v, w in zip(e, widths)]
        sizes = [int(np.prod(shape))]
    buf = np.zeros(sum(sizes) + 1, np.int64)
    err: Optional[CutError] = None
    try:
        if method == "quantile":
            cut = [a for a in range(3) if d[a] > 1]  # an axis in one part needs no counts
            buf[:-1] = np.concatenate(axis_histograms(xyz, e, align, axes=cut))
        else:
            buf[:-1] = balance.grid_histogram(checked_xyz(xyz, e), e, widths).reshape(-1)
    except CutError as exc:
        err, buf[-1] = exc, 1
    # One all-reduce carries the histograms and an error count, so a rank's bad input stops
    # every rank here instead of leaving the others in the next collective.
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    if err is not None:
        raise err
    if buf[-1]:
        raise CutError(f"balanced_cuts: {int(buf[-1])} rank(s) passed voxels outside the extent "
                       f"{e}; see their error")
    if method == "minmax":
        return balance.minmax_cuts(buf[:-1].reshape(shape), widths, e, d, align, min_width)
    hists = np.split(buf[:-1], np.cumsum(sizes)[:-1])
    return cuts_from_histograms(hists, e, d, align, min_width, w)
