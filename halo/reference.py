"""Serial brute-force references for what the distributed code computes (tests use them).

    expected = reference_halo(global_coords, cuts, grid_coords=(1, 0, 0), radius=1)
    needed = reference_neighbours(global_coords, owned_mask, radius=1)

Deliberately naive: explicit loops over boxes and all-pairs distances, no shared code with
:mod:`halo.plan` beyond :class:`halo.cuts.Cuts`' bounds, so agreement means something.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from halo.cuts import Cuts
from halo.kmap import coord_keys

__all__ = ["reference_owner", "reference_halo", "reference_neighbours"]


def reference_owner(xyz: np.ndarray, cuts: Cuts, stride: int = 1) -> np.ndarray:
    """int64 [N, 3] grid position per voxel, by scanning boxes (edge boxes extend to infinity)."""
    xyz = np.asarray(xyz, np.int64)
    out = np.zeros((len(xyz), 3), np.int64)
    for a in range(3):
        b = cuts.axis_bounds(a, stride)
        for c in range(1, len(b) - 1):
            out[:, a] += xyz[:, a] >= b[c]  # boxes passed on the way up
    return out


def _sorted(coords: torch.Tensor) -> torch.Tensor:
    return coords[torch.sort(coord_keys(coords))[1]]


def reference_halo(coords: torch.Tensor, cuts: Cuts, grid_coords: Sequence[int], radius: int,
                   stride: int = 1) -> torch.Tensor:
    """The halo a box should receive: int32 [H, 4] sorted by key.

    All voxels of the global cloud ``coords`` (int [N, 4] at ``stride``) not owned by the box
    at ``grid_coords`` whose Chebyshev distance to the box is at most ``radius``.
    """
    xyz = coords[:, 1:].long().numpy()
    owner = reference_owner(xyz, cuts, stride)
    mine = (owner == np.asarray(grid_coords)).all(1)
    near = np.ones(len(xyz), bool)
    for a in range(3):
        b = cuts.axis_bounds(a, stride)
        c = int(grid_coords[a])
        lo = -np.inf if c == 0 else b[c]
        hi = np.inf if c == len(b) - 2 else b[c + 1] - 1
        dist = np.maximum(np.maximum(lo - xyz[:, a], xyz[:, a] - hi), 0)
        near &= dist <= radius
    return _sorted(coords[torch.from_numpy(near & ~mine)].int())


def reference_neighbours(coords: torch.Tensor, owned: torch.Tensor, radius: int) -> torch.Tensor:
    """Voxels not in ``owned`` (bool [N]) within Chebyshev ``radius`` of an owned voxel of the same
    batch: the smallest halo a radius-``radius`` kernel needs. int32 [M, 4] sorted by key."""
    c = coords.long()
    mine, other = c[owned], c[~owned]
    hit = torch.zeros(len(other), dtype=torch.bool)
    for i in range(0, len(mine), 512):  # all pairs, in chunks to bound memory
        m = mine[i:i + 512]
        d = (other[None, :, 1:] - m[:, None, 1:]).abs().amax(2)
        same = other[None, :, 0] == m[:, None, 0]
        hit |= ((d <= radius) & same).any(0)
    return _sorted(other[hit].int())
