"""Small builders shared by the test suites (random voxel clouds, spconv twins of our layers)."""

from __future__ import annotations

import torch

from sparsepipe_hpc.sparse import SparseTensor


def random_cloud(gen: torch.Generator, n: int, shape=(16, 16, 16), batch: int = 2,
                 channels: int = 4, dtype=torch.float64) -> SparseTensor:
    """Up to ``n`` unique random voxels per batch, with corners and faces of the grid included."""
    xyz = torch.stack([torch.randint(0, s, (n,), generator=gen) for s in shape], 1)
    corners = torch.tensor([[a, b, c] for a in (0, shape[0] - 1) for b in (0, shape[1] - 1)
                            for c in (0, shape[2] - 1)])
    rows = []
    for b in range(batch):
        pts = torch.cat([xyz, corners]) if b == 0 else xyz
        rows.append(torch.cat([torch.full((len(pts), 1), b), pts], 1))
    coords = torch.unique(torch.cat(rows), dim=0).int()
    feats = torch.randn(len(coords), channels, generator=gen, dtype=dtype)
    return SparseTensor(coords, feats, shape, batch)
