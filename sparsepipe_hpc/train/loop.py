"""The training loop: one replica's data shard, loss shares, gradient all-reduce, eval, checkpoints.

    cfg = parse_config(["--task", "seg", "--steps", "100"])
    trainer = Trainer(cfg, MPI.COMM_WORLD)   # collective: every rank builds the same trainer
    result = trainer.run()                   # {"step", "stopped", "train": {...}, "eval": {...}}
    trainer.close()                          # collective: communicators, transports, files

One step on one rank::

    indices   this replica's samples of the global batch (ShardedBatches: the same on every
              spatial rank of the replica)
    batch     collate(samples) -> every voxel of the replica's samples (with --prefetch read
              on a host thread while the step before computes: sparsepipe_hpc.data.prefetch)
    step      this rank's voxels, loss share, backward, gradient all-reduce, optimizer step
              (sparsepipe_hpc.train.step: the loss convention, plain or pipelined)
    report    allreduce([share, my voxels, stop flag]) -> global loss, voxels, stop agreement

Any layout trains the same model as one process (up to float rounding). Augmentation is drawn per
sample from a generator seeded by ``(seed, epoch, sample index)``, so it too does not depend on
which replica reads the sample, nor on where a resumed run restarted.

Modules of their own (in sparsepipe_hpc.train): ``step`` (plain or pipelined: ``--stages``,
``--micro-batches``), ``evaluation``, ``resume`` (checkpoints and resume; pipelined: every stage
gathered to rank 0), ``lr_schedule`` (rebuilt from the current options on resume) and
``run_files`` (``--out``, ``config.json``, ``--trace``, ``--plot``).

Checked before step 1, on every rank together (:func:`agree`): the data files, that the splits
agree (:func:`sparsepipe_hpc.data.check_splits`), the grid's size, the checkpoint and its
manifest, and that ``--out`` is writable with room for a checkpoint. Rank 0 alone writes the run
directory; a write that fails later reaches every rank too: checkpoints through :func:`agree`,
``metrics.jsonl`` through a flag in the per-step all-reduce.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from sparsepipe_hpc.data import (ModelNetDataset, SceneDataset, ShardedBatches, check_splits,
                                 collate, default_data, grid_for)
from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.nn import build_model
from sparsepipe_hpc.nn.functional import BatchNormError
from halo.transport.collectives import allreduce_
from launch.env import detect
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.gradients import GradientReducer
from sparsepipe_hpc.parallel.layout import stage_ordered
from sparsepipe_hpc.pipeline.carry import PipelineError, parse_balance
from sparsepipe_hpc.pipeline.runner import Pipeline
from sparsepipe_hpc.train import checkpoint as ckpt_io
from sparsepipe_hpc.train import resume, run_files
from sparsepipe_hpc.train.agreement import (SetupError, agree, check_grid_fits,
                                            check_model_fits, check_same, free_memory,
                                            data_fingerprint)
from sparsepipe_hpc.parallel.input import LocalBatch, read_distributed
from sparsepipe_hpc.data.prefetch import Prefetcher
from sparsepipe_hpc.train.config import (ConfigError, TrainConfig, distributed_input,
                                         local_batch_size, resolve_layout, stage_order,
                                         use_prefetch)
from sparsepipe_hpc.train.device import Precision, compute_threads, trainer_device
from sparsepipe_hpc.train.transport import device_comm, trainer_transport
from sparsepipe_hpc.train.metrics import MetricsLog, format_summary
from sparsepipe_hpc.train.evaluation import eval_text, evaluate
from sparsepipe_hpc.train.lr_schedule import LrSchedule
from sparsepipe_hpc.train.output import OutputError
from sparsepipe_hpc.train.step import pipeline_logits, pipeline_step, plain_step
from sparsepipe_hpc.tracing import Recorder, recording

__all__ = ["Trainer", "SetupError", "DivergedError", "LrSchedule", "MAX_SKIPPED_STEPS",
           "MAX_SKIPPED_UPDATES"]

#: fp16: consecutive steps with a non-finite loss (each skipped by the loss scaler) before the
#: run stops. A scale that halves each time cures overflowing gradients within a few steps; a
#: loss that stays NaN or inf comes from the forward pass, which no loss scale reaches.
MAX_SKIPPED_STEPS = 10
#: fp16: consecutive updates the loss scaler skipped, whatever the loss, before the run stops. Each
#: skip halves the scale (from 2**16): after 32 it is 2**-16, where gradients that still overflow
#: are inf or NaN at any scale, and the run would go on finite losses without ever training.
MAX_SKIPPED_UPDATES = 32


class DivergedError(FloatingPointError):
    """The training loss is NaN or inf: raised on every rank together (the loss is summed over
    them) before the weights it updated are checkpointed."""


def _check_balance(cfg: TrainConfig, blocks: int) -> None:
    """``--balance`` against the model's ``blocks``; one from a ``--plan FILE`` made for another
    model says so (the user may not have passed --balance at all)."""
    try:
        parse_balance(str(cfg.balance), blocks)
    except PipelineError as e:
        if cfg.plan is None or cfg.plan == "auto":
            raise
        raise SetupError(f"--plan {cfg.plan} sets --balance {cfg.balance}, for a model of "
                         f"{sum(parse_balance(str(cfg.balance), None))} blocks, but --model "
                         f"{cfg.model} --width {cfg.width} --depth {cfg.depth} has {blocks}: "
                         f"make the plan for this model (python -m sparsepipe_hpc.plan --model "
                         f"{cfg.model} --width {cfg.width} --depth {cfg.depth} ...)") from e


class Trainer:
    """Everything one rank needs to train; see the module docstring. **Collective** to build.

    ``should_stop``: polled at every step boundary (default: :func:`launch.run.stop_requested`,
    raised by SIGTERM); when it is true on any rank, every rank checkpoints and stops.
    ``log``: where rank 0's messages go (None: quiet). Sets torch's thread count to
    ``--threads`` (or the device's default, :func:`~.device.compute_threads`). Resolves
    ``--plan auto`` where the caller has not (:func:`sparsepipe_hpc.plan.auto.auto_plan`: rank 0
    profiles the model on the data; ``self.cfg`` holds the layout it picked).
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
        torch.set_num_threads(compute_threads(cfg, comm))  # (--engine auto reads it)
        if cfg.plan == "auto":  # on the threads that will train
            from sparsepipe_hpc.plan.auto import auto_plan
            cfg = auto_plan(cfg, comm, log)
        self.cfg, self.should_stop = cfg, should_stop
        self.layout = resolve_layout(cfg, comm.Get_size())
        # --device, --precision (sparsepipe_hpc.train.device): a ConfigError on every rank when
        # CUDA is asked for and absent. --transport (halo.transport.select): likewise when a
        # device transport is asked for without CUDA; it moves the spatial grid's halos, and
        # its reducer the layers' and the gradients' all-reduces of device tensors.
        self.device = trainer_device(cfg, comm)  # this process's own, before any renumbering
        # --stage-order: stage s on the processes (and so the devices) launched as stage
        # order[s]; every communicator below derives from the renumbered one.
        order = stage_order(cfg)
        self._ordered = None if order is None else stage_ordered(comm, self.layout, order)
        comm = self.comm = comm if self._ordered is None else self._ordered
        self.is_root = comm.Get_rank() == 0
        self._log = log if self.is_root else None
        self.precision = Precision(cfg.precision, self.device, comm)
        self.transport = trainer_transport(cfg, self.device, comm)
        self.device_comm = device_comm(self.transport, self.device)
        self.ctx = ParallelContext(comm, self.layout, cuts=cfg.cuts, overlap=cfg.overlap,
                                   transport=self.device_comm.halo,
                                   reducer=self.device_comm.reducer)
        self.train_set: Any = None
        self.val_set: Any = None
        self.pipe: Optional[Pipeline] = None
        self.eval_pipe: Optional[Pipeline] = None
        self.reducer: Optional[GradientReducer] = None
        try:
            self._build()
        except (SetupError, ConfigError):
            # Raised on every rank together (setup agrees on failures): free what was built,
            # collectively, so a caller that goes on does not keep communicators and buffers.
            self.close()
            raise

    def _build(self) -> None:
        """The data, model, pipelines, reducers, optimizer and outputs (``__init__``'s rest)."""
        cfg, comm = self.cfg, self.comm
        self.seg = cfg.task == "seg"

        data_dir = Path(cfg.data) if cfg.data else default_data(cfg.task, comm=comm)
        self.data_dir = data_dir
        self.train_set, self.val_set = agree(comm, lambda: self._open_data(data_dir))
        # What identifies the data: the same on every rank, and (train) a resume's too.
        self.data_ids = {split: data_fingerprint(ds) for split, ds in
                         (("train", self.train_set), ("val", self.val_set))}
        check_same(comm, "data", self.data_ids)
        self.num_classes = self.train_set.num_classes

        def model() -> Any:
            return build_model(cfg.model, self.train_set.in_channels, self.num_classes,
                               width=cfg.width, depth=cfg.depth, engine=cfg.engine)

        with torch.device("meta"):  # shapes only: is there room for the weights at all?
            probe = model()
        # A node's CPU ranks share its memory; GPU ranks have a device each.
        sharing = detect(comm).local_size if self.device.type == "cpu" else 1
        agree(comm, lambda: check_model_fits(probe, cfg, free_memory(self.device), sharing))
        # The same seed on every rank; rank 0's initial weights are broadcast regardless.
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        random.seed(cfg.seed)
        self.model = model()
        self.ctx.broadcast_parameters(self.model)
        self.model.to(self.device)  # before the optimizer is built on its parameters
        self.stride = self.model.total_stride
        # The default margin holds every augmented point (flips, swap, jitter), so training can
        # voxelize with clip=False: a point off the grid is an error, never silently dropped.
        self.origin, self.shape = agree(comm, lambda: grid_for(
            [self.train_set, self.val_set], cfg.voxel_size, multiple=self.stride))
        check_grid_fits(self.layout.grid, self.shape, self.stride, cfg)
        self.distributed_input = distributed_input(cfg)
        # --prefetch: the next batch is read on a host thread while a step computes (run()).
        self.prefetch = use_prefetch(cfg, self.device.type)
        self._ahead: Optional[Prefetcher[Any]] = None
        # Pipeline (--stages, --micro-batches): this rank trains its stage's blocks only; eval
        # runs the same stages forward, one micro-batch per batch.
        if cfg.balance is not None:  # also where no pipeline reads it: it must fit the model
            agree(comm, lambda: _check_balance(cfg, len(self.model.blocks)))
        if cfg.stages > 1 or cfg.micro_batches > 1:
            stages = self.device_comm.stages  # device payloads: CUDA IPC or host-staged
            amp = self.precision.autocast  # --precision bf16/fp16: every stage's forward
            self.pipe = agree(comm, lambda: Pipeline(self.model, self.ctx, cfg.balance,
                                                     cfg.pipeline_schedule, cfg.micro_batches,
                                                     transport=stages, autocast=amp,
                                                     deferred_bn=cfg.deferred_bn))
            self.eval_pipe = Pipeline(self.model, self.ctx, cfg.balance, "gpipe", 1,
                                      transport=stages, autocast=amp)

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
        if len(self.train_set) < cfg.batch_size:  # (ShardedBatches would say it without names)
            raise SetupError(f"the training split {self.train_set!r} has {len(self.train_set)} "
                             f"sample(s), fewer than one global batch (--batch-size "
                             f"{cfg.batch_size}): no step could run; pass --batch-size <= "
                             f"{len(self.train_set)} or add samples")
        self.batches = agree(comm, lambda: ShardedBatches(
            len(self.train_set), cfg.batch_size, replicas=self.ctx.num_replicas,
            rank=self.ctx.replica, seed=cfg.seed, micro_batches=cfg.micro_batches))
        self.total_steps = cfg.steps if cfg.steps else cfg.epochs * self.batches.steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LrSchedule(cfg.schedule, self.total_steps, cfg.warmup))
        self.step = 0
        self.epoch = 0
        self._on_disk: Optional[ckpt_io.FileDigest] = None  # the checkpoint at <out>/last.pt
        self._non_finite = 0  # steps in a row whose loss was NaN or inf (fp16: skipped steps)

        out = cfg.out or f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(comm.bcast(out, root=0))  # one timestamp for all ranks
        # Rank 0 decides whether <out>/last.pt exists, so every rank takes the same branch; a
        # directory it cannot look into (permissions, a stale handle) stops every rank.
        resume = comm.bcast(agree(comm, lambda: ckpt_io.resolve_resume(cfg.resume, self.out)
                                  if self.is_root else None))
        self.resumed_from = resume
        if resume is not None:
            agree(comm, lambda: self._load(resume))
            # Each rank read the file itself: a node-local --out may hold another run's.
            check_same(comm, "checkpoint resumed", {"step": self.step, "epoch": self.epoch})
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

    def _open_outputs(self) -> MetricsLog:
        """Rank 0: check ``--out`` (writable, room for a checkpoint), remove temporary files left
        by a killed run, open ``metrics.jsonl`` (cut back to the resumed step), write
        ``config.json``. Other ranks: a disabled log. Run under :func:`agree`."""
        if not self.is_root:
            return MetricsLog(self.out / "metrics.jsonl", enabled=False)
        metrics = run_files.open_out(self.out, run_files.checkpoint_bytes(
            self.model, self.cfg.optimizer, self.comm.Get_size()), self._say,
            resumed_from=self.resumed_from, step=self.step)
        try:
            run_files.write_config(self.out, run_files.config_record(
                self.cfg, self.layout, out=self.out, data_dir=self.data_dir, origin=self.origin,
                shape=self.shape, stride=self.stride, splits=(self.train_set, self.val_set),
                total_steps=self.total_steps, steps_per_epoch=self.batches.steps_per_epoch,
                local_batch=local_batch_size(self.cfg, self.layout),
                resumed_from=self.resumed_from,
                parameters=sum(p.numel() for p in self.model.parameters()), comm=self.comm))
        except BaseException:
            with contextlib.suppress(Exception):  # the caller never gets the log to close
                metrics.close()
            raise
        return metrics

    def _load(self, path: Path) -> None:
        """Resume from the checkpoint at ``path`` (:func:`resume.load_state`); run under agree."""
        at = resume.load_state(path, self._train_state(), cfg=self.cfg, out=self.out,
                               comm=self.comm, layout=self.layout,
                               stage=self.pipe.stage if self.pipe is not None else None,
                               device=self.device, data=self.data_ids["train"],
                               grid=resume.grid_record(self.origin, self.shape), say=self._say)
        self.step, self.epoch, self._on_disk = at.step, at.epoch, at.on_disk

    def _train_state(self) -> resume.TrainState:
        return resume.TrainState(self.model, self.optimizer, self.scheduler, self.batches,
                                 self.precision)

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

    def _train_batch(self, indices: Sequence[int], epoch: int) -> Any:
        """This step's training batch: read ahead when prefetching (and the next step's read
        started), else read now; the same batch either way."""
        if self._ahead is None:
            return self._batch(self.train_set, indices, epoch)
        batch = self._ahead.get(indices, epoch)
        if self.step + 1 < self.total_steps:  # self.step counts the steps before this one
            self._ahead.start(*self.batches.peek())
        return batch

    @contextlib.contextmanager
    def _prefetching(self) -> Iterator[None]:
        """While training: a :class:`Prefetcher` when ``--prefetch`` is on, stopped after."""
        if not self.prefetch:
            yield
            return
        self._ahead = Prefetcher(lambda idx, epoch: self._batch(self.train_set, idx, epoch))
        try:
            yield
        finally:
            self._ahead.close()
            self._ahead = None

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
            out = self.model(x.to(dev, non_blocking=True))
        logits = out.feats if self.seg else out
        return logits.float(), labels.to(dev, non_blocking=True), x.num_voxels

    # --- one step --------------------------------------------------------------------------------
    def train_step(self, indices: Sequence[int], epoch: int) -> tuple[torch.Tensor, int]:
        """Forward, backward, gradient all-reduce and update; returns (my loss share, my voxels)."""
        self.model.train()
        batch = self._train_batch(indices, epoch)
        try:
            with self.precision.skippable(self.model):  # fp16: a skipped step keeps BN's stats
                share, n_local = self._step(batch)
        except BatchNormError as e:
            why = (f"step {self.step + 1}: {e}; its samples (training split indices "
                   f"{sorted(int(i) for i in indices)}"
                   f"{' on this replica' if self.layout.replicas > 1 else ''}) are too small "
                   f"for this model: use a larger --batch-size, a smaller --voxel-size or a "
                   f"smaller --depth, or remove such samples")
            if self.layout.stages > 1:
                # One stage's ranks alone, while the others wait for their messages: not an
                # agreed error but an abort (the entry point's hook ends the job with this).
                raise BatchNormError(why) from None
            # Every rank shares the statistics, so every rank raises this, together.
            raise SetupError(why) from None
        self.scheduler.step()
        return share, n_local

    def _stage_transport_note(self) -> str:
        """" (stage transfers K)" where the pipeline's payloads move by another transport than
        the halos (``nccl`` matches calls in order on one stream, which stage messages do not
        keep: see :mod:`sparsepipe_hpc.train.transport`)."""
        if self.pipe is None or self.layout.stages == 1:  # (micro-batches alone send nothing)
            return ""
        kind = self.pipe.executor.link.transport.kind
        return f" (stage transfers {kind})" if kind != self.transport else ""

    def _step(self, batch: Any) -> tuple[torch.Tensor, int]:
        """The step on ``batch``, pipelined or plain: (my loss share, my voxels)."""
        if self.pipe is not None:
            return pipeline_step(
                self.pipe, self.ctx, batch, seg=self.seg, stride=self.stride,
                batch_size=self.cfg.batch_size, optimizer=self.optimizer,
                reducer=self.reducer, params=self.train_params, precision=self.precision)
        return plain_step(
            self._forward, batch, ctx=self.ctx, seg=self.seg,
            batch_size=self.cfg.batch_size, model=self.model, optimizer=self.optimizer,
            reducer=self.reducer, precision=self.precision)

    def _eval_logits(self, batch: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(logits, labels) of a validation batch; pipelined: on the last stage, else None."""
        if self.eval_pipe is None:
            logits, target, _ = self._forward(batch)
            return logits, target
        return pipeline_logits(self.eval_pipe, self.ctx, batch, seg=self.seg, stride=self.stride)

    def evaluate(self) -> dict[str, Any]:
        """Metrics on the whole validation split, each sample counted once (an ``eval`` record;
        :func:`~sparsepipe_hpc.train.evaluation.evaluate`). **Collective.**"""
        return evaluate(self.model, self.ctx, self.comm,
                        lambda indices: self._eval_logits(self._batch(self.val_set, indices, None)),
                        samples=len(self.val_set), batch_size=self.cfg.batch_size,
                        num_classes=self.num_classes, seg=self.seg,
                        pipelined=self.pipe is not None, step=self.step, epoch=self.epoch)

    # --- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Optional[Path] = None) -> Path:
        """Rank 0 writes ``<out>/last.pt`` atomically, with every rank's RNG state, and its
        manifest (see :mod:`sparsepipe_hpc.train.checkpoint`, :mod:`~.resume`).

        **Collective**: every rank gathers its RNG state to rank 0 and waits for the file; a
        failed write (OutputError: full or read-only disk) is raised on every rank.
        """
        path = path or self.out / ckpt_io.LAST
        stage_optimizers = resume.sync_stages(self.model, self.optimizer, self.pipe, self.ctx,
                                              self.comm)
        states = self.comm.gather(ckpt_io.rng_state(device=self.device), root=0)

        def write() -> None:
            if not self.is_root:
                return
            self.metrics.check()  # a metrics write that failed since the last agreement
            # The log reaches the disk before the checkpoint that resumes after it: a crash
            # between the two would leave the checkpoint's steps out of the log for good.
            self.metrics.sync()
            last = path == self.out / ckpt_io.LAST
            digest = resume.write_checkpoint(
                path, self._train_state(), rng=states, stage_optimizers=stage_optimizers,
                step=self.step, epoch=self.epoch, total_steps=self.total_steps,
                config=self.cfg.to_dict(), layout=self.layout,
                versions=run_files.versions(self.comm), data=self.data_ids["train"],
                grid=resume.grid_record(self.origin, self.shape),
                on_disk=self._on_disk if last else None)
            if last:
                self._on_disk = digest

        agree(self.comm, write)  # also the barrier: nobody reads or exits before the file is in
        return path

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
                  + (f", stage order {cfg.stage_order}" if self._ordered is not None else "")
                  + (" (each rank reads its share of the points)" if self.distributed_input
                     else "") + "; "
                  f"{self.total_steps} steps of global batch {cfg.batch_size} on {self.device}"
                  + (f" in {cfg.precision}" if cfg.precision != "fp32" else "")
                  + (" (spconv has no bfloat16: its convolutions run in float32; fp16 runs its "
                     "fast kernels)" if cfg.precision == "bf16"
                     and get_engine(cfg.engine, self.device).name == "spconv" else "")
                  + f"; transport {self.transport}" + self._stage_transport_note()
                  + ("; prefetch" if self.prefetch else "")
                  + f"; out {self.out}"
                  + (f"; resumed at step {self.step}" if self.resumed_from else ""))
        bar = tqdm(total=self.total_steps, initial=self.step, desc=cfg.task, unit="step",
                   disable=not (self.is_root and cfg.progress), mininterval=0.5, file=sys.stderr,
                   dynamic_ncols=True)
        recorder = (Recorder.start(self.comm, self.device)  # collective
                    if cfg.trace or cfg.plot else None)
        first_traced = self.step + 1
        if self._eval_missing():  # a run stopped right after an eval step, before its eval
            self._log_eval(bar)
        with self._prefetching():  # --prefetch: the next batch read during each step
            last_train, last_eval, stopped = self._train_steps(
                bar, recorder, until=self.step + cfg.trace_steps)
        bar.close()
        if stopped:
            self._say(f"stop requested: checkpoint at step {self.step} in "
                      f"{self.out / ckpt_io.LAST}; continue with --resume auto --out {self.out}")
        else:
            if last_train is None:
                self._say(f"checkpoint is already at step {self.step} of {self.total_steps}: "
                          "nothing to train")
            last_eval = self.evaluate()
            if self._last_logged("eval") != self.step:  # (a finished run resumed: logged)
                self.metrics.write(last_eval)
        agree(self.comm, self.metrics.close)  # the last records reach the disk, or every rank hears
        if recorder is not None:
            run_files.write_trace(recorder, self.comm, self.ctx.position, trace=cfg.trace,
                                  plot=cfg.plot, say=self._say, title=run_files.plot_title(
                                      cfg, self.layout, self.pipe is not None, first_traced,
                                      min(self.step, first_traced + cfg.trace_steps - 1)))
        summary = format_summary(last_train, last_eval, time.perf_counter() - t_start)
        self._say(summary)
        return {"step": self.step, "stopped": stopped, "train": last_train, "eval": last_eval,
                "summary": summary}

    def _train_steps(self, bar: Any, recorder: Optional[Recorder], until: int
                     ) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]], bool]:
        """Steps to ``total_steps`` or a stop, with evaluations and checkpoints on their
        schedule, ``recorder`` tracing the steps up to step ``until``: (last train record,
        last eval record, stopped?)."""
        cfg = self.cfg
        last_train: Optional[dict[str, Any]] = None
        last_eval: Optional[dict[str, Any]] = None
        stopped = False
        t0 = time.perf_counter()
        while self.step < self.total_steps and not stopped:
            for indices in self.batches:
                epoch = self.epoch = self.batches.epoch
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                with recording(recorder if self.step < until else None):
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
                self._check_finite(last_train["loss"])
                bar.update(1)
                bar.set_postfix(loss=f"{last_train['loss']:.3f}",
                                vox_s=f"{last_train['voxels_per_s']:.0f}", refresh=False)
                stopped = bool(stats[2] > 0)
                done = self.step >= self.total_steps
                if cfg.eval_every and self.step % cfg.eval_every == 0 and not done and not stopped:
                    last_eval = self._log_eval(bar)
                    t0 = time.perf_counter()  # keep eval time out of voxels/s
                if stopped or done or (cfg.checkpoint_every
                                       and self.step % cfg.checkpoint_every == 0):
                    self.save_checkpoint()
                    t0 = time.perf_counter()
                if stopped or done:
                    break
        return last_train, last_eval, stopped

    def _check_finite(self, loss: float) -> None:
        """Raise DivergedError (on every rank: ``loss`` is their sum) for a NaN or inf loss,
        before a checkpoint could keep the weights it made non-finite. Under fp16 the loss
        scaler skipped that step's update, so only :data:`MAX_SKIPPED_STEPS` in a row stop, or
        :data:`MAX_SKIPPED_UPDATES` skipped updates in a row whatever the loss (the verdicts are
        agreed, so every rank stops together)."""
        finite = math.isfinite(loss)
        self._non_finite = 0 if finite else self._non_finite + 1
        skips = self.precision.skipped_in_a_row
        if finite and skips < MAX_SKIPPED_UPDATES:
            return
        kept = (f"{self.out / ckpt_io.LAST} keeps the last checkpoint written before it"
                if self._on_disk is not None else "no checkpoint was written")
        if finite:
            assert self.precision.scaler is not None  # only fp16 skips updates
            why = (f"step {self.step}: the loss scaler skipped the last {skips} updates in a row "
                   f"under --precision fp16 although the loss was finite (loss scale now "
                   f"{self.precision.scaler.get_scale():g}): the backward pass gives inf or NaN "
                   f"gradients at every scale, so the run was not training (the weights are "
                   f"finite, {kept}); try --precision bf16 or fp32, or a lower --lr")
        elif self.precision.scaler is None:
            why = (f"step {self.step}: the training loss is {loss} (--precision "
                   f"{self.cfg.precision}), so the weights this step updated are not finite; "
                   f"they are not saved ({kept}). Lower --lr (now {self.cfg.lr}), lengthen "
                   "--warmup, or look for NaN or inf in the data's features")
        elif self._non_finite >= MAX_SKIPPED_STEPS:
            why = (f"step {self.step}: the training loss was NaN or inf for {self._non_finite} "
                   f"steps in a row under --precision fp16 (the loss scaler skipped each step: "
                   f"the weights are finite, {kept}); the forward pass itself overflows float16: "
                   f"try --precision bf16 or fp32, a lower --lr, or look for NaN or inf in the data")
        else:
            return
        agree(self.comm, self.metrics.close)  # the log keeps the steps up to this one
        raise DivergedError(why)

    def _log_eval(self, bar: Any) -> dict[str, Any]:
        """An evaluation on the schedule: run, logged, said. **Collective.**"""
        record = self.evaluate()
        self.metrics.write(record)
        self._say(eval_text(record, self.seg), bar)
        return record

    def _eval_missing(self) -> bool:
        """Whether a resumed run's step is one on the --eval-every schedule (and not the last)
        whose evaluation the log lacks: a stop at that step skips it, and the resumed run
        starts after it. Rank 0 reads the log; every rank gets its answer. **Collective.**"""
        every = self.cfg.eval_every
        due = (self.resumed_from is not None and every and self.step % every == 0
               and 0 < self.step < self.total_steps)
        return bool(due and self._last_logged("eval") != self.step)

    def _last_logged(self, kind: str) -> Optional[int]:
        """The last step with a ``kind`` record in rank 0's log, on every rank; a log it cannot
        read stops every rank. **Collective.**"""
        return self.comm.bcast(agree(self.comm, lambda: self.metrics.last_step(kind)), root=0)

    def close(self) -> None:
        """Free the run's communicators, transports and reducers and close the data files.
        **Collective**, after :meth:`run` (or any last :meth:`evaluate`); again: nothing more."""
        for pipe in (self.pipe, self.eval_pipe):
            if pipe is not None:
                pipe.close()
        if self.reducer is not None:
            self.reducer.close()
        self.ctx.close()
        for data in (self.train_set, self.val_set):
            if data is not None:
                data.close()
        if self._ordered is not None:
            self._ordered.Free()
            self._ordered = None

    # --- messages --------------------------------------------------------------------------------
    def _say(self, text: str, bar: Any = None) -> None:
        if self._log is None:
            return
        if bar is not None and not bar.disable:
            bar.write(text)  # above the bar instead of through it
        else:
            self._log(text)
        sys.stdout.flush()
