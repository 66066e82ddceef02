"""Explicit kernel maps through spconv's implicit GEMM: a KernelMap's pairs as spconv's tables.

    if spconv_igemm.applies(kmap, feats, weight):
        y = spconv_igemm.forward(feats, weight, kmap)                       # [N_out, C_out]
        g_feats, g_weight = spconv_igemm.backward(feats, weight, grad_y, kmap, True)

A plain spconv network runs its strided and inverse layers through spconv's implicit GEMM
(``ConvAlgo.MaskImplicitGemm``): tensor-core tiles that gather their input rows inside the GEMM,
so no gathered copy is ever written. The explicit gather-GEMM-scatter gathers both operands per
offset for its weight gradient (torch's row gather); an H100 spent 5.5 ms of an 85 ms fp16 U-Net
step there, where the plain network spends none. This module runs the plain network's kernels on
the project's own maps (their rows, order and ownership unchanged), so it needs none of spconv's
index generation:

    pair_fwd  int32 [K, N_out]  input row of (offset k, output o), -1 where none
    pair_bwd  int32 [K, N_in]   output row of (offset k, input i), -1 where none
    mask      int32 [N]         bit k set where the row has a pair at offset k (K <= 32)
    argsort   int32 [N]         rows ordered by mask; the kernels read ``mask`` in that order
                                (``mask[j]`` is row ``argsort[j]``'s, as spconv's in-place
                                key sort leaves it), so a tile of rows shares its offsets

The transposed map (an inverse convolution) swaps the forward and backward tables, as spconv's
``SparseInverseConv3d`` does. The forward's per-tile output mask, which the backward's weight
gradient reads, depends on the tables and the tile the kernel chose (so on channels and dtype),
not on the data: it is kept per weight shape and dtype.

These semantics were checked against the sources spconv 2.3.8 and cumm 0.7.11 generate their
kernels from (``indices.py``'s stage-2 tables, the in-place ascending key sort, -1 read as zero
by every gather, the inverse's swap without a weight flip); fp16 tiles may accumulate in fp16,
as spconv's own layers' do.

On by default on CUDA (:data:`DEVICES`), where it is measured faster: on an H100 (``bench gpu``,
1.66 M voxels, U-Net width 32 depth 4, forward+backward) the step took 87.3 ms against 90.0 ms
on the explicit path in fp16 and 203 ms against 208 ms in fp32, the k2s2 layer and its inverse
7.8 ms against 10.7 ms (fp16, maps included), for 1-2% more peak memory (docs/gpu.md). The
tables cost ``K x (N_in + N_out)`` entries and two sorts however few the pairs, so a sparse map
(fewer pairs than half the rows of a side: usually a distributed layer's halo part) stays on the
explicit path, which costs per pair (:func:`dense_enough`; that choice is not timed).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch

from halo.kmap import KernelMap

__all__ = ["DEVICES", "MAX_OFFSETS", "Tables", "tables", "dense_enough", "applies", "only_on",
           "forward", "backward", "reference_forward"]

DEVICES: tuple[str, ...] = ("cuda",)  # device types whose explicit maps run here
MAX_OFFSETS = 32  # one 32-bit mask per row: spconv's implicit-GEMM kernels take K <= 32


@dataclass
class Tables:
    """spconv's implicit-GEMM index tables of one KernelMap (see the module docstring)."""

    pair_fwd: torch.Tensor
    pair_bwd: torch.Tensor
    mask_fwd: torch.Tensor
    mask_bwd: torch.Tensor
    argsort_fwd: torch.Tensor
    argsort_bwd: torch.Tensor
    n_out: int
    # The forward's output mask and its width, per (weight shape, dtype): the backward reads it.
    fwd_masks: dict = field(default_factory=dict, repr=False)

    def transposed(self) -> "Tables":
        """The tables of the transposed convolution (the forward and backward roles swap)."""
        return Tables(self.pair_bwd, self.pair_fwd, self.mask_bwd, self.mask_fwd,
                      self.argsort_bwd, self.argsort_fwd, self.pair_bwd.shape[1])


