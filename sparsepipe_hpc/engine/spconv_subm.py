"""A submanifold convolution of one voxel set onto itself through spconv's own indices and kernels.

    m = subm_map(coords, spatial_shape, batch_size, kernel_size=3, dilation=1)
    y = subm_forward(feats, weight, m)                        # [N, C_out], rows = coords' rows
    g_feats, g_weight = subm_backward(feats, weight, grad_y, m)

This is the local part of a distributed submanifold layer (this rank's voxels onto themselves:
an ordinary sparse convolution) and the whole of a serial one. spconv builds its own index data
(a hash table in C++ or CUDA, ~5x faster than :func:`halo.kmap.kernel_map` on the CPU) and runs
its own kernels:

* CUDA, kernel volume <= 32: implicit GEMM (``ConvAlgo.MaskImplicitGemm``: tensor cores in
  fp16/bf16, no gathered copies), as ``spconv.pytorch.SubMConv3d`` does by default;
* otherwise Native: spconv's submanifold gather-GEMM-scatter, which stores only half the offsets
  (the other half are their mirror images) and runs the centre offset as one plain GEMM. Measured
  here (one thread, 107k voxels, 32 -> 32 channels): forward 34 ms against 109 ms over our own map
  through the same spconv kernel.

Weights are ``[C_out, K, C_in]`` in :func:`halo.kmap.kernel_offsets` order, which is spconv's.
Row order: outputs are the input rows (``coords``), so a caller swaps this in for a
:class:`halo.kmap.KernelMap` of the same voxels without renumbering anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from sparsepipe_hpc.engine.base import Progress
from sparsepipe_hpc.engine import spconv_engine
from sparsepipe_hpc.engine.spconv_engine import native_dtype, patch_spconv, spconv_call

__all__ = ["SubmMap", "subm_map", "subm_forward", "subm_backward", "CPU_MAX_VOXEL_INDEX",
           "indexable"]

_IGEMM_MAX_VOLUME = 32  # spconv's own limit for its implicit-GEMM kernels

#: spconv 2.3.8's CPU submanifold indices keep each voxel's linear index (batch x grid volume) in
#: an int32 hash table (``generate_subm_conv_inds``; its own guard is computed in int and wraps),
#: so on larger grids voxels 2**32 apart alias: one sample read another's neighbours, silently
#: (0.52 off at batch 2 on a 4096 x 4096 x 256 grid). Its CUDA code switches to int64 keys.
CPU_MAX_VOXEL_INDEX = 2 ** 31 - 1


def indexable(device: torch.device, spatial_shape: Sequence[int], batch_size: int) -> bool:
    """Whether spconv's own submanifold indices are right for this grid on ``device``."""
    volume = batch_size * math.prod(int(s) for s in spatial_shape)
    return device.type != "cpu" or volume <= CPU_MAX_VOXEL_INDEX


@dataclass
class SubmMap:
    """spconv's index data for a submanifold convolution of ``n`` voxels onto themselves."""

    n: int
    kernel_volume: int
    implicit_gemm: bool
    native: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (pairs, host counts)
    igemm: Optional[tuple] = None  # get_indice_pairs_implicit_gemm's result
    # Implicit GEMM: the forward's output mask, needed by backward; it depends on the tile the
    # kernel chose, i.e. on channels and dtype, so it is kept per (C_in, C_out, dtype).
    _fwd_masks: dict = field(default_factory=dict, repr=False)
    _explicit: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    @property
    def n_in(self) -> int:
        return self.n

    @property
    def n_out(self) -> int:
        return self.n

    @property
    def num_pairs(self) -> int:
        """Nonzero when there is anything to convolve (the centre offset alone pairs every row)."""
        return self.n


