"""Point-wise and reducing layers on SparseTensors: BatchNorm, ReLU, Linear, global pooling.

    y = BatchNorm(32)(x)          # statistics over every voxel of the batch, on every rank
    z = ReLU()(y)
    logits = Linear(32, 10)(GlobalPool("avg")(z))   # GlobalPool -> dense [batch, C]

Under a ParallelContext, BatchNorm reduces over its ``stats_group`` (spatial ranks and replicas) and
GlobalPool over its ``spatial_group``, so the result does not depend on where the cuts fall.
"""

from __future__ import annotations

from typing import Optional, cast

import torch
from torch import nn

from sparsepipe_hpc.nn.functional import batch_norm, global_pool, update_running_stats
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["BatchNorm", "set_deferred_batchnorm", "commit_batchnorm", "ReLU", "Linear",
           "GlobalPool"]


class BatchNorm(nn.BatchNorm1d):
    """BatchNorm over voxels, synchronized over the tensor's context (torch.nn.BatchNorm1d state).

    Always affine, with running statistics updated by ``momentum`` (the synchronized form has no
    other modes, so the constructor offers none).

    Under micro-batching (a pipeline), training-mode forward always normalizes each micro-batch
    by its own statistics (GPipe's semantics). ``deferred`` picks what the running statistics
    see (torchgpipe's DeferredBatchNorm):

    * ``False`` (the default): one momentum update per forward, i.e. per micro-batch. This is
      what the plain run over the same micro-batches does, so the pipelined run stays exactly
      equal to the single-process run with the same ``--micro-batches``, and a layer used outside
      a pipeline needs no extra call.
    * ``True``: forwards only accumulate ``[sum x, sum x^2, count]`` (float64, reduced over the
      group); :meth:`commit` folds them into the running statistics once per mini-batch: one
      update from every voxel the layer saw, as one layer over the whole mini-batch would make
      (to float rounding). For a BatchNorm whose input does not depend on another BatchNorm (the
      stem's) that is exactly the unpipelined run's; deeper ones see inputs normalized per
      micro-batch, so they approach the unpipelined run's as closely as those inputs do. Whoever
      runs the micro-batches calls :func:`commit_batchnorm` after the last one (Pipeline.run
      does); until then the running statistics are those of the previous mini-batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 deferred: bool = False):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0 <= momentum <= 1:
            raise ValueError(f"BatchNorm momentum must be a number in [0, 1]; got {momentum!r} "
                             f"(torch's momentum=None, a cumulative average, is not supported)")
        super().__init__(num_features, eps, momentum)
        self.deferred = deferred
        self._pending: Optional[torch.Tensor] = None  # deferred sums since the last commit

    def forward(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        comm = x.context.stats_group if x.context is not None else None
        pending = None
        if self.training and self.deferred:
            if self._pending is None:
                self._pending = torch.zeros(2 * self.num_features + 1, dtype=torch.float64,
                                            device=x.feats.device)
            pending = self._pending
        feats = batch_norm(x.feats, self.weight, self.bias, cast(torch.Tensor, self.running_mean),
                           cast(torch.Tensor, self.running_var), self.training,
                           cast(float, self.momentum), self.eps, comm, stats_out=pending)
        if self.training and pending is None:
            cast(torch.Tensor, self.num_batches_tracked).add_(1)
        return x.replace(feats=feats)

    def commit(self) -> bool:
        """Fold the statistics deferred since the last commit into the running statistics (one
        momentum update, one tracked batch); False when there were none."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        update_running_stats(pending, cast(torch.Tensor, self.running_mean),
                             cast(torch.Tensor, self.running_var), cast(float, self.momentum))
        cast(torch.Tensor, self.num_batches_tracked).add_(1)
        return True

    def extra_repr(self) -> str:
        return super().extra_repr() + (", deferred=True" if self.deferred else "")


def set_deferred_batchnorm(module: nn.Module, deferred: bool) -> int:
    """Switch every :class:`BatchNorm` under ``module`` to deferred running statistics (or back);
    returns how many there are. Statistics still pending are dropped when switching off."""
    count = 0
    for m in module.modules():
        if isinstance(m, BatchNorm):
            m.deferred = deferred
            if not deferred:
                m._pending = None
            count += 1
    return count


def commit_batchnorm(module: nn.Module) -> int:
    """:meth:`BatchNorm.commit` on every BatchNorm under ``module`` (call once per mini-batch,
    after its micro-batches' forwards); returns how many had statistics to fold in."""
    return sum(m.commit() for m in module.modules() if isinstance(m, BatchNorm))


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
        comm = x.context.spatial_group if x.context is not None else None
        return global_pool(x.feats, x.coords, x.batch_size, self.mode, comm)
