"""The training loop: one replica's data shard, loss shares, gradient all-reduce, eval, checkpoints.

    cfg = parse_config(["--task", "seg", "--steps", "100"])
    trainer = Trainer(cfg, MPI.COMM_WORLD)   # collective: every rank builds the same trainer
    result = trainer.run()                   # {"step", "stopped", "train": {...}, "eval": {...}}

One step on one rank (the loss convention of :mod:`sparsepipe_hpc.parallel.context`)::

    indices   this replica's samples of the global batch (ShardedBatches: the same on every
              spatial rank of the replica)
    batch     collate(samples) -> every voxel of the replica's samples
    x, y      ctx.distribute(batch.x, labels, align=total_stride) -> this rank's voxels
    share     seg: sum CE over my voxels / voxels of the global batch
              cls: sum CE over the replica's samples / (global batch * spatial ranks)
    backward, ctx.allreduce_gradients (sum over every rank), optimizer step
    report    allreduce([share, my voxels, stop flag]) -> global loss, voxels, stop agreement

Shares sum to the single-process mean loss of the global batch and summed gradients equal its
gradient, so any layout trains the same model as one process (up to float rounding). Augmentation
is drawn per sample from a generator seeded by ``(seed, epoch, sample index)``, so it too does not
depend on which replica reads the sample, nor on where a resumed run restarted.

Pipeline (``--stages S --balance N,... --micro-batches M --pipeline-schedule 1f1b``): each rank
runs its stage's blocks (sparsepipe_hpc.pipeline.runner.Pipeline) on M whole-sample micro-batches
of its replica's batch; the last stage holds the loss shares, stage 0 counts the voxels, each
stage all-reduces and steps its own parameters. BatchNorm normalizes per micro-batch (GPipe's
semantics: the run equals one process with the same ``--micro-batches``); its running
statistics take one update per micro-batch, or with ``--deferred-bn`` one per mini-batch from all
its micro-batches (sparsepipe_hpc.nn.layers.BatchNorm). Evaluation runs the
stages forward, one micro-batch per batch. Before a checkpoint every stage's weights are
broadcast to all ranks and each stage's optimizer state gathered, so rank 0 writes the whole model
(``optimizer_stages`` holds one state per stage); a resume needs the same --stages and --balance.

Trace (``--trace FILE``): every rank records the wall-clock spans of its training steps
(sparsepipe_hpc.tracing: pipeline actions, forward/backward, halo waits, gradient all-reduce,
optimizer), rank 0 gathers them at the end and writes one Chrome/Perfetto JSON, a row per rank;
``--plot FILE.png`` draws the same timeline with matplotlib (sparsepipe_hpc.plot).

Resume: model, optimizer moments, data position and RNG states come from the checkpoint; the
learning-rate schedule does not. It is a pure function of (step, total steps) with the current
``--lr``, ``--schedule`` and ``--warmup`` (:class:`LrSchedule`), rebuilt at every start: the same
options continue the uninterrupted run bitwise, and a larger ``--steps`` continues on the cosine of
the new total (the rate at the resumed step jumps to that curve; the banner says so), instead of
running the extra steps at the old schedule's final rate of 0.

Checked before step 1, on every rank together (:func:`agree`): the data files, that the splits
agree (:func:`sparsepipe_hpc.data.check_splits`), the grid's size, the checkpoint and its
manifest, and that ``--out`` is writable with room for a checkpoint. Rank 0 alone writes the run
directory; a write that fails later reaches every rank too: checkpoints through :func:`agree`,
``metrics.jsonl`` through a flag in the per-step all-reduce.
"""

from __future__ import annotations

import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sparsepipe_hpc.data import (ModelNetDataset, SceneDataset, ShardedBatches, check_splits,
                                 collate, default_data, grid_for)
from sparsepipe_hpc.nn import build_model
from halo.transport.collectives import allreduce_
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.pipeline.executor import sample_bounds, split_batch
from sparsepipe_hpc.pipeline.runner import Pipeline
from sparsepipe_hpc.train import checkpoint as ckpt_io
from sparsepipe_hpc.train.agreement import (SetupError, agree, check_grid_fits, check_same,
                                            data_fingerprint)
from sparsepipe_hpc.parallel.input import LocalBatch, read_distributed
from sparsepipe_hpc.train.config import (TrainConfig, distributed_input, local_batch_size,
                                         resolve_layout)
