"""Which chunks of a chunked scene a spatial rank reads, and balanced cuts from the chunk tables
alone (pure geometry: no file, no MPI).

    vlo, vhi = chunk_voxels(table.lo, table.hi, origin, 0.05, shape)   # after aug.box(...)
    cuts = chunk_cuts([(vlo, vhi, table.count)], shape, dims=(4, 1, 1), align=8)
    mine = chunks_in_box(vlo, vhi, *cuts.box(grid.coords))            # bool [K]
    for start, stop, k0, k1 in pieces(table.offset, table.count, np.nonzero(mine)[0], 1 << 18):
        ...                                                            # rows, chunks [k0, k1)

Reading rule (what keeps the distributed voxelization exact): rank ``r`` reads every chunk whose
voxel range, widened by ``margin`` voxels for float rounding, meets its box, and keeps exactly the
points whose voxel it owns. Every point lies in its chunk's box (checked on read), so each point is
kept by one rank, its owner; a voxel whose points come from several chunks is merged by its owner
in sample order, as the single-process voxelization merges it::

    chunks (metres)   |  c0  |  c1  |  c2  |  c3  |
    boxes  (voxels)   [ rank 0    )[  rank 1     ]
    rank 0 reads c0 c1 c2 (c2 straddles the cut: rank 0 keeps its left part)
    rank 1 reads c2 c3    (and keeps c2's right part)

Balanced cuts here follow the POINTS of each chunk, spread evenly over the chunk's voxel range
(the table gives them without reading a point), not the distinct voxels that
:func:`halo.balanced_cuts` counts: the cuts differ from the point-range path's, the boxes are as
balanced as the chunks are fine, and the result is still exact for the cuts it uses.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from halo.cuts import Cuts, cuts_from_histograms

__all__ = ["chunk_cuts", "chunk_voxels", "chunks_in_box", "pieces"]


def chunk_voxels(lo: np.ndarray, hi: np.ndarray, origin: Sequence[float], voxel_size: float,
                 spatial_shape: Sequence[int], margin: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(vlo, vhi) int64 [K, 3]: the inclusive voxel range of each box ``[lo, hi]`` (float64
    [K, 3], metres), widened by ``margin`` voxels and clamped into the grid (ownership clamps
    too, so a clamped range still meets the box that owns its points)."""
    o = np.asarray(origin, np.float64)
    top = np.asarray(spatial_shape, np.int64) - 1
    vlo = np.floor((np.asarray(lo, np.float64) - o) / voxel_size) - margin
    vhi = np.floor((np.asarray(hi, np.float64) - o) / voxel_size) + margin
    # clip in float first: a far-off box must not overflow int64
    return (np.clip(vlo, 0, top).astype(np.int64), np.clip(vhi, 0, top).astype(np.int64))


def chunk_cuts(chunks: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
               spatial_shape: Sequence[int], dims: Sequence[int], align: int = 1) -> Cuts:
    """Quantile cuts (:func:`halo.cuts.cuts_from_histograms`) from per-axis histograms of points:
    each chunk ``(vlo [K, 3], vhi [K, 3], count [K])`` spreads its count evenly over the
    ``align``-units of its voxel range on each axis. Every rank computes the same cuts."""
    extent = [int(s) for s in spatial_shape]
    hists = []
    for a in range(3):
        units = -(-extent[a] // align)
        diff = np.zeros(units + 1, np.float64)
        for vlo, vhi, count in chunks:
            u0, u1 = vlo[:, a] // align, vhi[:, a] // align
            w = np.asarray(count, np.float64) / (u1 - u0 + 1)
            np.add.at(diff, u0, w)
            np.add.at(diff, u1 + 1, -w)
        hists.append(np.rint(np.cumsum(diff[:-1])).astype(np.int64))
    return cuts_from_histograms(hists, extent, dims, align)


def chunks_in_box(vlo: np.ndarray, vhi: np.ndarray, box_lo: np.ndarray,
                  box_hi: np.ndarray) -> np.ndarray:
    """bool [K]: whether inclusive voxel ranges ``[vlo, vhi]`` meet the box ``[box_lo, box_hi)``
    (an empty box meets none)."""
    lo, hi = np.asarray(box_lo), np.asarray(box_hi)
    return np.asarray(((vlo < hi) & (vhi >= lo)).all(1) & bool((hi > lo).all()))


def pieces(offset: np.ndarray, count: np.ndarray, chosen: np.ndarray,
           max_points: int) -> list[tuple[int, int, int, int]]:
    """Row ranges to read for chunks ``chosen`` (ascending indices): ``(start, stop, k0, k1)``
    covers chunks ``k0..k1-1`` whole, consecutive chunks merged up to ``max_points`` rows (a
    chunk larger than that is one piece), in ascending row order."""
    out: list[tuple[int, int, int, int]] = []
    for k in (int(c) for c in chosen):
        a, n = int(offset[k]), int(count[k])
        if out and out[-1][3] == k and out[-1][1] == a and out[-1][1] - out[-1][0] + n <= max_points:
            s, _, k0, _ = out[-1]
            out[-1] = (s, a + n, k0, k + 1)
        else:
            out.append((a, a + n, k, k + 1))
    return out
