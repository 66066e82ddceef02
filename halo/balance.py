"""Min-max cuts: balance the fullest box of a 2-D or 3-D grid, not just each axis' marginal.

    widths = bin_widths(extent, dims, align)                         # voxels per bin, per axis
    hist = grid_histogram(xyz, extent, widths)                       # int64 [Bx, By, Bz]
    cuts = minmax_cuts(hist, widths, extent, dims, align)            # pure; or, collectively:
    cuts = balanced_cuts(comm, xyz, extent, dims, align, method="minmax")

Per-axis quantile cuts balance each axis' marginal, but the boxes of a tensor-product grid can
stay far apart (two clusters on a diagonal of a 2 x 2 grid: the marginals split evenly, yet two
boxes get everything). Min-max cuts minimise the voxel count of the fullest box by coordinate
descent over the axes, on a histogram of the cloud in bins of ``widths`` voxels:

    for each sweep, for each split axis a:
        W[u, j] = voxels in bin-slab u along a and column j of the other axes' boxes
        cut a to minimise max over parts i, columns j of sum(W[part i, j])   (exact, below)

The one-axis problem is solved exactly: binary search on the bound L, with a greedy check that
extends each part as far as every column allows (``searchsorted`` on per-column prefix sums);
greedy-furthest is optimal for contiguous parts of at least one bin. A step is kept only if the
fullest box does not grow, so the result is never worse than where it starts (quantile cuts on the
same bins). Bins: axes with one box need one bin; the split axes share ``max_bins`` bins (so a slab
grid is cut at full ``align`` resolution, a 3-D grid at up to 64 bins per axis).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from halo.cuts import CutError, Cuts, _quantile_axis

__all__ = ["grid_histogram", "minmax_cuts", "bin_widths", "box_counts", "MAX_BINS"]

MAX_BINS = 1 << 18  # 2 MiB of int64 per all-reduce


def bin_widths(extent: Sequence[int], dims: Sequence[int], align: int,
               max_bins: int = MAX_BINS) -> tuple[int, int, int]:
    """Bin width (voxels, a multiple of ``align``) per axis: one bin on unsplit axes."""
    split = [a for a in range(3) if dims[a] > 1]
    per_axis = int(max_bins ** (1 / max(1, len(split))) + 1e-9)
    out = []
    for a in range(3):
        if dims[a] == 1:
            out.append(int(extent[a]))
        else:
            units = -(-int(extent[a]) // align)
            out.append(align * -(-units // max(1, per_axis)))
    return tuple(out)  # type: ignore[return-value]


def grid_histogram(xyz: np.ndarray, extent: Sequence[int], widths: Sequence[int]) -> np.ndarray:
    """int64 [Bx, By, Bz] voxel counts in bins of ``widths`` voxels (xyz int [N, 3] in extent)."""
    shape = tuple(-(-int(e) // int(w)) for e, w in zip(extent, widths))
    b = np.asarray(xyz, np.int64) // np.asarray(widths, np.int64)
    flat = np.ravel_multi_index((b[:, 0], b[:, 1], b[:, 2]), shape)
    return np.bincount(flat, minlength=int(np.prod(shape))).reshape(shape).astype(np.int64)


def _columns(hist: np.ndarray, axis: int, pos: list[np.ndarray]) -> np.ndarray:
    """W [B_axis, columns]: the histogram summed over the other axes' boxes."""
    h = np.moveaxis(hist, axis, 0)
    others = [a for a in range(3) if a != axis]
    for k, a in enumerate(others):  # reduce axis 1 + k into its boxes
        h = np.add.reduceat(h, pos[a][:-1], axis=1 + k) if len(pos[a]) > 2 else \
            h.sum(axis=1 + k, keepdims=True)
    return h.reshape(h.shape[0], -1)


def _greedy(prefix: np.ndarray, n: int, m: int, bound: int) -> Optional[np.ndarray]:
    """Furthest-first cut positions [n + 1] with every part's columns <= bound, or None."""
    bins = prefix.shape[0] - 1
    pos = [0]
    for i in range(1, n):
        s = pos[-1]
        limit = prefix[s] + bound
        e = min(int(np.searchsorted(prefix[:, j], limit[j], side="right")) - 1
                for j in range(prefix.shape[1]))
        e = min(e, bins - (n - i) * m)
        if e < s + m:
            return None
        pos.append(e)
    if np.any(prefix[bins] - prefix[pos[-1]] > bound):
        return None
    pos.append(bins)
    return np.array(pos, np.int64)


