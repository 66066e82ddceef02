"""Strided convolutions whose windows tile the grid (a U-Net's k2s2), as dense GEMMs.

    if window.applies(kmap, feats):
        y = window.forward(feats, weight, kmap)                       # [N_out, C_out]
        g_feats, g_weight = window.backward(feats, weight, grad_y, kmap)

Where windows tile, each voxel of the fine side sits in exactly one window, at one offset ``k``,
so it has one *slot* ``coarse_row * K + k``. A convolution down (``kmap.tiling == "in"``: each
input in at most one pair) is then one GEMM over patches: the inputs copied into their slots of
a zeroed ``[N_out, K * C_in]`` buffer times the weight as ``[K * C_in, C_out]``. The inverse
(``"out"``: each output in at most one pair) computes every coarse row's ``K`` outputs in one GEMM
(``[N_in, K * C_out]``) and reads each output from its slot. Their gradients are the same GEMMs
transposed. Against spconv's gather-GEMM-scatter per offset (and a row gather per offset and
operand for the weight gradient), this is one row copy and two or three GEMMs on tensor cores,
with ``N_out * K / N_in`` (2-3 in a U-Net's surface scans) times the useful arithmetic and a
transient buffer of ``N_coarse * K * C_fine`` elements, none of it kept for the backward.

Off by default (:data:`DEVICES`): written after an H100 profile put 5.5 ms of an fp16 U-Net step
(85 ms) in row gathers of the strided layers' weight gradient; not yet timed on a GPU.
``bench gpu``'s ``strided`` table times it beside the default path and spconv's own layers.
"""

from __future__ import annotations

import sys
from typing import ContextManager, Optional

import torch

from halo.kmap import KernelMap
from sparsepipe_hpc.engine.base import switched_on
from sparsepipe_hpc.engine import rows

__all__ = ["DEVICES", "applies", "on", "forward", "backward"]

DEVICES: tuple[str, ...] = ()  # device types whose tiling maps run here; none until measured


def on(device_type: str) -> ContextManager[None]:
    """Within the block, tiling maps on ``device_type`` run here (``bench gpu``'s comparison)."""
    return switched_on(sys.modules[__name__], device_type)


def applies(kmap: object, feats: torch.Tensor) -> bool:
    """Whether ``kmap`` is a tiling map this module runs on ``feats``' device."""
    return (isinstance(kmap, KernelMap) and kmap.tiling is not None
            and feats.device.type in DEVICES)


def _slots(kmap: KernelMap) -> tuple[torch.Tensor, torch.Tensor]:
    """(per fine row, per pair), int64: a fine-side row's slot ``coarse_row * K + k``, rows
    without a pair slot ``N_coarse * K`` (one spare row past the buffer); and each pair's slot,
    in pair order. The fine side: inputs ("in") or outputs ("out")."""
    if kmap._slots is None:
        k = kmap.num_offsets
        fine, coarse, n_fine, n_coarse = _sides(kmap)
        per_pair = coarse * k + kmap.pair_offsets()
        per_row = torch.full((n_fine,), n_coarse * k, dtype=torch.int64, device=fine.device)
        per_row[fine] = per_pair
        kmap._slots = (per_row, per_pair)
    return kmap._slots


def _sides(kmap: KernelMap) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(fine rows, coarse rows) of the pairs and (N_fine, N_coarse)."""
    if kmap.tiling == "in":
        return kmap.in_rows, kmap.out_rows, kmap.n_in, kmap.n_out
    return kmap.out_rows, kmap.in_rows, kmap.n_out, kmap.n_in


def _patches(x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """[N_coarse, K * C]: the fine side's rows ``x [N_fine, C]`` in their slots, zeros elsewhere."""
    fine, _, n_fine, n_coarse = _sides(kmap)
    per_row, per_pair = _slots(kmap)
    k, c = kmap.num_offsets, x.shape[1]
    buf = x.new_zeros(n_coarse * k, c)
    if kmap.num_pairs == n_fine:  # every row has a slot of its own: a copy without a gather
        buf.index_copy_(0, per_row, x)
    else:
        buf.index_copy_(0, per_pair, rows.take(x, fine))
    return buf.view(n_coarse, k * c)


def _from_slots(a: torch.Tensor, b: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """[N_fine, C]: each fine row's slot of ``a @ b`` ([N_coarse, K * C]), zeros for a row
    without one (read from a spare zero row after the product)."""
    _, _, n_fine, n_coarse = _sides(kmap)
    k = kmap.num_offsets
    c = b.shape[1] // k
    spare = 1 if kmap.num_pairs < n_fine else 0
    flat = a.new_empty(n_coarse * k + spare, c)
    torch.mm(a, b, out=flat[:n_coarse * k].view(n_coarse, k * c))
    flat[n_coarse * k:] = 0
    return rows.take(flat, _slots(kmap)[0])


def forward(feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """``y[o] = sum over pairs (i, o, k) of weight[:, k] @ feats[i]``: feats [N_in, C_in],
    weight [C_out, K, C_in] -> [N_out, C_out]."""
    c_out, k, c_in = weight.shape
    if kmap.tiling == "in":
        return _patches(feats, kmap) @ weight.reshape(c_out, k * c_in).t()
    return _from_slots(feats, weight.permute(2, 1, 0).reshape(c_in, k * c_out), kmap)


def backward(feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, kmap: KernelMap,
             need_input_grad: bool = True) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Gradients of :func:`forward`: (grad_feats [N_in, C_in] or None, grad_weight)."""
    c_out, k, c_in = weight.shape
    if kmap.tiling == "in":
        w = weight.reshape(c_out, k * c_in)
        g_w = (grad_out.t() @ _patches(feats, kmap)).view(c_out, k, c_in)
        g_in = _from_slots(grad_out, w, kmap) if need_input_grad else None
        return g_in, g_w
    w = weight.permute(2, 1, 0).reshape(c_in, k * c_out)
    g_patches = _patches(grad_out, kmap)                                # [N_in, K * C_out]
    g_w = (feats.t() @ g_patches).view(c_in, k, c_out).permute(2, 1, 0).contiguous()
    return (g_patches @ w.t() if need_input_grad else None), g_w
