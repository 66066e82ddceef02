"""One training step on one rank, plain or pipelined: forward, loss share, backward, update.

    share, voxels = plain_step(forward, batch, ctx=ctx, seg=True, batch_size=16, model=model,
                               optimizer=opt, reducer=None, precision=Precision("fp32", cpu))
    share, voxels = pipeline_step(pipe, ctx, batch, seg=True, stride=8, batch_size=16,
                                  optimizer=opt, reducer=None, params=list(pipe.parameters()),
                                  precision=Precision("fp16", cpu, comm))
    got = pipeline_logits(eval_pipe, ctx, val_batch, seg=True, stride=8)  # None off the last stage

The loss convention (:mod:`sparsepipe_hpc.parallel.context`), for the replica's batch::

    x, y      ctx.distribute(batch.x, labels, align=total_stride) -> this rank's voxels
    share     seg: sum CE over my voxels / voxels of the global batch
              cls: sum CE over the replica's samples / (global batch * spatial ranks)
    backward, all-reduce of the gradients (sum over every rank of the stage), optimizer step

Shares sum to the single-process mean loss of the global batch and summed gradients equal its
gradient, so any layout trains the same model as one process (up to float rounding). The caller
steps the learning-rate scheduler and all-reduces the shares for its report.

Pipelined (``--stages``, ``--micro-batches``): each rank runs its stage's blocks
(:class:`~sparsepipe_hpc.pipeline.runner.Pipeline`) on M whole-sample micro-batches of its
replica's batch, its shard of each global micro-batch (:mod:`sparsepipe_hpc.data.sharding`: the
replicas' micro-batches ``i`` together are one process's micro-batch ``i``); the last stage holds
the loss shares, stage 0 counts the voxels, each stage all-reduces and steps its own parameters.
BatchNorm normalizes per micro-batch (GPipe's semantics: the run equals one process with the same
``--micro-batches``); its running statistics take one update per micro-batch, or with
``--deferred-bn`` one per mini-batch from all its micro-batches
(:class:`sparsepipe_hpc.nn.layers.BatchNorm`). Evaluation runs the stages forward, one
micro-batch per batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from sparsepipe_hpc.data.loader import Batch
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.gradients import GradientReducer
from sparsepipe_hpc.data.sharding import local_micro_bounds
from sparsepipe_hpc.pipeline.executor import split_batch
from sparsepipe_hpc.pipeline.runner import Pipeline
from sparsepipe_hpc.train.device import Precision
from sparsepipe_hpc.tracing import span

__all__ = ["plain_step", "pipeline_step", "pipeline_logits"]


def plain_step(forward: Callable[[Any], tuple[torch.Tensor, torch.Tensor, int]], batch: Any, *,
               ctx: ParallelContext, seg: bool, batch_size: int, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, reducer: Optional[GradientReducer],
               precision: Precision) -> tuple[torch.Tensor, int]:
    """One step of the whole model: ``forward(batch)`` -> (logits, labels, my voxels), the loss
    share, backward under ``precision``, the gradient all-reduce (``reducer``'s buckets started
    during backward, or one over ``model``) and ``optimizer`` step. ``batch_size``: the global
    batch (cls loss shares). Returns (my loss share, detached; my voxels)."""
    with span("forward", "forward"):
        logits, labels, n_local = forward(batch)
        ce = F.cross_entropy(logits, labels, reduction="sum")
        if seg:
            share = ce / ctx.global_count(n_local)
        else:  # every spatial rank holds the replica's pooled logits: each carries 1/spatial
            share = ce / (batch_size * ctx.spatial_size)
    optimizer.zero_grad(set_to_none=True)
    if reducer is not None:
        reducer.arm()  # buckets start their all-reduce from inside this backward
    with span("backward", "backward"):
        precision.backward(share)  # scaled for fp16
    with span("allreduce", "allreduce"):
        if reducer is not None:
            reducer.finish()
        else:
            ctx.allreduce_gradients(model)
    with span("optimizer", "optimizer"):
        precision.step(optimizer)  # fp16: unscale the summed gradients, maybe skip
    return share.detach(), n_local


def pipeline_step(pipe: Pipeline, ctx: ParallelContext, batch: Batch, *, seg: bool, stride: int,
                  batch_size: int, optimizer: torch.optim.Optimizer,
                  reducer: Optional[GradientReducer], params: Sequence[torch.nn.Parameter],
                  precision: Precision) -> tuple[torch.Tensor, int]:
    """One pipelined step: micro-batches of whole samples through this rank's stage, then the
    stage's gradient all-reduce (``reducer``'s buckets, or one over ``params``) and ``optimizer``
    step. ``batch``: the replica's batch; ``batch_size``: the global batch (cls loss shares).
    ``precision``: the stages' autocast is the Pipeline's; here fp16's loss scale seeds the last
    stage's backward and every stage unscales, skipping the step together when any gradient
    anywhere is inf/NaN (``Precision`` made with the world communicator).

    Returns (my loss share: the sum over micro-batches on the last stage, 0 elsewhere; my
    input voxels on stage 0, 0 elsewhere), so the world all-reduce counts each once. Inputs
    (first stage) and targets (last stage) move to the pipeline's device.
    """
    m = pipe.micro_batches
    # This replica's shard of each global micro-batch (as ShardedBatches(micro_batches=m) cut it).
    bounds = local_micro_bounds(batch_size, ctx.num_replicas, ctx.replica, m)
    if bounds[-1][1] != batch.x.batch_size:
        raise ValueError(f"pipeline_step: the batch holds {batch.x.batch_size} samples but "
                         f"replica {ctx.replica} of {ctx.num_replicas} holds {bounds[-1][1]} of "
                         f"a global batch of {batch_size} in {m} micro-batches; pass its "
                         f"ShardedBatches(micro_batches={m}) shard")
    parts = split_batch(batch.x, m, *([batch.labels] if seg else []), bounds=bounds)
    inputs, contexts, targets, n_local = [], [], [], 0
    y: Any
    with span("distribute", "input"):
        for part, (lo, hi) in zip(parts, bounds):
            if seg:
                x, y = ctx.distribute(part[0], part[1], align=stride)
            else:
                (x,) = ctx.distribute(part[0], align=stride)
                y = batch.labels[lo:hi]
            inputs.append(x.to(pipe.device, non_blocking=True) if pipe.is_first else x)
            contexts.append(x.context)
            targets.append(y.to(pipe.device, non_blocking=True) if pipe.is_last else y)
            n_local += x.num_voxels
    # seg: voxels of the global batch (every stage holds them all); cls: as in plain_step.
    denom = ctx.global_count(n_local) if seg else batch_size * ctx.spatial_size

    def loss_fn(i: int, out: Any) -> torch.Tensor:
        logits = out.feats if seg else out  # bf16 under --precision bf16: the loss in float32
        return F.cross_entropy(logits.float(), targets[i], reduction="sum") / denom

    def step() -> None:
        with span("allreduce", "allreduce"):
            if reducer is not None:
                reducer.finish()  # armed before the last micro-batch's backward
            else:
                ctx.allreduce_gradients(params)
        with span("optimizer", "optimizer"):
            precision.step(optimizer)  # fp16: unscale the summed gradients, maybe skip

    optimizer.zero_grad(set_to_none=True)
    shares = pipe.run(inputs, contexts, loss_fn, step,
                      last_backward=reducer.arm if reducer is not None else None,
                      scale_loss=precision.scale_loss)
    share = torch.stack(shares).sum() if shares else torch.zeros((), device=pipe.device)
    return share, n_local if pipe.is_first else 0


def pipeline_logits(pipe: Pipeline, ctx: ParallelContext, batch: Batch, *, seg: bool,
                    stride: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels) of a validation batch run forward through the stages as one
    micro-batch: on the last stage, None elsewhere. Logits [n_local, K] (seg) or
    [B_replica, K] (cls)."""
    labels: Any
    if seg:
        x, labels = ctx.distribute(batch.x, batch.labels, align=stride)
    else:
        (x,) = ctx.distribute(batch.x, align=stride)
        labels = batch.labels
    if pipe.is_first:
        x = x.to(pipe.device, non_blocking=True)
    out = pipe.run([x], [x.context], lambda i, o: (o.feats if seg else o).float(),
                   backward=False)
    return (out[0], labels.to(pipe.device, non_blocking=True)) if out else None
