"""The trainer's side of checkpoints: what a checkpoint of a run holds, and putting it back.

    state = TrainState(model, optimizer, scheduler, batches, precision)
    stage_optimizers = sync_stages(model, optimizer, pipe, ctx, comm)   # collective; pipelined
    rng = comm.gather(rng_state(device=device), root=0)
    digest = write_checkpoint(out / "last.pt", state, rng=rng, ...)     # rank 0
    ...
    at = load_state(out / "last.pt", state, cfg=cfg, ...)               # a resumed run
    step, epoch = at.step, at.epoch

Files, manifests and RNG states are :mod:`sparsepipe_hpc.train.checkpoint`'s; this module knows
the trainer's pieces. Model, optimizer moments, scheduler position, data position, every rank's
RNG state and (fp16) the loss scale come from the checkpoint; the learning-rate schedule itself
comes from the current options (:func:`sparsepipe_hpc.train.lr_schedule.restore_schedule`).

Pipelined (2+ stages): before a checkpoint every stage's weights are broadcast to all ranks and
each stage's optimizer state gathered (:func:`sync_stages`), so rank 0 writes the whole model
(``optimizer_stages`` holds one state per stage); a resume needs the same --stages and --balance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from halo.transport.collectives import bcast_
from sparsepipe_hpc.data import ShardedBatches
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.pipeline.runner import Pipeline
from sparsepipe_hpc.train import checkpoint as ckpt_io
from sparsepipe_hpc.train.config import TrainConfig
from sparsepipe_hpc.train.device import Precision
from sparsepipe_hpc.train.lr_schedule import restore_schedule

__all__ = ["TrainState", "Resumed", "layout_record", "sync_stages", "write_checkpoint",
           "load_state", "grid_record"]


@dataclass
class TrainState:
    """The trainer's objects whose state a checkpoint holds (besides step, epoch and RNG)."""

    model: Any  # a BlockSequence (sparsepipe_hpc.nn.models)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batches: ShardedBatches
    precision: Precision


@dataclass
class Resumed:
    """Where :func:`load_state` left the run: the step and epoch to continue from, and the
    digest of ``<out>/last.pt`` when that is the file loaded and its manifest records it."""

    step: int
    epoch: int
    on_disk: Optional[ckpt_io.FileDigest]


def layout_record(layout: RankLayout) -> dict[str, Any]:
    """The layout as a checkpoint (and its manifest) records it."""
    return {"replicas": layout.replicas, "stages": layout.stages, "grid": list(layout.grid),
            "world_size": layout.size}


def sync_stages(model: Any, optimizer: torch.optim.Optimizer, pipe: Optional[Pipeline],
                ctx: ParallelContext, comm: Any) -> Optional[list[Any]]:
    """Pipelined (2+ stages): every rank gets every stage's trained weights and buffers
    (broadcast from the stage's first rank), and rank 0 each stage's optimizer state, so
    rank 0's checkpoint holds the whole model. **Collective.** Returns the per-stage optimizer
    states on rank 0; None elsewhere and without stages."""
    layout = ctx.layout
    if pipe is None or layout.stages == 1:
        return None
    for s, plan in enumerate(pipe.plan.stages):
        a, b = plan.blocks
        blocks = model.blocks[a:b]
        for t in list(blocks.parameters()) + list(blocks.buffers()):
            bcast_(t, comm, root=layout.rank_of(0, s, 0))  # device tensors through the host
    pos = ctx.position
    # On the host: rank 0 need not hold every stage's state on its GPU, nor see another
    # rank's device index (each rank may see only its own GPU).
    mine = _on_host(optimizer.state_dict()) if pos.replica == 0 and pos.spatial == 0 else None
    got = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    return [got[layout.rank_of(0, s, 0)] for s in range(layout.stages)]