def subm_map(coords: torch.Tensor, spatial_shape: Sequence[int], batch_size: int,
             kernel_size: int, dilation: int = 1) -> SubmMap:
    """spconv's indices for a submanifold ``kernel_size`` convolution over ``coords``.

    coords int32 [N, 4] (batch, x, y, z) within ``[0, spatial_shape)``, rows unique; on CUDA the
    implicit-GEMM form when the kernel volume allows it, else the Native one. ValueError where
    spconv's indices would be wrong (:func:`indexable`): use :func:`halo.kmap.kernel_map`.
    """
    if not indexable(coords.device, spatial_shape, batch_size):
        raise ValueError(f"subm_map: {batch_size} sample(s) of a {tuple(spatial_shape)} grid "
                         f"index past spconv's CPU limit {CPU_MAX_VOXEL_INDEX} (its int32 hash): "
                         "use halo.kmap.kernel_map")
    patch_spconv()
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    k3 = kernel_size ** 3
    coords = coords.contiguous()
    shape = [int(s) for s in spatial_shape]
    ks, one, pad = [kernel_size] * 3, [1] * 3, [0] * 3
    dil = [dilation] * 3
    if len(coords) == 0:
        return SubmMap(0, k3, False)
    if coords.is_cuda and k3 <= _IGEMM_MAX_VOLUME:
        with spconv_call(coords.device):
            res = ops.get_indice_pairs_implicit_gemm(
                coords, batch_size, shape, ConvAlgo.MaskImplicitGemm, ksize=ks, stride=one,
                padding=pad, dilation=dil, out_padding=pad, subm=True, transpose=False,
                is_train=True)
        return SubmMap(len(coords), k3, True, igemm=tuple(res))
    with spconv_call(coords.device):
        _, pairs, counts = ops.get_indice_pairs(coords, batch_size, shape, ConvAlgo.Native, ks,
                                                one, pad, dil, pad, True, False)
    # The counts on the host, once: spconv's kernels read them there (it copies device counts back
    # at every call: a device sync per call, and one per piece between progress calls).
    return SubmMap(len(coords), k3, False, native=(pairs, counts.cpu()))


