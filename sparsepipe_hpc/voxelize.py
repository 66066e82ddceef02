"""Voxelization of point clouds against a fixed global origin.

    vox = voxelize(xyz, rgb, voxel_size=0.05, origin=(0.0, 0.0, 0.0), spatial_shape=(128, 128, 64),
                   labels=point_labels, num_classes=13)
    vox.coords          # int32 [V, 3] global voxel indices, sorted (x, then y, then z)
    vox.feats           # float32 [V, C]: mean of the point features in each voxel
    vox.labels          # int64 [V]: majority point label per voxel (ties: smallest label)
    vox.point_to_voxel  # int64 [P]: row of vox.coords holding each point (to project predictions)

Indices are ``floor((p - origin) / voxel_size)``: the same world point gets the same index on every
rank and in every sample, which the spatial decomposition relies on. Never voxelize against a
per-sample minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["Voxels", "VoxelizeError", "merge_points", "voxelize"]


class VoxelizeError(ValueError):
    """A point cloud that cannot be voxelized as asked."""


@dataclass
class Voxels:
    """One sample's voxel set (see the module docstring for the fields' contracts)."""

    coords: torch.Tensor
    feats: torch.Tensor
    point_to_voxel: torch.Tensor
    labels: Optional[torch.Tensor] = None


def voxelize(points: np.ndarray | torch.Tensor, feats: np.ndarray | torch.Tensor | None,
             voxel_size: float, origin: Sequence[float] | np.ndarray,
             spatial_shape: Sequence[int] | np.ndarray,
             labels: np.ndarray | torch.Tensor | None = None, num_classes: int | None = None,
             clip: bool = False, name: str = "points") -> Voxels:
    """Quantize ``points [P, 3]`` (metres) into voxels of edge ``voxel_size`` (metres).

    ``feats [P, C]`` are averaged per voxel (None: a constant feature of 1). Points outside the grid
    ``origin + [0, spatial_shape) * voxel_size`` raise, or are dropped with ``clip=True`` (their
    ``point_to_voxel`` entry is then -1).
    """
    pts = torch.as_tensor(np.asarray(points), dtype=torch.float64)
    if pts.dim() != 2 or pts.shape[1] != 3:
        raise VoxelizeError(f"{name} must be [P, 3]; got {list(pts.shape)}")
    if len(pts) == 0:
        raise VoxelizeError(f"{name} is empty: a sample needs at least one point")
    if not torch.isfinite(pts).all():
        bad = int((~torch.isfinite(pts)).any(1).sum())
        raise VoxelizeError(f"{name} has {bad} point(s) with NaN or inf coordinates")
    if not 0 < voxel_size < float("inf"):
        raise VoxelizeError(f"voxel_size must be a positive, finite number of metres; got "
                            f"{voxel_size}")
    if feats is None:
        f = torch.ones(len(pts), 1, dtype=torch.float32)
    else:
        f = torch.as_tensor(np.asarray(feats), dtype=torch.float32)
        f = f[:, None] if f.dim() == 1 else f
        if f.dim() != 2 or len(f) != len(pts):  # a reshape would scramble, say, [C, P]
            raise VoxelizeError(f"features of {name} have shape {list(f.shape)}; expected "
                                f"[{len(pts)}, C], a row per point")
        if not torch.isfinite(f).all():
            raise VoxelizeError(f"features of {name} contain NaN or inf")
    shape = torch.tensor(list(spatial_shape), dtype=torch.int64)
    idx = torch.floor((pts - torch.tensor(list(origin), dtype=torch.float64)) / voxel_size).long()
    inside = ((idx >= 0) & (idx < shape)).all(1)
    if not bool(inside.all()):
        if not clip:
            i = int((~inside).nonzero()[0])
            raise VoxelizeError(
                f"{name}: {int((~inside).sum())} point(s) fall outside the grid (origin "
                f"{tuple(float(o) for o in origin)}, {tuple(int(n) for n in spatial_shape)} "
                f"voxels of {voxel_size} m); first: point {i} at "
                f"{pts[i].tolist()} -> voxel {idx[i].tolist()}. Enlarge the grid or pass clip=True")
        if not bool(inside.any()):
            raise VoxelizeError(f"{name}: every point falls outside the grid")
    key = (idx[:, 0] * shape[1] + idx[:, 1]) * shape[2] + idx[:, 2]
    lab = None
    k = 0
    if labels is not None:
        raw = np.asarray(labels)
        if raw.shape != (len(pts),) or raw.dtype.kind not in "iu":
            raise VoxelizeError(f"labels of {name} are {raw.dtype} of shape {list(raw.shape)}; "
                                f"expected integers of shape [{len(pts)}], one per point")
        lab = torch.as_tensor(raw, dtype=torch.int64)[inside]
        k = int(num_classes) if num_classes is not None else int(lab.max()) + 1
        if len(lab) and (int(lab.min()) < 0 or int(lab.max()) >= k):
            raise VoxelizeError(f"labels of {name} must lie in [0, {k - 1}]; "
                                f"got [{int(lab.min())}, {int(lab.max())}]")
    keys, mean, inverse, vox_labels = merge_points(key[inside], f[inside], lab, k)
    coords = torch.stack([keys // (shape[1] * shape[2]), keys // shape[2] % shape[1],
                          keys % shape[2]], 1).int()
    point_to_voxel = torch.full((len(pts),), -1, dtype=torch.int64)
    point_to_voxel[inside] = inverse
    return Voxels(coords, mean, point_to_voxel, vox_labels)


def merge_points(key: torch.Tensor, feats: torch.Tensor, labels: Optional[torch.Tensor],
                 num_classes: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Points -> voxels: ``(keys [V] sorted unique, mean feats float32 [V, C], inverse [P],
    majority labels int64 [V] or None)`` from ``key int64 [P]``, ``feats float32 [P, C]`` and
    ``labels int64 [P]`` in ``[0, num_classes)``.

    The one place where voxel features are summed: a voxel's mean is the float32 sum of its points'
    features *in the order the points are given*, divided by the count, so callers that pass a
    voxel's points in the same order get bit-identical means (the distributed voxelization sorts
    received points by their index in the sample for that). Label ties go to the smallest label.
    """
    keys, inverse = torch.unique(key, return_inverse=True)
    n = len(keys)
    # Counts and votes are integers: bincount gives them without a [P] tensor of ones.
    counts = torch.bincount(inverse, minlength=n).to(torch.float32)
    mean = torch.zeros(n, feats.shape[1]).index_add_(0, inverse, feats) / counts[:, None]
    vox_labels = None
    if labels is not None:
        k = int(num_classes)
        votes = torch.bincount(inverse * k + labels, minlength=n * k)
        vox_labels = votes.view(n, k).argmax(1)  # first maximum: the smallest label wins ties
    return keys, mean, inverse, vox_labels