def _best_axis(w: np.ndarray, n: int, m: int, hi: int) -> Optional[np.ndarray]:
    """Cut positions minimising the fullest part of ``w`` [B, cols], given a feasible ``hi``."""
    prefix = np.concatenate([np.zeros((1, w.shape[1]), np.int64), np.cumsum(w, 0)])
    lo = int(w.max(initial=0))
    best = _greedy(prefix, n, m, hi)
    if best is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        got = _greedy(prefix, n, m, mid)
        if got is None:
            lo = mid + 1
        else:
            hi, best = mid, got
    return best


def box_counts(hist: np.ndarray, pos: Sequence[np.ndarray]) -> np.ndarray:
    """int64 [dims]: voxels per box for cut positions ``pos`` (bin indices, strictly increasing)."""
    h = hist
    for a in range(3):
        h = np.add.reduceat(h, pos[a][:-1], axis=a)
    return h


def _fullest(hist: np.ndarray, pos: list[np.ndarray]) -> int:
    return int(box_counts(hist, pos).max(initial=0))


def _descend(hist: np.ndarray, dims: list[int], mins: list[int], pos: list[np.ndarray],
             sweeps: int) -> tuple[list[np.ndarray], int]:
    """Coordinate descent from ``pos``: exact one-axis min-max steps while the fullest box shrinks."""
    best = _fullest(hist, pos)
    for _ in range(sweeps):
        improved = False
        for a in range(3):
            if dims[a] == 1:
                continue
            got = _best_axis(_columns(hist, a, pos), dims[a], mins[a], best)
            if got is None:
                continue
            trial = pos[:a] + [got] + pos[a + 1:]
            load = _fullest(hist, trial)
            if load < best:
                pos, best, improved = trial, load, True
        if not improved:
            break
    return pos, best


def _random_start(rng: np.random.Generator, bins: int, n: int, m: int) -> np.ndarray:
    """Random cut positions [n + 1] with parts of at least ``m`` bins."""
    slack = bins - n * m
    extra = np.sort(rng.integers(0, slack + 1, size=n - 1))
    return np.concatenate([[0], extra + m * np.arange(1, n), [bins]]).astype(np.int64)


def minmax_cuts(hist: np.ndarray, widths: Sequence[int], extent: Sequence[int],
                dims: Sequence[int], align: int = 1, min_width: Optional[int] = None,
                starts: int = 32, sweeps: int = 8, seed: int = 0) -> Cuts:
    """Cuts minimising the fullest box, from a binned histogram (pure; see the module docstring).

    hist int [Bx, By, Bz] in bins of ``widths`` voxels (multiples of ``align``); every box at least
    ``min_width`` voxels wide (rounded up to whole bins). Coordinate descent is local, so it runs
    from the quantile cuts and ``starts - 1`` random ones (``seed``: the same on every rank) and
    keeps the best; on a 2 x 2 x 2 grid this finds the brute-force optimum in our tests.
    """
    min_width = align if min_width is None else int(min_width)
    d = [int(v) for v in dims]
    mins = [max(1, -(-min_width // int(w))) for w in widths]
    for a in range(3):
        if d[a] > 1 and d[a] * mins[a] > hist.shape[a]:
            raise CutError(f"axis {'xyz'[a]}: {hist.shape[a]} bins of {widths[a]} voxels are too "
                           f"few for {d[a]} boxes of at least {min_width} voxels; use fewer ranks "
                           f"along {'xyz'[a]} or a smaller min_width")
    marginals = [hist.sum(axis=tuple(b for b in range(3) if b != a)) for a in range(3)]
    pos, best = _descend(hist, d, mins, [_quantile_axis(marginals[a], d[a], mins[a])
                                         for a in range(3)], sweeps)
    rng = np.random.default_rng(seed)
    split = sum(v > 1 for v in d)
    for _ in range(starts - 1 if split > 1 else 0):  # one split axis: the first descent is exact
        start = [_random_start(rng, hist.shape[a], d[a], mins[a]) for a in range(3)]
        got, load = _descend(hist, d, mins, start, sweeps)
        if load < best:
            pos, best = got, load
    bounds = []
    for a in range(3):
        b = np.minimum(pos[a] * int(widths[a]), int(extent[a]))
        b[-1] = int(extent[a])
        bounds.append(b)
    return Cuts(tuple(bounds), align)  # type: ignore[arg-type]
