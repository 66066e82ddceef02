"""Synthetic voxel clouds for tests and benchmarks: deterministic from a numpy Generator.

    rng = np.random.default_rng(0)
    xyz = clustered_cloud(rng, 20_000, extent=(128, 128, 64), clusters=3)   # int64 [N, 3]
    coords = with_batch(xyz)                                               # int32 [N, 4]

Clouds are unique voxels inside [0, extent), sorted by (x, y, z); the point count asked for is an
upper bound (duplicates are dropped).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["uniform_cloud", "clustered_cloud", "shell_cloud", "boundary_cloud", "with_batch",
           "unique_rows"]


def unique_rows(xyz: np.ndarray) -> np.ndarray:
    """Sorted unique rows of an int [N, 3] array."""
    return np.unique(np.asarray(xyz, np.int64).reshape(-1, 3), axis=0)


def uniform_cloud(rng: np.random.Generator, n: int, extent: Sequence[int]) -> np.ndarray:
    """Up to ``n`` voxels uniformly at random in the box [0, extent): int64 [N, 3]."""
    e = np.asarray(extent, np.int64)
    return unique_rows(rng.integers(0, e, size=(n, 3)))


def clustered_cloud(rng: np.random.Generator, n: int, extent: Sequence[int], clusters: int = 3,
                    spread: float = 0.04, background: float = 0.05) -> np.ndarray:
    """Up to ``n`` voxels in Gaussian blobs (std ``spread`` x extent) of unequal weight, plus a
    ``background`` fraction spread uniformly: far from uniform, as real scenes are."""
    e = np.asarray(extent, np.int64)
    centres = rng.uniform(0.1, 0.9, size=(clusters, 3)) * e
    weights = rng.dirichlet(np.ones(clusters))
    n_bg = int(n * background)
    which = rng.choice(clusters, size=n - n_bg, p=weights)
    pts = centres[which] + rng.normal(0, spread, size=(n - n_bg, 3)) * e
    pts = np.concatenate([pts, rng.uniform(0, 1, size=(n_bg, 3)) * e])
    xyz = np.clip(np.floor(pts), 0, e - 1).astype(np.int64)
    return unique_rows(xyz)


def shell_cloud(rng: np.random.Generator, n: int, extent: Sequence[int],
                spheres: int = 4) -> np.ndarray:
    """Up to ``n`` voxels on sphere surfaces (a 2-D manifold, like a LiDAR or CAD scan)."""
    e = np.asarray(extent, np.float64)
    centres = rng.uniform(0.25, 0.75, size=(spheres, 3)) * e
    radii = rng.uniform(0.1, 0.25, size=spheres) * float(np.min(e))
    which = rng.integers(0, spheres, size=n)
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    pts = centres[which] + v * radii[which, None]
    return unique_rows(np.clip(np.floor(pts), 0, e - 1))


def with_batch(xyz: np.ndarray, batch: int = 0) -> torch.Tensor:
    """int32 [N, 4] (batch, x, y, z) coords from int [N, 3] voxels."""
    x = torch.as_tensor(np.asarray(xyz, np.int64)).reshape(-1, 3)
    return torch.cat([torch.full((len(x), 1), batch, dtype=torch.int64), x], 1).int()


def boundary_cloud(rng: np.random.Generator, n: int, cuts, radius: int = 1,
                   near: float = 0.7) -> np.ndarray:
    """Up to ``n`` voxels crowding the boxes' faces, edges and corners: int64 [N, 3].

    Each coordinate is, with probability ``near``, within ``radius`` of an interior cut of
    ``cuts`` (a :class:`halo.cuts.Cuts`) or on the extent's edge, else uniform. A voxel near a
    cut on one axis sits on a face, on two an edge, on three a corner.
    """
    cols = []
    for a in range(3):
        b = cuts.bounds[a]
        e = int(b[-1])
        near_cut = [0, e - 1]
        for c in b[1:-1]:
            near_cut += list(range(int(c) - radius, int(c) + radius))
        cand = np.clip(np.array(near_cut, np.int64), 0, e - 1)
        pick = rng.random(n) < near
        cols.append(np.where(pick, rng.choice(cand, size=n), rng.integers(0, e, size=n)))
    return unique_rows(np.stack(cols, 1))
