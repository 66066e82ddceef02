"""Sparse convolution layers: submanifold, strided and inverse (transposed), spconv-compatible.

    conv = SubMConv3d(16, 32, kernel_size=3)                     # outputs on the input's voxels
    down = SparseConv3d(32, 64, kernel_size=2, stride=2, indice_key="down1")
    up = SparseInverseConv3d(64, 32, kernel_size=2, indice_key="down1")  # back onto down's inputs
    y = up(down(conv(x)))

Weights are ``[C_out, kx, ky, kz, C_in]`` (spconv 2's layout, so state dicts carry over; except
kernel size 1, whose storage spconv reads as ``[C_in, C_out]``). Kernel
maps are cached in the tensor's ``kmaps`` under the indice key (submanifold maps under one key per
kernel, dilation and stride, since a network has one voxel set per stride). When the tensor has a
spatial context the layer runs distributed (sparsepipe_hpc.parallel.spatial) with the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from halo.kmap import KernelMap, kernel_map, strided_map
from sparsepipe_hpc.engine import Engine, get_engine
from sparsepipe_hpc.nn.functional import sparse_conv
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "ConvEntry", "ConvSpec",
           "ConvError"]


class ConvError(ValueError):
    """A convolution that cannot run on the tensor it was given."""


@dataclass(frozen=True)
class ConvSpec:
    """Geometry of a convolution (voxels at the input's stride)."""

    kernel_size: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    subm: bool = False

    def out_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        if self.subm:
            return shape
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation
        return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in shape)  # type: ignore


@dataclass
class ConvEntry:
    """A cached kernel map and the voxel sets it connects (``in`` at stride ``in_stride``)."""

    spec: ConvSpec
    in_coords: torch.Tensor
    out_coords: torch.Tensor
    in_shape: tuple[int, int, int]
    out_shape: tuple[int, int, int]
    in_stride: int
    kmap: Optional[KernelMap] = None
    extra: object = None  # the distributed layer's plan and split maps
    batch_size: int = 1
    native: dict = field(default_factory=dict, repr=False)  # engine name -> its subm map or None

    def local_map(self, engine: Engine) -> Any:
        """The map a serial layer runs: for a submanifold convolution the engine's own
        (:meth:`Engine.subm_map`, built once per engine), else the KernelMap (built on first use
        when the engine has none)."""
        s = self.spec
        if s.subm:
            if engine.name not in self.native:
                self.native[engine.name] = engine.subm_map(self.in_coords, self.in_shape,
                                                           self.batch_size, s.kernel_size,
                                                           s.dilation)
            if self.native[engine.name] is not None:
                return self.native[engine.name]
        if self.kmap is None:
            self.kmap = kernel_map(self.in_coords, self.out_coords, s.kernel_size, s.stride,
                                   s.padding, s.dilation)
        return self.kmap


