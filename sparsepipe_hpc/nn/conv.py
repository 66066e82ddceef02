"""Sparse convolution layers: submanifold, strided and inverse (transposed), spconv-compatible.

    conv = SubMConv3d(16, 32, kernel_size=3)                     # outputs on the input's voxels
    down = SparseConv3d(32, 64, kernel_size=2, stride=2, indice_key="down1")
    up = SparseInverseConv3d(64, 32, kernel_size=2, indice_key="down1")  # back onto down's inputs
    y = up(down(conv(x)))

Weights are ``[C_out, kx, ky, kz, C_in]`` (spconv 2's layout, so state dicts carry over; except
kernel size 1, whose storage spconv reads as ``[C_in, C_out]``). Kernel
maps are cached in the tensor's ``kmaps`` under the indice key (:mod:`sparsepipe_hpc.kmaps`).
When the tensor has a spatial context the layer runs distributed with the same weights: its
domain (:mod:`sparsepipe_hpc.parallel.spatial`) builds the entry and runs the convolution on the
features and weight the layer hands it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from sparsepipe_hpc import mapstream
from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.kmaps import (ConvEntry, ConvError, ConvSpec, cache_key, inverse_entry,
                                  serial_entry)
from sparsepipe_hpc.nn.amp import autocast_inputs
from sparsepipe_hpc.nn.functional import sparse_conv
from sparsepipe_hpc.sparse import MAX_EXTENT, SparseTensor

__all__ = ["SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "ConvError"]


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
        if int(padding) < 0:
            raise ConvError(f"padding must be >= 0; got {padding}")
        reach = int(dilation) * (int(kernel_size) - 1) + int(padding)
        if reach > MAX_EXTENT:  # voxel keys hold [-2**17, 2**17): a longer reach wraps an axis
            raise ConvError(f"dilation * (kernel_size - 1) + padding is {reach} voxels; at most "
                            f"{MAX_EXTENT} (a grid's extent) is supported")
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
        """This layer's key in ``x.kmaps`` (an inverse layer's: the convolution it undoes)."""
        if self.transposed:
            return str(self.indice_key)
        return cache_key(self.spec, x.stride, self.indice_key)

    def forward(self, x: SparseTensor) -> SparseTensor:
        if x.num_channels != self.in_channels:
            raise ConvError(f"{type(self).__name__} expects {self.in_channels} input channels; "
                            f"got a tensor with {x.num_channels}")
        spatial = x.context.spatial if x.context is not None else None
        if spatial is None and getattr(x.context, "group", None) is not None:
            # Every rank of the group takes this branch alike: an error, not a hang.
            raise ConvError(f"{type(self).__name__}: the input carries a spatially parallel "
                            f"context that no batch is bound to, so this rank's voxels have no "
                            f"box to exchange halos over; make the input with ctx.distribute(...) "
                            f"or read_distributed(...), not x.replace(context=ctx)")
        if not x.kmaps:  # a tensor no layer has met yet (derived ones share its kmaps)
            mapstream.note(x.coords)
            if spatial is None:  # (a distributed one was checked whole, on every rank, when cut)
                x.validate(f"{type(self).__name__} input")
        engine = get_engine(self.engine_name, x.feats.device)
        entry = self.entry(x)
        if spatial is not None:
            feats, weight = autocast_inputs(x.feats, self.weight_matrix())
            out = spatial.conv(feats, weight, entry, engine, self.transposed)
        else:
            if entry.extra is not None:
                raise ConvError(f"kernel map {self.cache_key(x)!r} was built by a spatially "
                                f"distributed layer, but this tensor has no spatial context; "
                                f"run the whole network on tensors from one source")
            kmap = entry.local_map(engine)
            kmap = kmap.transpose() if self.transposed else kmap
            out = sparse_conv(x.feats, self.weight_matrix(), kmap, engine)
        y = self._output(x, entry, out)
        if self.bias is not None:
            y = y.replace(feats=y.feats + self.bias.to(y.feats.dtype))
        return y

    def _output(self, x: SparseTensor, entry: ConvEntry, feats: torch.Tensor) -> SparseTensor:
        if self.transposed:
            return x.replace(coords=entry.in_coords, feats=feats, spatial_shape=entry.in_shape,
                             stride=entry.in_stride)
        return x.replace(coords=entry.out_coords, feats=feats, spatial_shape=entry.out_shape,
                         stride=x.stride * entry.spec.stride)

    def entry(self, x: SparseTensor) -> ConvEntry:
        """This layer's kernel-map entry for ``x``, built once per key: serial, or through the
        tensor's spatial domain (collective over its group when the layer needs a halo plan)."""
        if self.transposed:
            return inverse_entry(x, self.indice_key, self.spec.kernel_size)
        spatial = x.context.spatial if x.context is not None else None
        if spatial is not None:
            return spatial.entry(x, self.spec, self.cache_key(x))
        return serial_entry(x, self.spec, self.cache_key(x))


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
