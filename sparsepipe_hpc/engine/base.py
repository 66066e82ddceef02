"""The local sparse-convolution engine interface: gather-GEMM-scatter over a kernel map.

    engine = get_engine("torch")           # or "spconv", or "auto"
    out = engine.forward(feats, weight, kmap)                       # [n_out, C_out]
    g_feats, g_weight = engine.backward(feats, weight, grad_out, kmap)

``feats`` [n_in, C_in], ``weight`` [C_out, K, C_in] (spconv's KRSC order with the kernel flattened),
``kmap`` a :class:`halo.kmap.KernelMap`, or what the engine's :meth:`Engine.subm_map` returned for a
submanifold convolution of one voxel set onto itself (spconv: its own indices and kernels,
implicit GEMM on CUDA; :mod:`sparsepipe_hpc.engine.spconv_subm`). Engines are plain functions of tensors, without autograd:
serial and distributed autograd functions call them, so the distributed layer can run the local
part while the halo is in flight and the halo part after.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence

import torch

from halo.kmap import KernelMap

__all__ = ["Engine", "Progress"]

Progress = Optional[Callable[[], object]]
"""Called between chunks of work, so a pending exchange can make progress (MPI_Test); once,
after the call, where a kernel takes the whole map at once (implicit GEMM: on a GPU the launch
returns before the work is done)."""


class Engine(ABC):
    name: str = "?"

    def subm_map(self, coords: torch.Tensor, spatial_shape: Sequence[int], batch_size: int,
                 kernel_size: int, dilation: int) -> Optional[Any]:
        """The engine's own index data for a submanifold convolution of ``coords`` onto
        themselves (outputs in the input rows), which :meth:`forward`/:meth:`backward` then take
        in place of a KernelMap of the same pairs; None: the engine has none (the default), use
        :func:`halo.kmap.kernel_map`."""
        return None

    @abstractmethod
    def forward(self, feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap,
                progress: Progress = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out[o] += sum over pairs (i, o, k) of weight[:, k] @ feats[i]; [kmap.n_out, C_out].

        ``out``: accumulate into this tensor (returned) instead of a new zero one.
        """

    @abstractmethod
    def backward(self, feats: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                 kmap: KernelMap, progress: Progress = None, need_input_grad: bool = True,
                 grad_in: Optional[torch.Tensor] = None
                 ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Gradients of the forward: (grad_feats [n_in, C_in] or None, grad_weight like weight).

        ``grad_in``: accumulate the input gradient into this tensor (returned).
        """
