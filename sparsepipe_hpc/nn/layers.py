"""Point-wise and reducing layers on SparseTensors: BatchNorm, ReLU, Linear, global pooling.

    y = BatchNorm(32)(x)          # statistics over every voxel of the batch, on every rank
    z = ReLU()(y)
    logits = Linear(32, 10)(GlobalPool("avg")(z))   # GlobalPool -> dense [batch, C]

Under a ParallelContext, BatchNorm reduces over its ``stats_comm`` (spatial ranks and replicas) and
GlobalPool over its ``spatial_comm``, so the result does not depend on where the cuts fall.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from sparsepipe_hpc.nn.functional import batch_norm, global_pool
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["BatchNorm", "ReLU", "Linear", "GlobalPool"]


class BatchNorm(nn.BatchNorm1d):
    """BatchNorm over voxels, synchronized over the tensor's context (torch.nn.BatchNorm1d state).

    Always affine, with running statistics updated by ``momentum`` (the synchronized form has no
    other modes, so the constructor offers none).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(num_features, eps, momentum)

    def forward(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        comm = x.context.stats_comm if x.context is not None else None
        feats = batch_norm(x.feats, self.weight, self.bias, cast(torch.Tensor, self.running_mean),
                           cast(torch.Tensor, self.running_var), self.training,
                           cast(float, self.momentum), self.eps, comm)
        if self.training:
            cast(torch.Tensor, self.num_batches_tracked).add_(1)
        return x.replace(feats=feats)


class ReLU(nn.Module):
    def forward(self, x: SparseTensor) -> SparseTensor:
        return x.replace(feats=torch.relu(x.feats))


class Linear(nn.Linear):
    """A per-voxel linear layer on a SparseTensor, or a plain one on a dense tensor."""

    def forward(self, x):  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return x.replace(feats=super().forward(x.feats))
        return super().forward(x)


class GlobalPool(nn.Module):
    """Per-sample pooling over all voxels: SparseTensor [N, C] -> dense [batch_size, C]."""

    def __init__(self, mode: str = "avg"):
        super().__init__()
        if mode not in ("avg", "max"):
            raise ValueError(f"GlobalPool mode must be 'avg' or 'max'; got {mode!r}")
        self.mode = mode

    def extra_repr(self) -> str:
        return repr(self.mode)

    def forward(self, x: SparseTensor) -> torch.Tensor:
        comm = x.context.spatial_comm if x.context is not None else None
        return global_pool(x.feats, x.coords, x.batch_size, self.mode, comm)
