"""Min-max cuts without MPI: exact on slabs, brute-force optimal on small 2x2x2 grids, never worse
than quantile cuts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from halo.balance import bin_widths, box_counts, grid_histogram, minmax_cuts
from halo.cuts import CutError, axis_histograms, cuts_from_histograms, uniform_cuts
from halo.synth import clustered_cloud, shell_cloud


def brute_force_fullest(hist, dims):
    """Smallest possible fullest box over every choice of cut positions (tiny grids only)."""
    choices = [list(itertools.combinations(range(1, hist.shape[a]), dims[a] - 1))
               for a in range(3)]
    best = None
    for cx, cy, cz in itertools.product(*choices):
        pos = [np.array([0, *c, hist.shape[a]]) for a, c in enumerate((cx, cy, cz))]
        v = int(box_counts(hist, pos).max())
        best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_minmax_finds_the_optimum_on_small_grids(seed):
    rng = np.random.default_rng(seed)
    extent = (12, 10, 9)
    xyz = clustered_cloud(rng, 600, extent, clusters=3, spread=0.12)
    for dims in [(2, 2, 2), (3, 2, 1), (4, 1, 1)]:
        w = bin_widths(extent, dims, 1)
        hist = grid_histogram(xyz, extent, w)
        cuts = minmax_cuts(hist, w, extent, dims)
        assert cuts.count(xyz).max() == brute_force_fullest(hist, dims), dims


def test_minmax_is_never_worse_than_quantile_and_keeps_the_contract():
    extent, align = (256, 256, 64), 8
    for cloud in (clustered_cloud(np.random.default_rng(1), 60000, extent, clusters=5),
                  shell_cloud(np.random.default_rng(2), 60000, extent)):
        hist = axis_histograms(cloud, extent, align)
        for dims in [(4, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (4, 2, 2)]:
            w = bin_widths(extent, dims, align)
            cuts = minmax_cuts(grid_histogram(cloud, extent, w), w, extent, dims, align,
                               min_width=16)
            q = cuts_from_histograms(hist, extent, dims, align).count(cloud).max()
            assert cuts.count(cloud).max() <= q
            assert cuts.extent == extent and cuts.dims == dims
            for b in cuts.bounds:
                assert np.all(b[1:-1] % align == 0) and np.all(np.diff(b) >= 16)


def test_bins_and_errors():
    assert bin_widths((512, 512, 64), (8, 1, 1), 4) == (4, 512, 64)  # slabs: full resolution
    assert bin_widths((512, 512, 64), (2, 2, 2), 4) == (8, 8, 4)     # 64 bins per split axis
    hist = np.ones((4, 1, 1), np.int64)
    with pytest.raises(CutError, match="4 bins of 2 voxels are too few for 3 boxes of at least 4"):
        minmax_cuts(hist, (2, 8, 8), (8, 8, 8), (3, 1, 1), align=2, min_width=4)
    empty = minmax_cuts(np.zeros((8, 1, 1), np.int64), (1, 8, 8), (8, 8, 8), (4, 1, 1))
    assert empty.dims == (4, 1, 1) and uniform_cuts((8, 8, 8), (4, 1, 1)) == empty