class _SparseConvBase(nn.Module):
    transposed = False

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 padding: int = 0, dilation: int = 1, bias: bool = False,
                 indice_key: Optional[str] = None, engine: str = "auto", subm: bool = False):
        super().__init__()
        for name, v in (("in_channels", in_channels), ("out_channels", out_channels),
                        ("kernel_size", kernel_size), ("stride", stride), ("dilation", dilation)):
            if int(v) < 1:
                raise ConvError(f"{name} must be >= 1; got {v}")
        if subm and kernel_size % 2 == 0:
            raise ConvError(f"a submanifold convolution needs an odd kernel_size; got {kernel_size}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.spec = ConvSpec(kernel_size, 1 if subm else stride,
                             dilation * (kernel_size // 2) if subm else padding, dilation, subm)
        self.indice_key = indice_key
        self.engine_name = engine
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size,
                                               in_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        fan_in = in_channels * kernel_size ** 3
        nn.init.uniform_(self.weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={s.kernel_size}, "
                f"stride={s.stride}, padding={s.padding}, dilation={s.dilation}"
                + (f", indice_key={self.indice_key!r}" if self.indice_key else ""))

    def weight_matrix(self) -> torch.Tensor:
        """The weight as [C_out, K, C_in], K = kernel_size**3 in spconv's offset order."""
        return self.weight.reshape(self.out_channels, -1, self.in_channels)

    def cache_key(self, x: SparseTensor) -> str:
        s = self.spec
        if s.subm:
            return f"subm:k{s.kernel_size}:d{s.dilation}:s{x.stride}"
        return self.indice_key or f"conv:k{s.kernel_size}:s{s.stride}:p{s.padding}:d{s.dilation}@{x.stride}"

    def forward(self, x: SparseTensor) -> SparseTensor:
        if x.num_channels != self.in_channels:
            raise ConvError(f"{type(self).__name__} expects {self.in_channels} input channels; "
                            f"got a tensor with {x.num_channels}")
        spatial = x.context.spatial if x.context is not None else None
        engine = get_engine(self.engine_name, x.feats.device)
        if spatial is not None:
            y = spatial.conv(self, x, engine)
        else:
            entry = self.entry(x)
            if entry.extra is not None:
                raise ConvError(f"kernel map {self.indice_key or self.cache_key(x)!r} was built by "
                                f"a spatially distributed layer, but this tensor has no spatial "
                                f"context; run the whole network on tensors from one source")
            kmap = entry.local_map(engine)
            kmap = kmap.transpose() if self.transposed else kmap
            feats = sparse_conv(x.feats, self.weight_matrix(), kmap, engine)
            y = self.output_tensor(x, entry, feats)
        if self.bias is not None:
            y = y.replace(feats=y.feats + self.bias.to(y.feats.dtype))
        return y

    def output_tensor(self, x: SparseTensor, entry: ConvEntry, feats: torch.Tensor) -> SparseTensor:
        if self.transposed:
            return x.replace(coords=entry.in_coords, feats=feats, spatial_shape=entry.in_shape,
                             stride=entry.in_stride)
        return x.replace(coords=entry.out_coords, feats=feats, spatial_shape=entry.out_shape,
                         stride=x.stride * entry.spec.stride)

    def entry(self, x: SparseTensor) -> ConvEntry:
        """The serial kernel map for ``x``, built once per key."""
        if self.transposed:
            return inverse_entry(self, x)
        key = self.cache_key(x)
        e = x.kmaps.get(key)
        if e is None:
            s = self.spec
            out_shape = s.out_shape(x.spatial_shape)
            # A submanifold layer may run the engine's own map: its KernelMap is built on first
            # use (local_map); a strided one's now, since its inverse and the pipeline read it.
            out, km = (x.coords, None) if s.subm else strided_map(
                x.coords, s.kernel_size, s.stride, s.padding, s.dilation, out_shape)
            e = ConvEntry(s, x.coords, out, x.spatial_shape, out_shape, x.stride, km,
                          batch_size=x.batch_size)
            x.kmaps[key] = e
        elif e.in_coords.shape != x.coords.shape:
            raise ConvError(f"kernel map {key!r} was built for {len(e.in_coords)} voxels but the "
                            f"input has {len(x.coords)}; give this layer its own indice_key")
        return e


def inverse_entry(layer: "_SparseConvBase", x: SparseTensor) -> ConvEntry:
    """The entry of the strided convolution that an inverse convolution undoes."""
    if layer.indice_key is None or layer.indice_key not in x.kmaps:
        raise ConvError(f"SparseInverseConv3d(indice_key={layer.indice_key!r}) needs the "
                        f"indice_key of an earlier SparseConv3d on this tensor; known keys: "
                        f"{sorted(k for k in x.kmaps if not k.startswith('subm'))}")
    e = x.kmaps[layer.indice_key]
    if e.spec.kernel_size != layer.spec.kernel_size or len(e.out_coords) != len(x.coords):
        raise ConvError(f"SparseInverseConv3d(kernel_size={layer.spec.kernel_size}) does not match "
                        f"the convolution {layer.indice_key!r} (kernel_size={e.spec.kernel_size}, "
                        f"{len(e.out_coords)} outputs vs {len(x.coords)} inputs here)")
    return e


class SubMConv3d(_SparseConvBase):
    """Submanifold convolution: outputs exactly on the input voxels (odd kernel, any dilation)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 dilation: int = 1, bias: bool = False, indice_key: Optional[str] = None,
                 engine: str = "auto"):
        super().__init__(in_channels, out_channels, kernel_size, 1, 0, dilation, bias, indice_key,
                         engine, subm=True)


class SparseConv3d(_SparseConvBase):
    """Strided sparse convolution: an output is active where any input reaches it."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 2, stride: int = 2,
                 padding: int = 0, dilation: int = 1, bias: bool = False,
                 indice_key: Optional[str] = None, engine: str = "auto"):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, bias,
                         indice_key, engine)


class SparseInverseConv3d(_SparseConvBase):
    """Transposed convolution back onto the inputs of the SparseConv3d with the same indice_key."""

    transposed = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 2,
                 indice_key: Optional[str] = None, bias: bool = False, engine: str = "auto"):
        if indice_key is None:
            raise ConvError("SparseInverseConv3d needs the indice_key of the convolution it inverts")
        super().__init__(in_channels, out_channels, kernel_size, 1, 0, 1, bias, indice_key, engine)
