"""Validation metrics of the trainer: every sample counted once, whatever the layout.

    rec = evaluate(model, ctx, comm, logits_of, samples=len(val_set), batch_size=16,
                   num_classes=13, seg=True, pipelined=False, step=100, epoch=3)
    print(eval_text(rec, seg=True))   # eval step 100: oa 0.8123 miou 0.5012

``logits_of(indices)`` returns this rank's (logits, labels) of those validation samples, or None
(a pipeline stage other than the last). Each replica reads its share of the split in order; the
confusion matrices are summed over the ranks that counted, so the record equals one process's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from halo.transport.collectives import allreduce_
from sparsepipe_hpc.data import ShardedBatches
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.train.metrics import ConfusionMatrix

__all__ = ["evaluate", "eval_text"]

LogitsOf = Callable[[Sequence[int]], Optional[tuple[torch.Tensor, torch.Tensor]]]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ctx: ParallelContext, comm: Any, logits_of: LogitsOf, *,
             samples: int, batch_size: int, num_classes: int, seg: bool, pipelined: bool,
             step: int, epoch: int) -> dict[str, Any]:
    """Metrics on the whole validation split of ``samples`` samples, read ``batch_size`` at a
    time (the global batch), as one ``{"kind": "eval", ...}`` record: seg ``oa``, ``miou``,
    ``iou`` (per class), ``voxels``; cls ``acc``, ``macc``, ``iou``. ``pipelined``: only the last
    stage counts, so the matrices are summed over all of ``comm``. **Collective.**

    ``model`` is in eval mode for the pass and back in train mode after it.
    """
    model.eval()
    cm = ConfusionMatrix(num_classes)
    batches = ShardedBatches(samples, batch_size, replicas=ctx.num_replicas, rank=ctx.replica,
                             shuffle=False, drop_last=False)
    for indices in batches:
        if not indices:  # the short last step: this replica has nothing (no collective here)
            continue
        got = logits_of(indices)
        # seg: each voxel lives on one rank. cls: every spatial rank holds the same logits,
        # so only spatial rank 0 of a replica counts them.
        if got is not None and (seg or ctx.position.spatial == 0):
            cm.update(got[0].argmax(1).cpu(), got[1].cpu())
    if pipelined:  # only the last stage counted: sum over every rank
        allreduce_(cm.matrix, comm)
    else:
        cm.allreduce(ctx)
    model.train()
    rec: dict[str, Any] = {"kind": "eval", "step": step, "epoch": epoch, "samples": samples}
    iou = cm.iou()
    if seg:
        rec.update(oa=cm.overall_accuracy(), miou=cm.mean_iou(), iou=iou, voxels=cm.total)
    else:
        rec.update(acc=cm.overall_accuracy(), macc=cm.mean_class_accuracy(), iou=iou)
    return rec


def eval_text(rec: dict[str, Any], seg: bool) -> str:
    """One line for the log from an :func:`evaluate` record."""
    if seg:
        return f"eval step {rec['step']}: oa {rec['oa']:.4f} miou {rec['miou']:.4f}"
    return f"eval step {rec['step']}: acc {rec['acc']:.4f} macc {rec['macc']:.4f}"
