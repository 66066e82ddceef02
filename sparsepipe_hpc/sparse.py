"""SparseTensor: the voxel set that flows between layers.

    x = SparseTensor(coords, feats, spatial_shape=(64, 64, 64), batch_size=2)
    y = x.replace(feats=torch.relu(x.feats))      # same voxels, new features
    z = SparseTensor.from_spconv(x.to_spconv())  # round trip through spconv

Contract:
    coords  int32 [N, 4]: (batch, x, y, z), global voxel indices at this tensor's stride
            (level-0 index // stride). Rows are unique.
    feats   float [N, C], row i belongs to coords[i].
    spatial_shape: the global grid extent at this stride, in voxels (x, y, z).
    stride: tensor stride relative to the input grid (1, 2, 4, ...).
    kmaps:  kernel maps shared by every tensor derived from the same input (like spconv's
            indice_dict), so a down-sampling map is reused by its inverse convolution.
    context: None for a single-process tensor; otherwise the rank's ParallelContext
            (sparsepipe_hpc.parallel.context): its communicators and, under spatial parallelism,
            its box of the global grid; coords then hold only the voxels this rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np
import torch

from halo.kmap import MAX_BATCH, MAX_EXTENT

__all__ = ["SparseTensor", "SparseTensorError", "MAX_EXTENT", "MAX_BATCH"]


class SparseTensorError(ValueError):
    """A sparse tensor's fields break its contract."""


@dataclass
class SparseTensor:
    coords: torch.Tensor
    feats: torch.Tensor
    spatial_shape: tuple[int, int, int]
    batch_size: int
    stride: int = 1
    kmaps: dict[str, Any] = field(default_factory=dict, repr=False)
    context: Optional[Any] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.spatial_shape = tuple(int(s) for s in self.spatial_shape)  # type: ignore[assignment]
        if self.coords.dim() != 2 or self.coords.shape[1] != 4:
            raise SparseTensorError(f"coords must be [N, 4] (batch, x, y, z); got {list(self.coords.shape)}")
        if self.coords.dtype != torch.int32:
            raise SparseTensorError(f"coords must be int32; got {self.coords.dtype}")
        if self.feats.dim() != 2 or self.feats.shape[0] != self.coords.shape[0]:
            raise SparseTensorError(
                f"feats must be [N, C] with N = len(coords) = {self.coords.shape[0]}; "
                f"got {list(self.feats.shape)}")
        if len(self.spatial_shape) != 3:
            raise SparseTensorError(f"spatial_shape must have 3 entries; got {self.spatial_shape}")
        # Kernel maps pack (batch, x, y, z) into one int64 key: 9 bits of batch, 18 per axis.
        if max(self.spatial_shape) > MAX_EXTENT or not 0 < self.batch_size <= MAX_BATCH:
            raise SparseTensorError(
                f"spatial_shape {self.spatial_shape} and batch_size {self.batch_size} must be at "
                f"most {MAX_EXTENT} voxels per axis and {MAX_BATCH} samples (and at least 1)")

    @property
    def num_voxels(self) -> int:
        return int(self.coords.shape[0])

    @property
    def num_channels(self) -> int:
        return int(self.feats.shape[1])

    def replace(self, **changes: Any) -> "SparseTensor":
        """A tensor sharing this one's kernel maps and context, with some fields changed."""
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SparseTensor":
        """This tensor with coords and feats on ``device`` (itself when both are there already).
        Its kernel maps stay behind: the layers build new ones from the moved coordinates, on
        ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current one
            device = torch.device("cuda", torch.cuda.current_device())
        if self.coords.device == device and self.feats.device == device:
            return self
        return replace(self, coords=self.coords.to(device, non_blocking=non_blocking),
                       feats=self.feats.to(device, non_blocking=non_blocking), kmaps={})

    def validate(self, name: str = "input") -> None:
        """Raise SparseTensorError unless every coordinate lies in [0, spatial_shape), every batch
        index in [0, batch_size), and no two rows share a voxel (the contract above; the layers
        check a tensor once, when it first meets one: a duplicate or stray row would otherwise
        be summed or dropped without a word). One sort and one read back."""
        if self.num_voxels == 0:
            return
        from halo.kmap import coord_keys

        lo, hi = torch.aminmax(self.coords, dim=0)
        keys = torch.sort(coord_keys(self.coords)).values
        dups = (keys[1:] == keys[:-1]).sum().reshape(1).to(lo.dtype)
        found = torch.cat([lo, hi, dups]).tolist()  # one read back (each is a device sync)
        lo_, hi_, n_dup = found[:4], found[4:8], found[8]
        limits = [self.batch_size, *self.spatial_shape]
        for axis, (a, b, n) in enumerate(zip(lo_, hi_, limits)):
            if a < 0 or b >= n:
                label = ("batch", "x", "y", "z")[axis]
                raise SparseTensorError(
                    f"{name}: coordinate {label} spans [{a}, {b}] but must lie in [0, {n - 1}]")
        if n_dup:  # (the error path only: find one repeated voxel's rows)
            repeated = keys[1:][keys[1:] == keys[:-1]][0]
            rows = (coord_keys(self.coords) == repeated).nonzero()[:, 0].tolist()
            raise SparseTensorError(
                f"{name}: {n_dup} row(s) repeat a voxel (rows {rows[:4]} are all "
                f"{self.coords[rows[0]].tolist()}); rows must be unique: merge them first "
                f"(sparsepipe_hpc.voxelize averages a voxel's points)")

    # --- spconv interop -------------------------------------------------------------------------
    def to_spconv(self):  # -> spconv.pytorch.SparseConvTensor
        """The same voxels as a ``spconv.pytorch.SparseConvTensor`` (shares memory)."""
        import spconv.pytorch as spconv

        return spconv.SparseConvTensor(self.feats, self.coords, list(self.spatial_shape),
                                       self.batch_size)

    @classmethod
    def from_spconv(cls, t, stride: int = 1) -> "SparseTensor":
        return cls(t.indices.int(), t.features, tuple(t.spatial_shape), int(t.batch_size), stride)

    @classmethod
    def from_voxels(cls, samples: Sequence[Any], spatial_shape: Sequence[int] | np.ndarray,
                    dtype: torch.dtype = torch.float32) -> "SparseTensor":
        """Batch per-sample voxel sets (objects with ``coords [n, 3]`` and ``feats [n, C]``)."""
        coords, feats = [], []
        for b, s in enumerate(samples):
            wide = torch.as_tensor(s.coords)
            if len(wide) and (wide.is_floating_point() or not (
                    int(wide.min()) >= -(2 ** 31) and int(wide.max()) < 2 ** 31)):
                raise SparseTensorError(  # int32 would keep the low bits: a voxel elsewhere
                    f"coords of sample {b} must be integers within int32; got {wide.dtype} in "
                    f"[{wide.min().item()}, {wide.max().item()}]")
            c = wide.to(torch.int32)
            coords.append(torch.cat([torch.full((len(c), 1), b, dtype=torch.int32,
                                                device=c.device), c], 1))
            feats.append(torch.as_tensor(s.feats, dtype=dtype))
        shape = tuple(int(n) for n in spatial_shape)
        if len(shape) != 3:
            raise SparseTensorError(f"spatial_shape {spatial_shape} needs 3 sizes (x, y, z)")
        return cls(torch.cat(coords), torch.cat(feats), (shape[0], shape[1], shape[2]),
                   len(samples))