def _explicit_pairs(m: SubmMap) -> tuple[torch.Tensor, torch.Tensor]:
    """spconv's half table completed with the mirrored offsets (pairs swapped), for plain
    (non-submanifold) calls on some offsets; the centre left empty. Built once, on demand."""
    if m._explicit is None:
        assert m.native is not None
        pairs, counts = m.native
        k = len(counts)
        full = pairs.clone()
        n = counts.clone()
        for j in range(k // 2):
            c = int(counts[j])
            full[0, k - 1 - j, :c] = pairs[1, j, :c]  # (a list index would be copied to
            full[1, k - 1 - j, :c] = pairs[0, j, :c]  # the GPU, waiting for it)
            n[k - 1 - j] = counts[j]
        n[k // 2] = 0
        m._explicit = (full, n)
    return m._explicit


def _native_pieces(m: SubmMap, progress: Progress
                   ) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(pairs, counts, submanifold call?) pieces: the whole map as one submanifold call, or, when
    an exchange wants progress calls in between, two: the centre and the first offsets (and their
    mirrors) as a submanifold call, the rest as a plain call on the completed table."""
    assert m.native is not None
    pairs, counts = m.native
    k = len(counts)
    if progress is None or k < 8:
        return [(pairs, counts, True)]
    full, full_counts = _explicit_pairs(m)
    split = k // 4  # spconv stores offsets 0..k/2-1: the first quarter, then the rest
    first = torch.zeros_like(counts)
    first[:split] = counts[:split]
    rest = full_counts.clone()
    rest[:split] = 0
    rest[k - split:] = 0
    if not bool(rest.any()):  # spconv's CUDA kernels refuse a plain call with no pairs at all
        return [(pairs, counts, True)]
    return [(pairs, first, True), (full, rest, False)]


def _gather_channels(m: SubmMap, weight: torch.Tensor) -> tuple[int, ...]:
    """(C_in, C_out) when ``m`` runs spconv's gather-GEMM-scatter (see :func:`native_dtype`)."""
    return () if m.implicit_gemm else (weight.shape[2], weight.shape[0])


def subm_forward(feats: torch.Tensor, weight: torch.Tensor, m: SubmMap,
                 progress: Progress = None) -> torch.Tensor:
    """feats [N, C_in], weight [C_out, K, C_in] -> [N, C_out]."""
    if m.n == 0:
        return feats.new_zeros(0, weight.shape[0])
    work = native_dtype(feats.dtype, feats.device, _gather_channels(m, weight))
    if work != feats.dtype:
        return subm_forward(feats.to(work), weight.to(work), m, progress).to(feats.dtype)
    from spconv.pytorch import ops

    feats, weight = feats.contiguous(), weight.contiguous()
    if m.implicit_gemm:
        assert m.igemm is not None
        _, _, pair_fwd, _, mask_fwd, _, argsort_fwd, _, masks = m.igemm
        with spconv_call(feats.device):
            y, mask_out, mask_width = ops.implicit_gemm(feats, weight, pair_fwd, mask_fwd,
                                                        argsort_fwd, m.n, masks, True, True)
        m._fwd_masks[(weight.shape, weight.dtype)] = (mask_out, mask_width)
        if progress is not None:
            progress()
        return y
    out: Optional[torch.Tensor] = None
    with spconv_call(feats.device):
        for pairs, part, subm in _native_pieces(m, progress):
            y = ops.indice_conv(feats, weight, pairs, part, m.n, False, subm)
            out = y if out is None else out.add_(y)
            if progress is not None:
                progress()
    assert out is not None
    return out


def subm_backward(feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, m: SubmMap,
                  progress: Progress = None, need_input_grad: bool = True
                  ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Gradients of :func:`subm_forward`: (grad_feats [N, C_in] or None, grad_weight)."""
    if m.n == 0:
        return (feats.new_zeros(0, weight.shape[2]) if need_input_grad else None,
                torch.zeros_like(weight))
    work = native_dtype(feats.dtype, feats.device, _gather_channels(m, weight))
    if work != feats.dtype:
        gi, gw = subm_backward(feats.to(work), weight.to(work), grad_out.to(work), m, progress,
                               need_input_grad)
        return (None if gi is None else gi.to(feats.dtype)), gw.to(weight.dtype)
    from spconv.pytorch import ops

    feats, weight, grad_out = feats.contiguous(), weight.contiguous(), grad_out.contiguous()
    if m.implicit_gemm:
        assert m.igemm is not None
        _, _, pair_fwd, pair_bwd, mask_fwd, mask_bwd, argsort_fwd, argsort_bwd, masks = m.igemm
        saved: Any = m._fwd_masks.get((weight.shape, weight.dtype))
        if saved is None:
            raise RuntimeError("subm_backward on the implicit-GEMM path needs a forward with the "
                               "same weight shape and dtype first (it keeps the output mask)")
        mask_out, mask_width = saved
        with spconv_call(feats.device):
            gi, gw = ops.implicit_gemm_backward(feats, weight, grad_out, pair_fwd, pair_bwd,
                                                mask_fwd, mask_bwd, argsort_fwd, argsort_bwd,
                                                mask_output_fwd=mask_out, masks=masks,
                                                mask_width=mask_width, is_subm=True)
        if progress is not None:
            progress()
        return (gi if need_input_grad else None), gw.view_as(weight)
    if feats.device.type in spconv_engine.SPLIT_BACKWARD:
        return _split_backward(feats, weight, grad_out, m, progress, need_input_grad)
    g_in: Optional[torch.Tensor] = None
    g_w: Optional[torch.Tensor] = None
    with spconv_call(feats.device):
        for pairs, part, subm in _native_pieces(m, progress):
            gi, gw = ops.indice_conv_backward(feats, weight, grad_out, pairs, part, False, subm)
            gw = gw.view_as(weight)
            g_in = gi if g_in is None else g_in.add_(gi)
            g_w = gw if g_w is None else g_w.add_(gw)
            if progress is not None:
                progress()
    assert g_in is not None and g_w is not None
    return (g_in if need_input_grad else None), g_w


def _split_backward(feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, m: SubmMap,
                    progress: Progress, need_input_grad: bool
                    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """:func:`subm_backward` on the Native path without spconv's backward kernels (which take a
    cudaMalloc and a cudaFree per offset on CUDA: ``spconv_engine.SPLIT_BACKWARD``): the centre
    offset as plain GEMMs, the others as :func:`spconv_engine.split_backward` over the completed
    table."""
    from spconv.pytorch import ops

    full, counts = _explicit_pairs(m)  # mirrored offsets filled in, the centre left empty
    g_in, g_w = spconv_engine.split_backward(ops, feats, weight, grad_out, full, counts, m.n,
                                             None, need_input_grad)
    centre = m.kernel_volume // 2
    with spconv_call(feats.device):
        torch.mm(grad_out.t(), feats, out=g_w[:, centre])
        if need_input_grad:
            g_centre = grad_out @ weight[:, centre]
            g_in = g_centre if g_in is None else g_in.add_(g_centre)
    if progress is not None:
        progress()
    return g_in, g_w