def _side(rows: torch.Tensor, other: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor,
          k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair [K, n] with ``other`` at (offset, row), -1 elsewhere; masks sorted; argsort);
    ``bits``: ``1 << offsets``."""
    pair = torch.full((k, n), -1, dtype=torch.int32, device=rows.device)
    pair[offsets, rows] = other.to(torch.int32)
    # A row has at most one pair per offset (a map between two voxel sets), so the sum of its
    # pairs' bits is their OR: one pass over the pairs, not three over the K x n table. Masks of
    # up to 8 bits sort as bytes (one radix pass, not four); the order is the same. On this
    # project's CPU both sides of a k2s2 map of 918k voxels took 25 ms here against 84 ms.
    mask = torch.zeros(n, dtype=torch.int64, device=rows.device).index_add_(0, rows, bits)
    sorted_mask, order = torch.sort(mask.to(torch.uint8 if k <= 8 else torch.int32), stable=True)
    return pair, sorted_mask.to(torch.int32), order.to(torch.int32)


def tables(kmap: KernelMap) -> Tables:
    """``kmap``'s implicit-GEMM tables, built once and kept on the map; its transpose gets the
    same tables with the roles swapped (:meth:`Tables.transposed`), not a second build."""
    if kmap._igemm is None:
        k = kmap.num_offsets
        if k > MAX_OFFSETS:
            raise ValueError(f"spconv's implicit GEMM takes at most {MAX_OFFSETS} kernel "
                             f"offsets; this map has {k}")
        offsets = kmap.pair_offsets()
        bits = 1 << offsets
        fwd, mask_fwd, arg_fwd = _side(kmap.out_rows, kmap.in_rows, offsets, bits, k, kmap.n_out)
        bwd, mask_bwd, arg_bwd = _side(kmap.in_rows, kmap.out_rows, offsets, bits, k, kmap.n_in)
        kmap._igemm = Tables(fwd, bwd, mask_fwd, mask_bwd, arg_fwd, arg_bwd, kmap.n_out)
        t = kmap._transposed  # made before these tables (else transpose() copies them)
        if t is not None and t._igemm is None:
            t._igemm = kmap._igemm.transposed()
    return kmap._igemm


@contextlib.contextmanager
def only_on(*device_types: str) -> Iterator[None]:
    """Within the block, explicit maps run here on these device types only: ``only_on()`` is the
    explicit path everywhere (``bench gpu``'s comparison, the tests)."""
    global DEVICES
    saved, DEVICES = DEVICES, device_types
    try:
        yield
    finally:
        DEVICES = saved


def dense_enough(kmap: KernelMap) -> bool:
    """Pairs for at least half the rows of either side: worth tables of ``K x (N_in + N_out)``
    entries (a strided layer, its inverse, even where the grid's edge drops some inputs; not a
    halo part, whose few pairs the explicit path runs for less)."""
    return kmap.num_pairs > 0 and 2 * kmap.num_pairs >= max(kmap.n_in, kmap.n_out)


def applies(kmap: object, feats: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``kmap`` is an explicit map this module runs on ``feats``' device: a CUDA device
    listed in :data:`DEVICES`, at most :data:`MAX_OFFSETS` offsets, :func:`dense_enough`, and
    operands under 2 GiB (cumm's kernels index each with 32 bits; float32 assumed, as bfloat16
    computes in it)."""
    if not (isinstance(kmap, KernelMap) and feats.device.type in DEVICES
            and feats.device.type == "cuda" and kmap.num_offsets <= MAX_OFFSETS
            and dense_enough(kmap)):
        return False
    c_out, _, c_in = weight.shape
    return max(kmap.n_in * c_in, kmap.n_out * c_out) * 4 < 2**31


def _masks() -> list[np.ndarray]:
    return [np.array([0xFFFFFFFF], dtype=np.uint32)]  # one split: every offset in one pass


def forward(feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """feats [N_in, C_in], weight [C_out, K, C_in] (contiguous, float32 or float16, CUDA) ->
    [N_out, C_out]."""
    from spconv.pytorch import ops

    t = tables(kmap)
    y, mask_out, mask_width = ops.implicit_gemm(feats, weight, t.pair_fwd, [t.mask_fwd[:, None]],
                                                [t.argsort_fwd], t.n_out, _masks(), True, False)
    t.fwd_masks[(tuple(weight.shape), weight.dtype)] = (mask_out, mask_width)
    return y


def backward(feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, kmap: KernelMap,
             need_input_grad: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Gradients of :func:`forward` (which must have run with this weight's shape and dtype):
    (grad_feats [N_in, C_in] or None, grad_weight [C_out, K, C_in])."""
    from spconv.pytorch import ops

    t = tables(kmap)
    saved = t.fwd_masks.get((tuple(weight.shape), weight.dtype))
    if saved is None:
        raise RuntimeError("spconv_igemm.backward needs a forward with the same weight shape "
                           "and dtype on this map first (it keeps the output mask)")
    mask_out, mask_width = saved
    gi, gw = ops.implicit_gemm_backward(
        feats, weight, grad_out, t.pair_fwd, t.pair_bwd, [t.mask_fwd[:, None]],
        [t.mask_bwd[:, None]], [t.argsort_fwd], [t.argsort_bwd], mask_output_fwd=mask_out,
        masks=_masks(), mask_width=mask_width, is_subm=False)
    return (gi if need_input_grad else None), gw.view_as(weight)


def reference_forward(feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """The forward as the kernels read the tables, in torch (any device and dtype): for each
    position j of the sorted order, row ``argsort[j]`` takes offset k where bit k of ``mask[j]``
    is set, from input ``pair_fwd[k, row]``. For tests: it equals the explicit path exactly
    when the tables say what the map says."""
    t = tables(kmap)
    rows_ = t.argsort_fwd.long()
    out = feats.new_zeros(t.n_out, weight.shape[0])
    for k in range(kmap.num_offsets):
        on_k = ((t.mask_fwd.long() >> k) & 1).bool()
        r = rows_[on_k]
        src = t.pair_fwd[k, r].long()
        if bool((src < 0).any()):
            raise AssertionError(f"offset {k}: the mask names pairs the table lacks")
        out[r] += feats[src] @ weight[:, k].t()
    return out