def _on_host(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def write_checkpoint(path: Path, state: TrainState, *, rng: list[Any],
                     stage_optimizers: Optional[list[Any]], step: int, epoch: int,
                     total_steps: int, config: dict[str, Any], layout: RankLayout,
                     versions: dict[str, str], data: dict[str, Any], grid: dict[str, Any],
                     on_disk: Optional[ckpt_io.FileDigest]) -> ckpt_io.FileDigest:
    """Rank 0: write the checkpoint of ``state`` at ``step`` to ``path`` with its manifest
    (:func:`sparsepipe_hpc.train.checkpoint.save_checkpoint`; ``on_disk``: the digest of the
    file now at ``path`` when known). ``rng``: every rank's RNG state, in rank order;
    ``config``: ``TrainConfig.to_dict()``; ``data``: the training split's
    :func:`~sparsepipe_hpc.train.agreement.data_fingerprint`; ``grid``: the voxel grid
    (:func:`grid_record`). Returns the new file's digest."""
    record = layout_record(layout)
    saved = {
        "format": ckpt_io.FORMAT, "version": ckpt_io.VERSION, "step": step, "epoch": epoch,
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(), "loader": state.batches.state_dict(),
        "rng": rng, "config": config, "layout": record, "versions": versions, "data": data,
        "grid": grid}
    if stage_optimizers is not None:
        saved["optimizer_stages"] = stage_optimizers
    if state.precision.scaler is not None:  # fp16: the loss scale continues
        saved["scaler"] = state.precision.state_dict()
    return ckpt_io.save_checkpoint(saved, path,
        {"step": step, "epoch": epoch, "total_steps": total_steps,
         "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
         "layout": record, "versions": versions}, on_disk=on_disk)


def _meant_balance(config: dict[str, Any], blocks: int) -> dict[str, Any]:
    """``config`` with its ``balance`` as the blocks per stage it means (none given: the even
    split), so that ``--balance 3,3`` and no ``--balance`` over 6 blocks compare equal."""
    from sparsepipe_hpc.pipeline.runner import even_balance

    stages, balance = int(config.get("stages") or 1), config.get("balance")
    try:
        counts = (even_balance(blocks, stages) if balance is None
                  else tuple(int(v) for v in str(balance).split(",")))
    except ValueError:  # not this run's to judge: compared as written
        return config
    return {**config, "balance": ",".join(map(str, counts))}


def grid_record(origin: Sequence[float], shape: Sequence[int]) -> dict[str, Any]:
    """The voxel grid as a checkpoint records it: origin (m) and spatial shape (voxels)."""
    return {"origin": [float(v) for v in origin], "shape": [int(v) for v in shape]}


def load_state(path: Path, state: TrainState, *, cfg: TrainConfig, out: Path, comm: Any,
               layout: RankLayout, stage: Optional[int], device: torch.device,
               data: dict[str, Any], grid: dict[str, Any],
               say: Callable[[str], None]) -> Resumed:
    """Load the checkpoint at ``path`` into ``state`` and this rank's RNG; ``stage``: this rank's
    pipeline stage (None unpipelined). Raises CheckpointError when the file is missing, corrupt
    or does not fit this run (another model, another number of stages, other training data than
    ``data``, the training split's fingerprint, or another voxel grid than ``grid``, where the
    checkpoint records them); ``say``: the notes (no manifest, another schedule, another
    layout). Run under :func:`agree`."""
    ckpt = ckpt_io.load_checkpoint(path)
    blocks = len(state.model.blocks)
    ckpt_io.check_compatible({**ckpt, "config": _meant_balance(ckpt.get("config", {}), blocks)},
                             _meant_balance(cfg.to_dict(), blocks), path)
    saved_data = ckpt.get("data") or {}  # (checkpoints before this record carry none)
    # A field either side lacks (an older checkpoint's record, a digest of unchecked values)
    # decides nothing.
    differ = sorted(k for k in saved_data if saved_data[k] is not None
                    and data.get(k) is not None and saved_data[k] != data[k])
    if differ:
        diff = "; ".join(f"{k} {saved_data[k]!r} -> {data[k]!r}" for k in differ)
        raise ckpt_io.CheckpointError(
            f"--resume {path}: the checkpoint was written for other training data ({diff}); "
            f"a resume continues the same run: pass its --data, or start a new run without "
            f"--resume")
    saved_grid = ckpt.get("grid")
    if saved_grid is not None and saved_grid != grid:
        raise ckpt_io.CheckpointError(
            f"--resume {path}: the checkpoint was trained on another voxel grid (origin "
            f"{saved_grid['origin']} m, shape {saved_grid['shape']} -> origin {grid['origin']} "
            f"m, shape {grid['shape']}): the grid spans the training and validation splits, so "
            f"the validation data differ from the run's; which voxels merge down the network, "
            f"and the augmentation, would change. Pass the run's --data, or start a new run")
    on_disk: Optional[ckpt_io.FileDigest] = None
    if ckpt.get("manifest") is None:
        say(f"note: {path} has no manifest ({ckpt_io.manifest_path(path).name}): "
            "loading it without checksum verification")
    elif Path(path).resolve() == (out / ckpt_io.LAST).resolve():
        on_disk = ckpt_io.entry_digest(ckpt["manifest"], ckpt_io.LAST)
    try:
        state.model.load_state_dict(ckpt["model"])
        if stage is not None and layout.stages > 1:
            per_stage = ckpt.get("optimizer_stages")
            if not per_stage or len(per_stage) != layout.stages:
                raise ckpt_io.CheckpointError(
                    f"--resume {path}: this run has {layout.stages} pipeline stages but "
                    f"the checkpoint holds optimizer states for "
                    f"{len(per_stage) if per_stage else 1}; resume with its --stages")
            state.optimizer.load_state_dict(per_stage[stage])
        else:
            state.optimizer.load_state_dict(ckpt["optimizer"])
        note = _take_weight_decay(state.optimizer, cfg.weight_decay)
        if note is not None:
            say(note)
        state.batches.load_state_dict(ckpt["loader"])
        step = int(ckpt["step"])
        note = restore_schedule(state.scheduler, ckpt["scheduler"], lr=cfg.lr, step=step)
        if note is not None:
            say(note)
        epoch = int(ckpt.get("epoch", 0))
        states = ckpt["rng"]
        # Same world size: each rank continues its own random streams (bitwise resume).
        # Otherwise rank 0's: the data order and augmentation do not depend on them anyway.
        same = len(states) == comm.Get_size()
        mine = states[comm.Get_rank()] if same else states[0]
        ckpt_io.set_rng_state(mine, device=device)
        state.precision.load_state_dict(ckpt.get("scaler"))
        saved_precision = ckpt.get("config", {}).get("precision", "fp32")
        if saved_precision != cfg.precision:
            why = ("its loss scale starts afresh" if cfg.precision == "fp16" else
                   "the checkpoint's loss scale is dropped" if saved_precision == "fp16" else
                   "the weights go on in float32 as before")
            say(f"note: the checkpoint's run trained in {saved_precision}, this one in "
                f"{cfg.precision}: {why}")
        saved_augment = ckpt.get("config", {}).get("augment", cfg.augment)
        if saved_augment != cfg.augment:
            say(f"note: the checkpoint's run trained {'with' if saved_augment else 'without'} "
                f"augmentation, this one {'with' if cfg.augment else 'without'} "
                "(--augment/--no-augment): from here its samples differ")
    except ckpt_io.CheckpointError:
        raise
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise ckpt_io.CheckpointError(f"--resume {path}: does not fit this run "
                                      f"({type(e).__name__}: {e})") from None
    saved = ckpt.get("layout", {})
    if (saved.get("world_size") not in (None, layout.size)
            or saved.get("grid") not in (None, list(layout.grid))):
        say(f"note: resuming a checkpoint written by {saved.get('replicas')} replica(s) "
            f"x grid {saved.get('grid')} under {layout}: the loss continues to "
            "float rounding, not bitwise")
    return Resumed(step, epoch, on_disk)


def _take_weight_decay(optimizer: torch.optim.Optimizer, weight_decay: float) -> Optional[str]:
    """The current ``--weight-decay`` over the checkpoint's, which ``load_state_dict`` restored
    with the rest of the optimizer's settings; a note where the two differ, else None."""
    old = sorted({float(g["weight_decay"]) for g in optimizer.param_groups})
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay
    if old == [weight_decay]:
        return None
    return (f"weight decay from the current options: {weight_decay:g}; the checkpoint's run "
            f"used {', '.join(f'{w:g}' for w in old)}")
