"""Weighted balanced cuts (unequal devices) still give the single-process U-Net, and do weight."""

from __future__ import annotations

import numpy as np
import pytest
from test_spatial import grids_for, make_cloud, run_pair

from halo.cuts import CutError, balanced_cuts
from sparsepipe_hpc.nn import SparseUNet


def weights_for(grid):
    """Box i along a split axis weighs i + 1 (the first box is the slowest device's)."""
    return [[float(i + 1) for i in range(n)] if n > 1 else None for n in grid]


def test_weighted_split_gives_the_serial_output_and_gradients(comm):
    x = make_cloud(5, "random", shape=(16, 16, 16), batch=2)
    xyz = x.coords[:, 1:] if comm.rank == 0 else x.coords[:0, 1:]   # each voxel counted once
    for grid in grids_for(comm):
        cuts = balanced_cuts(comm, xyz, x.spatial_shape, grid, align=4,
                             weights=weights_for(grid))
        plain = balanced_cuts(comm, xyz, x.spatial_shape, grid, align=4)
        split = [a for a in range(3) if grid[a] > 1]
        if split:   # box 0 (weight 1) owns no more than unweighted, less on a 2-box axis
            a = split[0]
            own = lambda c: int(np.sum(np.asarray(c.locate(x.coords[:, 1:]))[:, a] == 0))  # noqa
            assert own(cuts) <= own(plain)
            if grid[a] == 2:   # 4 units of 4 voxels: the cut moves from 8 (1/2) to 4 (~1/3)
                assert cuts.bounds[a].tolist() == [0, 4, 16] and own(cuts) < own(plain)
        run_pair(comm, grid, "balanced", lambda: SparseUNet(3, 5, width=4, depth=2), x, align=4,
                 explicit=cuts)


def test_bad_weights_raise_on_every_rank(comm):
    x = make_cloud(5, "random")
    grid = (comm.size, 1, 1)
    with pytest.raises(CutError, match=r"weights\[0\] \(x\) is"):
        balanced_cuts(comm, x.coords[:, 1:], x.spatial_shape, grid,
                      weights=[[0.0] * comm.size, None, None])
