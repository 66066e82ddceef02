"""Own pure-torch engine: per kernel offset, gather rows, one GEMM, scatter-add in place.

It accumulates into one output buffer with ``index_add_`` instead of letting autograd build one
``index_add`` (a full copy of the output) per offset, which measured 1.3-2x slower. It is correct
at any thread count and runs unchanged on CUDA tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from halo.kmap import KernelMap
from sparsepipe_hpc.engine.base import Engine, Progress

__all__ = ["TorchEngine"]


class TorchEngine(Engine):
    name = "torch"

    def forward(self, feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap,
                progress: Progress = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            out = feats.new_zeros(kmap.n_out, weight.shape[0])
        for k in range(kmap.num_offsets):
            i, o = kmap.pairs(k)
            if len(i):
                out.index_add_(0, o, feats[i] @ weight[:, k].t())
                if progress is not None:
                    progress()
        return out

    def backward(self, feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                 kmap: KernelMap, progress: Progress = None, need_input_grad: bool = True,
                 grad_in: Optional[torch.Tensor] = None
                 ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        grad_w = torch.zeros_like(weight)
        if grad_in is None and need_input_grad:
            grad_in = feats.new_zeros(kmap.n_in, weight.shape[2])
        for k in range(kmap.num_offsets):
            i, o = kmap.pairs(k)
            if not len(i):
                continue
            g = grad_out[o]
            torch.mm(g.t(), feats[i], out=grad_w[:, k])
            if grad_in is not None:
                grad_in.index_add_(0, i, g @ weight[:, k])
            if progress is not None:
                progress()
        return grad_in, grad_w