from sparsepipe_hpc.train.device import Precision, move_tensor, trainer_device
from sparsepipe_hpc.train.transport import halo_transport, trainer_transport
from sparsepipe_hpc.train.metrics import ConfusionMatrix, MetricsLog, format_summary
from sparsepipe_hpc.train.output import OutputError, atomic_write, check_out_dir, format_bytes
from sparsepipe_hpc.tracing import Recorder, gather_chrome_trace, recording, span

__all__ = ["Trainer", "SetupError", "LrSchedule"]


class LrSchedule:
    """Learning-rate factor per step: linear warm-up, then cosine to 0 at ``total_steps``, or
    constant. A pure function of the step and the options: a resumed run rebuilds it from its own
    options (see the module docstring); its fields ride along in ``LambdaLR.state_dict`` only to
    say, on resume, what the checkpoint's run had planned."""

    def __init__(self, kind: str, total_steps: int, warmup: int = 0):
        self.kind, self.total, self.warmup = kind, max(1, total_steps), warmup

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * t))


def _versions(comm: Any) -> dict[str, str]:
    import mpi4py
    from mpi4py import MPI

    import sparsepipe_hpc

    try:
        import spconv
        spconv_version = getattr(spconv, "__version__", "?")
    except ImportError:  # pragma: no cover - spconv is a dependency
        spconv_version = "missing"
    return {"sparsepipe_hpc": sparsepipe_hpc.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "spconv": spconv_version,
            "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "world_size": str(comm.Get_size()), "threads_per_rank": str(torch.get_num_threads())}


class Trainer:
    """Everything one rank needs to train; see the module docstring. **Collective** to build.

    ``should_stop``: polled at every step boundary (default: :func:`launch.run.stop_requested`,
    raised by SIGTERM); when it is true on any rank, every rank checkpoints and stops.
    ``log``: where rank 0's messages go (None: quiet).
    """

    def __init__(self, cfg: TrainConfig, comm: Any = None, *,
                 should_stop: Optional[Callable[[], bool]] = None,
                 log: Optional[Callable[[str], None]] = print):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if should_stop is None:
            from launch.run import stop_requested
            should_stop = stop_requested
        self.cfg, self.comm, self.should_stop = cfg, comm, should_stop
        self.layout = resolve_layout(cfg, comm.Get_size())
        self.is_root = comm.Get_rank() == 0
        self._log = log if self.is_root else None
        # --device, --precision (sparsepipe_hpc.train.device): a ConfigError on every rank when
        # CUDA is asked for and absent. --transport (halo.transport.select): likewise when a
        # device transport is asked for without CUDA; it moves the spatial grid's halos.
        self.device, device_note = trainer_device(cfg, comm)
        self.precision = Precision(cfg.precision, self.device)
        self.transport = trainer_transport(cfg, self.device, comm)
        self.ctx = ParallelContext(comm, self.layout, cuts=cfg.cuts, overlap=cfg.overlap,
                                   transport=halo_transport(self.transport, self.device))
        if device_note:
            self._say(f"note: {device_note}")
        self.seg = cfg.task == "seg"

        data_dir = Path(cfg.data) if cfg.data else default_data(cfg.task, comm=comm)
        self.data_dir = data_dir
        self.train_set, self.val_set = agree(comm, lambda: self._open_data(data_dir))
        check_same(comm, "data", {split: data_fingerprint(ds) for split, ds in
                                  (("train", self.train_set), ("val", self.val_set))})
        self.num_classes = self.train_set.num_classes

        # The same seed on every rank; rank 0's initial weights are broadcast regardless.
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        random.seed(cfg.seed)
        self.model = build_model(cfg.model, self.train_set.in_channels, self.num_classes,
                                 width=cfg.width, depth=cfg.depth, engine=cfg.engine)
        self.ctx.broadcast_parameters(self.model)
        self.model.to(self.device)  # before the optimizer is built on its parameters
        self.stride = self.model.total_stride
        # The default margin holds every augmented point (flips, swap, jitter), so training can
        # voxelize with clip=False: a point off the grid is an error, never silently dropped.
        self.origin, self.shape = agree(comm, lambda: grid_for(
            [self.train_set, self.val_set], cfg.voxel_size, multiple=self.stride))
        check_grid_fits(self.layout.grid, self.shape, self.stride, cfg)
        self.distributed_input = distributed_input(cfg)
        # Pipeline (--stages, --micro-batches): this rank trains its stage's blocks only; eval
        # runs the same stages forward, one micro-batch per batch.
        self.pipe: Optional[Pipeline] = None
        self.eval_pipe: Optional[Pipeline] = None
        if cfg.stages > 1 or cfg.micro_batches > 1:
            self.pipe = agree(comm, lambda: Pipeline(self.model, self.ctx, cfg.balance,
                                                     cfg.pipeline_schedule, cfg.micro_batches,
                                                     deferred_bn=cfg.deferred_bn))
            self.eval_pipe = Pipeline(self.model, self.ctx, cfg.balance, "gpipe", 1)

        params = list(self.pipe.parameters() if self.pipe else self.model.parameters())
        self.train_params = params
        # --grad-bucket-mb: bucketed all-reduce started during backward
        # (sparsepipe_hpc.parallel.gradients), or one flat one after it (0).
        self.reducer = (self.ctx.gradient_reducer(params, max(1, int(cfg.grad_bucket_mb * 2**20)))
                        if cfg.grad_bucket_mb > 0 else None)
        if cfg.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.batches = agree(comm, lambda: ShardedBatches(
            len(self.train_set), cfg.batch_size, replicas=self.ctx.num_replicas,
            rank=self.ctx.replica, seed=cfg.seed))
        self.total_steps = cfg.steps if cfg.steps else cfg.epochs * self.batches.steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LrSchedule(cfg.schedule, self.total_steps, cfg.warmup))
        self.step = 0
        self.epoch = 0
        self._on_disk: Optional[ckpt_io.FileDigest] = None  # the checkpoint at <out>/last.pt

        out = cfg.out or f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(comm.bcast(out, root=0))  # one timestamp for all ranks
        # Rank 0 decides whether <out>/last.pt exists, so every rank takes the same branch.
        resume = comm.bcast(ckpt_io.resolve_resume(cfg.resume, self.out) if self.is_root else None)
        self.resumed_from = resume
        if resume is not None:
            agree(comm, lambda: self._load(resume))
        # Rank 0 writes the run directory; a failure there (read-only, full) stops every rank.
        self.metrics: MetricsLog = agree(comm, self._open_outputs)

    # --- setup -----------------------------------------------------------------------------------
    def _open_data(self, path: Path) -> tuple[Any, Any]:
        train: Any
        val: Any
        if not path.is_dir():
            raise SetupError(f"--data {path}: not a directory (seg: holds train.h5 and val.h5; "
                             "cls: ModelNet-layout train*.h5 and test*.h5)")
        if self.seg:
            train, val = SceneDataset(path, "train"), SceneDataset(path, "val")
        else:
            train, val = ModelNetDataset(path, "train"), ModelNetDataset(path, "test")
        check_splits(train, val, "train", "val" if self.seg else "test")
        return train, val

    def _checkpoint_bytes(self) -> int:
        """About how large a checkpoint of this model and optimizer is (weights, buffers, one or
        two moments per parameter, RNG states), plus a MiB of slack."""
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        moments = 2 if self.cfg.optimizer == "adamw" else 1
        return weights + moments * params + self.comm.Get_size() * (64 << 10) + (1 << 20)

    def _open_outputs(self) -> MetricsLog:
        """Rank 0: check ``--out`` (writable, room for a checkpoint), remove temporary files left
        by a killed run, open ``metrics.jsonl`` (cut back to the resumed step), write
        ``config.json``. Other ranks: a disabled log. Run under :func:`agree`."""
        if not self.is_root:
            return MetricsLog(self.out / "metrics.jsonl", enabled=False)
        removed = ckpt_io.remove_stale_temps(self.out)  # first: they may be what fills the disk
        check_out_dir(self.out, self._checkpoint_bytes())
        if removed:
            self._say(f"removed {len(removed)} temporary file(s) left in {self.out} by a run that "
                      f"died while writing ({format_bytes(sum(n for _, n in removed))}): "
                      + ", ".join(p.name for p, _ in removed))
        metrics = MetricsLog(self.out / "metrics.jsonl", enabled=True)
        if self.resumed_from is not None:
            self._say_lost_steps(self.resumed_from, metrics)
            metrics.truncate_after(self.step)
        self._write_config()
        return metrics

    def _load(self, path: Path) -> None:
        ckpt = ckpt_io.load_checkpoint(path)
        ckpt_io.check_compatible(ckpt, self.cfg.to_dict(), path)
        if ckpt.get("manifest") is None:
            self._say(f"note: {path} has no manifest ({ckpt_io.manifest_path(path).name}): "
                      "loading it without checksum verification")
        elif Path(path).resolve() == (self.out / ckpt_io.LAST).resolve():
            self._on_disk = ckpt_io.entry_digest(ckpt["manifest"], ckpt_io.LAST)
        try:
            self.model.load_state_dict(ckpt["model"])
            if self.pipe is not None and self.layout.stages > 1:
                per_stage = ckpt.get("optimizer_stages")
                if not per_stage or len(per_stage) != self.layout.stages:
                    raise ckpt_io.CheckpointError(
                        f"--resume {path}: this run has {self.layout.stages} pipeline stages but "
                        f"the checkpoint holds optimizer states for "
                        f"{len(per_stage) if per_stage else 1}; resume with its --stages")
                self.optimizer.load_state_dict(per_stage[self.pipe.stage])
            else:
                self.optimizer.load_state_dict(ckpt["optimizer"])
            self.batches.load_state_dict(ckpt["loader"])
            self.step = int(ckpt["step"])
            self._restore_schedule(ckpt["scheduler"])
            self.epoch = int(ckpt.get("epoch", 0))
            states = ckpt["rng"]
            # Same world size: each rank continues its own random streams (bitwise resume).
            # Otherwise rank 0's: the data order and augmentation do not depend on them anyway.
            same = len(states) == self.comm.Get_size()
            mine = states[self.comm.Get_rank()] if same else states[0]
            ckpt_io.set_rng_state(mine, device=self.device)
            self.precision.load_state_dict(ckpt.get("scaler"))
        except (KeyError, RuntimeError, TypeError) as e:
            raise ckpt_io.CheckpointError(f"--resume {path}: does not fit this run "
                                          f"({type(e).__name__}: {e})") from None
        saved = ckpt.get("layout", {})
        if (saved.get("world_size") not in (None, self.layout.size)
                or saved.get("grid") not in (None, list(self.layout.grid))):
            self._say(f"note: resuming a checkpoint written by {saved.get('replicas')} replica(s) "
                      f"x grid {saved.get('grid')} under {self.layout}: the loss continues to "
                      "float rounding, not bitwise")

    def _restore_schedule(self, saved: dict[str, Any]) -> None:
        """Take the scheduler's position (step) from the checkpoint and its schedule from the
        current options; set this step's rate exactly as LambdaLR computes it (``base * factor``),
        so that unchanged options continue bitwise."""
        sched, groups = self.scheduler, self.optimizer.param_groups
        old_fn = dict((saved.get("lr_lambdas") or [None])[0] or {})
        old_base = saved.get("base_lrs")
        sched.load_state_dict({**saved, "lr_lambdas": [None] * len(groups),
                               "base_lrs": [self.cfg.lr] * len(groups), "last_epoch": self.step})
        for group, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * fn(self.step)
        sched._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports  # noqa: SLF001
        new_fn = dict(vars(sched.lr_lambdas[0]))
        if old_fn != new_fn or old_base != sched.base_lrs:
            old_lr = old_base[0] if old_base else None
            self._say(f"learning-rate schedule from the current options: {new_fn['kind']} over "
                      f"{new_fn['total']} steps (warm-up {new_fn['warmup']}, peak lr "
                      f"{self.cfg.lr:g}); the checkpoint's run planned {old_fn.get('kind', '?')} "
                      f"over {old_fn.get('total', '?')} steps (warm-up {old_fn.get('warmup', '?')},"
                      f" peak lr {old_lr if old_lr is None else f'{old_lr:g}'}); step "
                      f"{self.step + 1} runs at lr {groups[0]['lr']:.4g}")

    def _say_lost_steps(self, resume: Path, metrics: MetricsLog) -> None:
        """Say which steps the previous run trained after its last checkpoint: it was killed
        before it could save them (Open MPI's mpirun, for one, kills its ranks 0.5 s after its own
        SIGTERM, too soon for them to checkpoint or even print), so they are trained again."""
        reached = metrics.last_train_step()
        if reached is not None and reached > self.step:
            self._say(f"note: the previous run in {self.out} reached step {reached}, but "
                      f"{resume} holds step {self.step}: steps {self.step + 1}-{reached} were "
                      "lost (the run was killed before it could checkpoint them) and are trained "
                      "again")

    def _write_config(self) -> None:
        info = {"options": self.cfg.to_dict(), "out": str(self.out), "data": str(self.data_dir),
                "layout": {"replicas": self.layout.replicas, "stages": self.layout.stages,
                           "grid": list(self.layout.grid), "world_size": self.layout.size,
                           "text": str(self.layout)},
                "grid": {"origin_m": list(self.origin), "spatial_shape": list(self.shape),
                         "voxel_size_m": self.cfg.voxel_size, "total_stride": self.stride},
                "data_sizes": {"train": len(self.train_set), "val": len(self.val_set),
                               "num_classes": self.num_classes,
                               "class_names": list(self.train_set.class_names)},
                "steps": {"total": self.total_steps,
                          "per_epoch": self.batches.steps_per_epoch,
                          "local_batch": local_batch_size(self.cfg, self.layout)},
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "versions": _versions(self.comm)}
        if self.is_root:
            text = (json.dumps(info, indent=1) + "\n").encode()
            atomic_write(self.out / "config.json", lambda f: f.write(text), "run configuration")

    # --- data ------------------------------------------------------------------------------------
    def _batch(self, dataset: Any, indices: Sequence[int], epoch: Optional[int]) -> Any:
        """Voxelize samples; training batches (``epoch`` given) are augmented, each sample from
        its own (seed, epoch, index) generator, so replicas and resumed runs see the same data.

        Whole input: the replica's batch (a :class:`Batch`), cut into boxes by :meth:`_forward`.
        Distributed input (``--input``): this rank's box only (a :class:`LocalBatch`), read as
        its share of every sample's points; the same voxels, bit for bit.
        """
        augment = epoch is not None and self.cfg.augment
        generators = self.batches.sample_generators(indices, epoch) if augment else None
        if self.distributed_input:
            return read_distributed(self.ctx, dataset, indices, self.cfg.voxel_size, self.origin,
                                    self.shape, generators=generators, align=self.stride)
        samples = [dataset[i] for i in indices]
        return collate(samples, self.cfg.voxel_size, self.origin, self.shape, augment=augment,
                       generator=generators, clip=False)

    def _forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(logits, labels, my voxels): logits [n_local, K] (seg) or [B_replica, K] (cls), float32
        (the model runs under ``--precision``'s autocast), on the trainer's device."""
        dev = self.device
        if isinstance(batch, LocalBatch):  # already this rank's box
            x, labels = batch.x, batch.labels
        elif self.seg:
            x, labels = self.ctx.distribute(batch.x, batch.labels, align=self.stride)
        else:
            (x,) = self.ctx.distribute(batch.x, align=self.stride)
            labels = batch.labels
        with self.precision.autocast():
            out = self.model(move_tensor(x, dev))
        logits = out.feats if self.seg else out
        return logits.float(), labels.to(dev, non_blocking=True), x.num_voxels

    # --- one step --------------------------------------------------------------------------------
    def train_step(self, indices: Sequence[int], epoch: int) -> tuple[torch.Tensor, int]:
        """Forward, backward, gradient all-reduce and update; returns (my loss share, my voxels)."""
        self.model.train()
        batch = self._batch(self.train_set, indices, epoch)
        if self.pipe is not None:
            return self._pipeline_step(batch)
        with span("forward", "forward"):
            logits, labels, n_local = self._forward(batch)
            ce = F.cross_entropy(logits, labels, reduction="sum")
            if self.seg:
                share = ce / self.ctx.global_count(n_local)
            else:  # every spatial rank holds the replica's pooled logits: each carries 1/spatial
                share = ce / (self.cfg.batch_size * self.ctx.spatial_size)
        self.optimizer.zero_grad(set_to_none=True)
        if self.reducer is not None:
            self.reducer.arm()  # buckets start their all-reduce from inside this backward
        with span("backward", "backward"):
            self.precision.backward(share)  # scaled for fp16
        with span("allreduce", "allreduce"):
            if self.reducer is not None:
                self.reducer.finish()
            else:
                self.ctx.allreduce_gradients(self.model)
        with span("optimizer", "optimizer"):
            self.precision.step(self.optimizer)  # fp16: unscale the summed gradients, maybe skip
        self.scheduler.step()
        return share.detach(), n_local

    def _pipeline_step(self, batch: Any) -> tuple[torch.Tensor, int]:
        """One pipelined step: micro-batches of whole samples through this rank's stage.

        Returns (my loss share: the sum over micro-batches on the last stage, 0 elsewhere; my
        input voxels on stage 0, 0 elsewhere), so the world all-reduce counts each once.
        """
        pipe, ctx = self.pipe, self.ctx
        assert pipe is not None
        m = pipe.micro_batches
        parts = split_batch(batch.x, m, batch.labels) if self.seg else split_batch(batch.x, m)
        inputs, contexts, targets, n_local = [], [], [], 0
        y: Any
        with span("distribute", "input"):
            for part, (lo, hi) in zip(parts, sample_bounds(batch.x.batch_size, m)):
                if self.seg:
                    x, y = ctx.distribute(part[0], part[1], align=self.stride)
                else:
                    (x,) = ctx.distribute(part[0], align=self.stride)
                    y = batch.labels[lo:hi]
                inputs.append(x)
                contexts.append(x.context)
                targets.append(y)
                n_local += x.num_voxels
        # seg: voxels of the global batch (every stage holds them all); cls: as in train_step.
        denom = (ctx.global_count(n_local) if self.seg
                 else self.cfg.batch_size * ctx.spatial_size)

        def loss_fn(i: int, out: Any) -> torch.Tensor:
            logits = out.feats if self.seg else out
            return F.cross_entropy(logits, targets[i], reduction="sum") / denom

        def step() -> None:
            with span("allreduce", "allreduce"):
                if self.reducer is not None:
                    self.reducer.finish()  # armed before the last micro-batch's backward
                else:
                    ctx.allreduce_gradients(self.train_params)
            with span("optimizer", "optimizer"):
                self.optimizer.step()

        self.optimizer.zero_grad(set_to_none=True)
        shares = pipe.run(inputs, contexts, loss_fn, step,
                          last_backward=self.reducer.arm if self.reducer is not None else None)
        self.scheduler.step()
        share = torch.stack(shares).sum() if shares else torch.zeros(())
        return share, n_local if pipe.is_first else 0

    def _eval_logits(self, batch: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(logits, labels) of a validation batch; pipelined: on the last stage, else None."""
        if self.eval_pipe is None:
            logits, target, _ = self._forward(batch)
            return logits, target
        labels: Any
        if self.seg:
            x, labels = self.ctx.distribute(batch.x, batch.labels, align=self.stride)
        else:
            (x,) = self.ctx.distribute(batch.x, align=self.stride)
            labels = batch.labels
        out = self.eval_pipe.run([x], [x.context], lambda i, o: o.feats if self.seg else o,
                                 backward=False)
        return (out[0], labels) if out else None

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Metrics on the whole validation split, each sample counted once. **Collective.**"""
        self.model.eval()
        cm = ConfusionMatrix(self.num_classes)
        batches = ShardedBatches(len(self.val_set), self.cfg.batch_size,
                                 replicas=self.ctx.num_replicas, rank=self.ctx.replica,
                                 shuffle=False, drop_last=False)
        for indices in batches:
            if not indices:  # the short last step: this replica has nothing (no collective here)
                continue
            got = self._eval_logits(self._batch(self.val_set, indices, None))
            # seg: each voxel lives on one rank. cls: every spatial rank holds the same logits,
            # so only spatial rank 0 of a replica counts them.
            if got is not None and (self.seg or self.ctx.position.spatial == 0):
                cm.update(got[0].argmax(1).cpu(), got[1].cpu())
        if self.pipe is not None:  # only the last stage counted: sum over every rank
            allreduce_(cm.matrix, self.comm)
        else:
            cm.allreduce(self.ctx)
        self.model.train()
        rec: dict[str, Any] = {"kind": "eval", "step": self.step,
                               "epoch": self.epoch,
                               "samples": len(self.val_set)}
        iou = cm.iou()
        if self.seg:
            rec.update(oa=cm.overall_accuracy(), miou=cm.mean_iou(), iou=iou, voxels=cm.total)
        else:
            per_class = cm.matrix.diagonal().double() / cm.matrix.sum(1).clamp(min=1).double()
            rec.update(acc=cm.overall_accuracy(), macc=float(per_class.mean()), iou=iou)
        return rec

    # --- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Optional[Path] = None) -> Path:
        """Rank 0 writes ``<out>/last.pt`` atomically, with every rank's RNG state, and its
        manifest (see :mod:`sparsepipe_hpc.train.checkpoint`).

        **Collective**: every rank gathers its RNG state to rank 0 and waits for the file; a
        failed write (OutputError: full or read-only disk) is raised on every rank.
        """
        path = path or self.out / ckpt_io.LAST
        stage_optimizers = self._sync_stages()
        states = self.comm.gather(ckpt_io.rng_state(device=self.device), root=0)

        def write() -> None:
            if not self.is_root:
                return
            self.metrics.check()  # a metrics write that failed since the last agreement
            layout = {"replicas": self.layout.replicas, "stages": self.layout.stages,
                      "grid": list(self.layout.grid), "world_size": self.layout.size}
            config, versions = self.cfg.to_dict(), _versions(self.comm)
            last = path == self.out / ckpt_io.LAST
            state = {
                "format": ckpt_io.FORMAT, "version": ckpt_io.VERSION, "step": self.step,
                "epoch": self.epoch,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "loader": self.batches.state_dict(),
                "rng": states, "config": config, "layout": layout, "versions": versions}
            if stage_optimizers is not None:
                state["optimizer_stages"] = stage_optimizers
            if self.precision.scaler is not None:  # fp16: the loss scale continues
                state["scaler"] = self.precision.state_dict()
            digest = ckpt_io.save_checkpoint(state, path,
                {"step": self.step, "epoch": self.epoch, "total_steps": self.total_steps,
                 "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                 "layout": layout, "versions": versions}, on_disk=self._on_disk if last else None)
            if last:
                self._on_disk = digest
            self.metrics.sync()

        agree(self.comm, write)  # also the barrier: nobody reads or exits before the file is in
        return path

    def _sync_stages(self) -> Optional[list[Any]]:
        """Pipelined (2+ stages): every rank gets every stage's trained weights and buffers
        (broadcast from the stage's first rank), and rank 0 each stage's optimizer state, so
        rank 0's checkpoint holds the whole model. **Collective.** None without stages."""
        if self.pipe is None or self.layout.stages == 1:
            return None
        for s, plan in enumerate(self.pipe.plan.stages):
            a, b = plan.blocks
            blocks = self.model.blocks[a:b]
            for t in list(blocks.parameters()) + list(blocks.buffers()):
                self.comm.Bcast(t.detach().view(-1).numpy(), root=self.layout.rank_of(0, s, 0))
        pos = self.ctx.position
        mine = self.optimizer.state_dict() if pos.replica == 0 and pos.spatial == 0 else None
        got = self.comm.gather(mine, root=0)
        if not self.is_root:
            return None
        return [got[self.layout.rank_of(0, s, 0)] for s in range(self.layout.stages)]

    def _check_outputs(self, failed: bool) -> None:
        """Raise rank 0's OutputError on every rank when ``failed`` (agreed by all ranks)."""
        if failed:
            msg = self.comm.bcast(str(self.metrics.error) if self.is_root else None, root=0)
            raise OutputError(msg)

    # --- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to ``total_steps`` (or until stopped), evaluate, checkpoint. **Collective.**"""
        from tqdm import tqdm

        cfg, t_start = self.cfg, time.perf_counter()
        self._say(f"{cfg.task}: {cfg.model} width {cfg.width} depth {cfg.depth} "
                  f"({sum(p.numel() for p in self.model.parameters()):,} parameters); "
                  f"{len(self.train_set)} train / {len(self.val_set)} val samples; grid "
                  f"{'x'.join(map(str, self.shape))} voxels of {cfg.voxel_size} m; {self.layout}"
                  + (" (each rank reads its share of the points)" if self.distributed_input
                     else "") + "; "
                  f"{self.total_steps} steps of global batch {cfg.batch_size} on {self.device}"
                  + (f" in {cfg.precision}" if cfg.precision != "fp32" else "")
                  + f"; transport {self.transport}" + f"; out {self.out}"
                  + (f"; resumed at step {self.step}" if self.resumed_from else ""))
        bar = tqdm(total=self.total_steps, initial=self.step, desc=cfg.task, unit="step",
                   disable=not (self.is_root and cfg.progress), mininterval=0.5, file=sys.stderr,
                   dynamic_ncols=True)
        last_train: Optional[dict[str, Any]] = None
        last_eval: Optional[dict[str, Any]] = None
        stopped = False
        recorder = Recorder.start(self.comm) if cfg.trace or cfg.plot else None  # collective
        t0 = time.perf_counter()
        while self.step < self.total_steps and not stopped:
            for indices in self.batches:
                epoch = self.epoch = self.batches.epoch
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                with recording(recorder):
                    share, n_local = self.train_step(indices, epoch)
                self.step += 1
                stop = float(bool(self.should_stop()))
                stats = torch.tensor([float(share), float(n_local), stop,
                                      float(self.metrics.failed)], dtype=torch.float64)
                # One collective: loss, voxels, stop agreement, and whether rank 0 failed to write
                # metrics.jsonl (then every rank raises its OutputError, here, together).
                allreduce_(stats, self.comm)
                self._check_outputs(bool(stats[3] > 0))
                t1 = time.perf_counter()
                last_train = {"kind": "train", "step": self.step, "epoch": epoch,
                              "loss": float(stats[0]), "lr": lr,
                              "voxels": int(stats[1]), "voxels_per_s": float(stats[1]) / (t1 - t0)}
                t0 = t1
                self.metrics.write(last_train)
                bar.update(1)
                bar.set_postfix(loss=f"{last_train['loss']:.3f}",
                                vox_s=f"{last_train['voxels_per_s']:.0f}", refresh=False)
                stopped = bool(stats[2] > 0)
                done = self.step >= self.total_steps
                if cfg.eval_every and self.step % cfg.eval_every == 0 and not done and not stopped:
                    last_eval = self.evaluate()
                    self.metrics.write(last_eval)
                    self._say(self._eval_text(last_eval), bar)
                    t0 = time.perf_counter()  # keep eval time out of voxels/s
                if stopped or done or (cfg.checkpoint_every
                                       and self.step % cfg.checkpoint_every == 0):
                    self.save_checkpoint()
                    t0 = time.perf_counter()
                if stopped or done:
                    break
        bar.close()
        if stopped:
            self._say(f"stop requested: checkpoint at step {self.step} in "
                      f"{self.out / ckpt_io.LAST}; continue with --resume auto --out {self.out}")
        else:
            if last_train is None:
                self._say(f"checkpoint is already at step {self.step} of {self.total_steps}: "
                          "nothing to train")
            last_eval = self.evaluate()
            self.metrics.write(last_eval)
        agree(self.comm, self.metrics.close)  # the last records reach the disk, or every rank hears
        if recorder is not None:
            self._write_trace(recorder)
        summary = format_summary(last_train, last_eval, time.perf_counter() - t_start)
        self._say(summary)
        return {"step": self.step, "stopped": stopped, "train": last_train, "eval": last_eval,
                "summary": summary}

    def _write_trace(self, recorder: Recorder) -> None:
        """Gather every rank's spans; on rank 0 write ``--trace`` and draw ``--plot``.
        **Collective.**"""
        cfg = self.cfg
        pos = self.ctx.position
        label = (f"rank {self.comm.rank}: stage {pos.stage}, replica {pos.replica}, "
                 f"spatial {pos.spatial}")
        trace = gather_chrome_trace(recorder, self.comm, label)

        def write() -> None:
            if trace is None:
                return
            if cfg.trace:
                atomic_write(Path(cfg.trace), lambda f: f.write(json.dumps(trace).encode()),
                             "--trace")
            if cfg.plot:
                from sparsepipe_hpc.plot import plot_trace

                plot_trace(trace, cfg.plot, title=self._plot_title())

        agree(self.comm, write)
        if cfg.trace:
            self._say(f"trace: {cfg.trace} (open in ui.perfetto.dev)")
        if cfg.plot:
            self._say(f"timeline: {cfg.plot}")

    def _plot_title(self) -> str:
        cfg, lay = self.cfg, self.layout
        text = (f"{cfg.model}, {lay.replicas} replica(s) x {lay.stages} stage(s) x grid "
                f"{'x'.join(map(str, lay.grid))}")
        if self.pipe is not None:
            text += f", {cfg.pipeline_schedule} with {cfg.micro_batches} micro-batch(es)"
        return text + f", {self.step} steps"

    # --- messages --------------------------------------------------------------------------------
    def _say(self, text: str, bar: Any = None) -> None:
        if self._log is None:
            return
        if bar is not None and not bar.disable:
            bar.write(text)  # above the bar instead of through it
        else:
            self._log(text)
        sys.stdout.flush()

    def _eval_text(self, rec: dict[str, Any]) -> str:
        if self.seg:
            return f"eval step {rec['step']}: oa {rec['oa']:.4f} miou {rec['miou']:.4f}"
        return f"eval step {rec['step']}: acc {rec['acc']:.4f} macc {rec['macc']:.4f}"
