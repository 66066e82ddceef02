"""Autograd functions of the single-process layers: sparse convolution, BatchNorm, pooling.

Each function takes an optional communicator so that the same arithmetic serves the serial run and
the distributed one (statistics all-reduced over the ranks that share them). Reductions over ranks
combine in float64, so the result does not depend on how voxels are split between ranks beyond
float rounding.

Loss convention used throughout (see sparsepipe_hpc.parallel.context): every rank holds a *share*
of the loss and the true loss is the sum of the shares; a value every rank of a group holds a copy
of (a pooled vector) therefore all-reduces its gradient in backward, which is the exact adjoint of
the forward all-reduce.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from halo.kmap import KernelMap, coord_keys
from halo.transport.collectives import allreduce_  # re-exported: its home is the transport layer
from halo.transport.collectives import group_size
from sparsepipe_hpc.engine.base import Engine
from sparsepipe_hpc.nn.amp import LOW_PRECISION, autocast_inputs

__all__ = ["sparse_conv", "batch_norm", "BatchNormError", "update_running_stats", "global_pool",
           "allreduce_"]


class _SparseConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap,
                engine: Engine) -> torch.Tensor:
        ctx.save_for_backward(feats, weight)
        ctx.kmap, ctx.engine = kmap, engine
        return engine.forward(feats, weight, kmap)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        feats, weight = ctx.saved_tensors
        g_in, g_w = ctx.engine.backward(feats, weight, grad_out.contiguous(), ctx.kmap,
                                        need_input_grad=ctx.needs_input_grad[0])
        return g_in, g_w, None, None


def sparse_conv(feats: torch.Tensor, weight: torch.Tensor, kmap: KernelMap | Any,
                engine: Engine) -> torch.Tensor:
    """feats [n_in, C_in], weight [C_out, K, C_in] -> [n_out, C_out] over the pairs of ``kmap``
    (a KernelMap, or the engine's own submanifold map: :meth:`Engine.subm_map`).

    Under ``torch.autocast`` both are cast to its dtype first (see :mod:`sparsepipe_hpc.nn.amp`).
    """
    feats, weight = autocast_inputs(feats, weight)
    return _SparseConv.apply(feats, weight, kmap, engine)


class _SyncBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm with statistics reduced over ``comm``; saves ``x``, not x-hat."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, stats_out):
        stats = _local_stats(x)
        allreduce_(stats, comm)
        c = x.shape[1]
        n = stats[-1]
        # The group has 2 voxels if this rank has: only a rank with fewer reads the group's count
        # back (a device sync on CUDA, once per layer otherwise). Where the group has fewer, every
        # rank has fewer, so all of them read it and raise alike.
        _check_count(len(x) if len(x) >= 2 or group_size(comm) == 1 else float(n))
        mean, var = _moments(stats, c)
        if stats_out is None:
            _fold_running(mean, var, n, running_mean, running_var, momentum)
        else:  # deferred: the caller folds the mini-batch's sums in once (BatchNorm.commit)
            stats_out.add_(stats.to(stats_out.dtype))
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        # Normalizing with given statistics is inference-mode batch_norm: one fused pass.
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps,
                             torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.comm, ctx.n = comm, n
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        c = dy.shape[1]
        dy = dy.contiguous()
        fused = _fused_backward(x)
        if fused:
            g_b, dy_xmu, _, _ = torch.batch_norm_backward_reduce(dy, x, mean, invstd, weight,
                                                                 True, False, False)
        else:
            xmu = x - mean
            g_b = dy.sum(0)
            dy_xmu = (dy * xmu).sum(0)
        g_w = dy_xmu * invstd  # sum of dy * x-hat
        sums = torch.cat([g_b, dy_xmu]).double()  # [sum dy, sum dy * (x - mean)] of the group
        allreduce_(sums, ctx.comm)
        if fused:
            count = ctx.n.to(torch.int32).reshape(1)  # on the device: no sync
            dx = torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight,
                                                 sums[:c].to(dy.dtype), sums[c:].to(dy.dtype),
                                                 count)
            return dx, g_w, g_b, None, None, None, None, None, None
        mean_dy = (sums[:c] / ctx.n).to(dy.dtype)
        mean_dy_xhat = (sums[c:] / ctx.n).to(dy.dtype) * invstd
        scale = weight * invstd
        # dx = (dy - mean(dy) - x-hat * mean(dy * x-hat)) * weight * invstd, in two passes
        dx = torch.addcmul(-mean_dy * scale, dy, scale)
        dx.addcmul_(xmu, -scale * invstd * mean_dy_xhat)
        return dx, g_w, g_b, None, None, None, None, None, None


def _fused_backward(x: torch.Tensor) -> bool:
    """Whether the backward of ``x`` takes torch's SyncBatchNorm kernels (CUDA only): one pass for
    the two sums and one for dx, where the elementwise form takes five passes over ``[N, C]``
    arrays. A rank with no rows takes the elementwise form, which sums the same quantities."""
    return x.is_cuda and len(x) > 0


def _local_stats(x: torch.Tensor) -> torch.Tensor:
    """float64 [2C + 1]: ``[sum x, sum x^2, count]`` of this rank's rows ``x [N, C]``, from one
    Welford pass over ``x`` (no float64 copy of it); exact sums combine across ranks."""
    n = len(x)
    if n == 0:
        return torch.zeros(2 * x.shape[1] + 1, dtype=torch.float64, device=x.device)
    var, mean = torch.var_mean(x, 0, correction=0)
    m = mean.double()
    # The count by a fill kernel, not a host tensor copied over (a device sync on CUDA)
    count = torch.full((1,), float(n), dtype=torch.float64, device=x.device)
    return torch.cat([m * n, (var.double() + m * m) * n, count])


def _moments(stats: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance [C] from ``stats = [sum x (C), sum x^2 (C), count (1)]``."""
    n = stats[-1]
    mean = stats[:c] / n
    return mean, (stats[c:2 * c] / n - mean * mean).clamp_(min=0)


class BatchNormError(ValueError):
    """BatchNorm in training given fewer than 2 voxels over its group (no spread to normalize
    by); raised on every rank of the group alike, since the count is the group's."""


def _check_count(n: float) -> None:
    if n < 2:
        raise BatchNormError(f"BatchNorm in training needs at least 2 voxels over its group to "
                             f"take batch statistics; got {int(n)} (the batch is that small at "
                             f"this layer's resolution)")


def update_running_stats(stats: torch.Tensor, running_mean: torch.Tensor,
                         running_var: torch.Tensor, momentum: float,
                         checked: bool = False) -> None:
    """Fold one batch's ``stats = [sum x (C), sum x^2 (C), count (1)]`` (float64, already
    reduced over the group) into the running statistics, as torch's BatchNorm does: momentum
    average of the mean and of the unbiased variance. ``checked``: the caller has made sure the
    count is at least 2 (else it is read from ``stats``: a device sync on CUDA)."""
    c = running_mean.shape[0]
    n = stats[-1]
    if not checked:
        _check_count(float(n))
    mean, var = _moments(stats, c)
    _fold_running(mean, var, n, running_mean, running_var, momentum)


def _fold_running(mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor,
                  running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float) -> None:
    """Momentum-average one batch's mean and biased variance [C] over ``n`` voxels into the
    running statistics (the variance unbiased first), as torch's BatchNorm does."""
    with torch.no_grad():
        running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
        running_var.mul_(1 - momentum).add_(momentum * (var * n / (n - 1)).to(running_var.dtype))


def batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               running_mean: torch.Tensor, running_var: torch.Tensor, training: bool,
               momentum: float, eps: float, comm: Any = None,
               stats_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BatchNorm over the rows of ``x [N, C]``, statistics all-reduced over ``comm``.

    Returns ``x``'s dtype; in mixed precision it normalizes in float32. ``stats_out`` (float64
    [2C + 1]): in training mode, add this batch's reduced statistics ``[sum x, sum x^2, count]``
    to it instead of updating the running statistics (deferred BatchNorm;
    :func:`update_running_stats` folds the sum in later).

    Training statistics combine each rank's Welford mean and variance (one pass over ``x``) in
    float64 (:class:`_SyncBatchNorm`). One rank on a GPU takes torch's fused kernel instead (cuDNN),
    as a plain network's ``BatchNorm1d`` does; torch's CPU kernel is not used for training: it
    loses accuracy on many voxels (errors of 4e-4 at 500k, docs/gpu.md).
    """
    if not training or (x.is_cuda and stats_out is None and group_size(comm) == 1):
        if training:
            _check_count(len(x))
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        return y.to(x.dtype)  # autocast may run batch_norm in float32
    if x.dtype in LOW_PRECISION:
        y = _SyncBatchNorm.apply(x.float(), weight.float(), bias.float(), running_mean,
                                 running_var, momentum, eps, comm, stats_out)
        return y.to(x.dtype)
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, comm,
                                stats_out)


class _GlobalPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feats, coords, batch_size, mode, comm):
        b = coords[:, 0].long()
        c = feats.shape[1]
        if mode == "avg":
            sums = torch.zeros(batch_size, c + 1, dtype=torch.float64, device=feats.device)
            sums[:, :c].index_add_(0, b, feats.double())
            sums[:, c].index_add_(0, b, torch.ones(len(b), dtype=torch.float64,
                                                   device=feats.device))
            allreduce_(sums, comm)
            counts = sums[:, c:].clamp(min=1)
            ctx.save_for_backward(b, counts)
            ctx.mode, ctx.comm = mode, comm
            return (sums[:, :c] / counts).to(feats.dtype)
        # max: ties go to the voxel with the smallest global coordinate key, on whichever rank.
        out = torch.full((batch_size, c), -torch.inf, dtype=feats.dtype, device=feats.device)
        out.scatter_reduce_(0, b[:, None].expand(-1, c), feats, "amax")
        allreduce_(out, comm, "max")
        out.masked_fill_(out == -torch.inf, 0)  # a sample with no voxels pools to 0, as avg's
        keys = coord_keys(coords)
        big = torch.iinfo(torch.int64).max
        at_max = feats == out[b]
        cand = torch.where(at_max, keys[:, None].expand(-1, c),
                           torch.full_like(at_max, big, dtype=torch.int64))
        win = torch.full((batch_size, c), big, dtype=torch.int64, device=feats.device)
        win.scatter_reduce_(0, b[:, None].expand(-1, c), cand, "amin")
        allreduce_(win, comm, "min")
        mine = at_max & (cand == win[b])
        ctx.save_for_backward(b, mine)
        ctx.mode, ctx.comm = mode, comm
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = allreduce_(grad.contiguous().clone(), ctx.comm)
        if ctx.mode == "avg":
            b, counts = ctx.saved_tensors
            return (grad.double() / counts)[b].to(grad.dtype), None, None, None, None
        b, mine = ctx.saved_tensors
        return grad[b] * mine, None, None, None, None


def global_pool(feats: torch.Tensor, coords: torch.Tensor, batch_size: int, mode: str = "avg",
                comm: Any = None) -> torch.Tensor:
    """Per-sample average or max over voxels: feats [N, C] -> [batch_size, C].

    With ``comm`` (the spatial group) the result covers every rank's voxels and every rank holds a
    copy; backward all-reduces the incoming gradient (the adjoint of that copy).
    """
    if mode not in ("avg", "max"):
        raise ValueError(f"pooling mode must be 'avg' or 'max'; got {mode!r}")
    return _GlobalPool.apply(feats, coords, batch_size, mode, comm)
