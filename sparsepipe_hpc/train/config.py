"""The trainer's options: command line, TOML config file, task defaults and validation.

    cfg = parse_config(["--task", "seg", "--config", "run.toml", "--lr", "0.01"])
    cfg.batch_size, cfg.grid, cfg.lr        # resolved: task defaults filled in, values checked
    layout = resolve_layout(cfg, world_size=4)   # RankLayout, or ConfigError naming the remedy

A config file is TOML whose keys are the option names, with dashes or underscores::

    task = "seg"
    batch-size = 8
    grid = [2, 1, 1]          # or "2,1,1"
    no-overlap = true         # boolean options: `overlap = false` works too

The command line wins over the file, the file over the defaults. Options left unset get the task's
defaults (:data:`TASK_DEFAULTS`), chosen so that ``mpirun -n 2 python -m sparsepipe_hpc.train``
finishes in a few minutes on two CPU cores. Every function here is pure (no MPI): each rank parses
the same argv and raises the same :class:`ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

from halo.transport.base import TransportError
from halo.transport.select import TRANSPORTS, choose_transport
from sparsepipe_hpc.parallel.layout import (LayoutError, RankLayout, parse_grid,
                                            parse_stage_order)
from sparsepipe_hpc.sparse import MAX_BATCH

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (a conditional dependency)
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["ConfigError", "TrainConfig", "TASK_DEFAULTS", "build_parser", "parse_config",
           "resolve_layout", "local_batch_size", "distributed_input", "use_prefetch",
           "check_input_options", "fit_default_batch", "option_notes"]

TASKS = ("seg", "cls")
INPUTS = ("auto", "whole", "distributed")
MODEL_TASK = {"unet": "seg", "resnet": "cls"}

#: Defaults that depend on the task; an option the user sets wins. Tuned on the synthetic default
#: data, 2 ranks on 2 CPU cores: seg (96 steps) took 2 min 43 s to OA 0.85 / mIoU 0.34 (chance:
#: mIoU well under 0.1); cls (256 steps) 2 min 47 s to accuracy 0.99 (chance 0.17). Voxels of
#: 0.05 m give 13k-28k voxels per room.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "seg": {"model": "unet", "width": 16, "depth": 3, "epochs": 8, "batch_size": 4,
            "voxel_size": 0.05, "lr": 0.003, "eval_every": 0},
    "cls": {"model": "resnet", "width": 16, "depth": 3, "epochs": 4, "batch_size": 32,
            "voxel_size": 0.08, "lr": 0.003, "eval_every": 0},
}
OPTIMIZER_LR_SCALE = {"adamw": 1.0, "sgd": 10.0}  # SGD wants a larger step than AdamW


class ConfigError(ValueError):
    """An option or config file that breaks a rule; the message names it and the fix."""


@dataclass(frozen=True)
class TrainConfig:
    """Resolved options (see ``python -m sparsepipe_hpc.train --help`` for each one's meaning)."""

    task: str = "seg"
    model: str = "unet"
    width: int = 16
    depth: int = 3
    data: Optional[str] = None
    epochs: int = 5
    steps: Optional[int] = None
    batch_size: int = 4
    voxel_size: float = 0.05
    lr: float = 0.003
    weight_decay: float = 1e-4
    optimizer: str = "adamw"
    schedule: str = "cosine"
    warmup: int = 0
    seed: int = 0
    out: Optional[str] = None
    resume: Optional[str] = None
    trace: Optional[str] = None
    trace_steps: int = 20
    plot: Optional[str] = None
    checkpoint_every: int = 100
    eval_every: int = 0
    grid: tuple[int, int, int] = (1, 1, 1)
    replicas: Optional[int] = None
    stages: int = 1
    balance: Optional[str] = None
    stage_order: Optional[str] = None
    micro_batches: int = 1
    pipeline_schedule: str = "1f1b"
    deferred_bn: bool = False
    cuts: str = "balanced"
    overlap: bool = True
    engine: str = "auto"
    device: str = "auto"
    precision: str = "fp32"
    threads: Optional[int] = None  # None: sparsepipe_hpc.train.device.compute_threads
    grad_bucket_mb: float = 4.0
    transport: str = "auto"
    augment: bool = True
    input: str = "auto"
    prefetch: Optional[bool] = None  # None: on a GPU with whole-sample input (use_prefetch)
    progress: bool = True
    config: Optional[str] = None
    plan: Optional[str] = None
    plan_ranks: Optional[int] = None       # the ranks a --plan FILE (or auto, resolved) is for
    plan_fixed: tuple[str, ...] = ()       # --plan auto: layout options the user set
    defaulted: tuple[str, ...] = ()        # the task defaults used (options not set)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["grid"] = list(self.grid)
        d["plan_fixed"] = list(self.plan_fixed)
        d["defaulted"] = list(self.defaulted)
        return d


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting, so that library
    callers (and tests) get an exception and ``__main__`` decides how to report it."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {v}")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {v}")
    return v


def _seed(text: str) -> int:
    v = int(text)
    if not 0 <= v < 2**63:  # numpy's generators take no negative seed, torch none past 64 bits
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63); got {v}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
    return v


def _nonneg_float(text: str) -> float:
    v = float(text)
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text}")
    return v


def _grid(text: str) -> tuple[int, int, int]:
    try:
        g = parse_grid(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return g  # type: ignore[return-value]  # parse_grid returns None only for None


# Give argparse's messages readable type names ("invalid positive int value").
for _f, _n in ((_positive_int, "positive int"), (_nonneg_int, "non-negative int"), (_seed, "seed"),
               (_positive_float, "positive float"), (_nonneg_float, "non-negative float"),
               (_grid, "grid")):
    _f.__name__ = _n


def build_parser() -> argparse.ArgumentParser:
    """The CLI. Every default is None (or unset) so that task defaults and the config file can be
    told apart from values the user typed."""
    p = _Parser(prog="python -m sparsepipe_hpc.train",
                description="Train a sparse 3D CNN on point clouds, single-process or under mpirun "
                            "(data x spatial parallel).", allow_abbrev=False)
    a = p.add_argument
    a("--config", metavar="FILE", help="TOML file whose keys are these options' names")
    g = p.add_argument_group("task and model")
    g.add_argument("--task", choices=TASKS, help="seg: per-voxel segmentation of rooms; cls: "
                   "object classification (default seg)")
    g.add_argument("--model", choices=sorted(MODEL_TASK), help="default: unet (seg), resnet (cls)")
    g.add_argument("--width", type=_positive_int, help="channels at full resolution (default 16)")
    g.add_argument("--depth", type=_positive_int, help="stride-2 levels (default 3)")
    g.add_argument("--engine", choices=("auto", "torch", "spconv"),
                   help="local sparse-convolution engine (default auto: spconv on GPU and on "
                   "one CPU thread, the own torch engine with more CPU threads)")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="data directory (seg: train.h5/val.h5; cls: "
                   "ModelNet-layout train*/test*.h5); default: synthetic data made on first use")
    g.add_argument("--voxel-size", type=_positive_float, metavar="M",
                   help="voxel edge in metres (default 0.05 seg, 0.08 cls)")
    g.add_argument("--augment", action=argparse.BooleanOptionalAction,
                   help="random flips and x-y swaps (the grid's symmetries) plus jitter of "
                   "training points (default on)")
    g.add_argument("--input", choices=INPUTS,
                   help="how a spatial group gets its samples: whole (every rank reads and "
                   "voxelizes the whole batch, then keeps its box) or distributed (each rank reads "
                   "only its share of every sample's points and the voxels move to their owners: "
                   "memory and input time per rank fall with the grid, same result); default "
                   "auto: distributed for seg on a spatial grid without pipeline stages, "
                   "micro-batches or --prefetch")
    g.add_argument("--prefetch", action=argparse.BooleanOptionalAction,
                   help="read and voxelize the next step's samples on a host thread while this "
                   "step computes (default: on with --device cuda, off on a CPU, whose cores the "
                   "ranks' compute already takes; same result either way; not with --input "
                   "distributed, whose reading is collective)")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=_positive_int, help="passes over the training set "
                   "(default 8 seg, 4 cls)")
    g.add_argument("--steps", type=_positive_int, help="optimizer steps (overrides --epochs); "
                   "a resumed run may ask for more than the checkpoint's run did")
    g.add_argument("--batch-size", type=_positive_int, help="GLOBAL batch (samples per step over "
                   "all replicas; a multiple of the replicas; default 4 seg, 32 cls)")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), help="AdamW, or SGD with momentum 0.9 "
                   "(default adamw)")
    g.add_argument("--lr", type=_positive_float, help="peak learning rate (default 0.003 adamw, "
                   "0.03 sgd)")
    g.add_argument("--weight-decay", type=_nonneg_float, help="default 1e-4")
    g.add_argument("--schedule", choices=("cosine", "constant"), help="learning-rate schedule "
                   "over all steps (default cosine). A function of (step, total steps, --lr, "
                   "--warmup) taken from the current options, also on --resume: a longer run "
                   "continues on the cosine of its new total")
    g.add_argument("--warmup", type=_nonneg_int, help="linear warm-up steps (default 0)")
    g.add_argument("--seed", type=_seed, help="seeds model init, data order and augmentation "
                   "(default 0)")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--out", metavar="DIR", help="run directory (default runs/<task>-<timestamp>)")
    g.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON) of the "
                   "training steps: one row per rank with its forward, backward, stage send/"
                   "receive, halo-wait, all-reduce and step spans (open in ui.perfetto.dev)")
    g.add_argument("--trace-steps", type=_positive_int, metavar="N", help="the steps --trace and "
                   "--plot hold: this run's first N (default 20; the spans of every step of a "
                   "long run would grow without bound, and on a GPU each span waits for it)")
    g.add_argument("--plot", metavar="FILE.png", help="draw the same timeline (one row per "
                   "rank, idle time in grey) with matplotlib, the plot extra (pip install "
                   "'sparsepipe_hpc[plot]'); with or without --trace")
    g.add_argument("--resume", metavar="CKPT|auto", help="continue from a checkpoint; auto: "
                   "<out>/last.pt when it exists, else start afresh")
    g.add_argument("--checkpoint-every", type=_nonneg_int, metavar="N",
                   help="also write <out>/last.pt every N steps (default 100; 0: only at "
                   "the end and on SIGTERM)")
    g.add_argument("--eval-every", type=_nonneg_int, metavar="N",
                   help="evaluate on the validation split every N steps (0: only at the end)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="progress bar on rank 0 (default on)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--grid", type=_grid, metavar="X,Y,Z", help="spatial ranks per replica "
                   "(default 1,1,1)")
    g.add_argument("--replicas", type=_positive_int, metavar="R", help="data-parallel replicas "
                   "(default: world size / (stages x grid product))")
    g.add_argument("--stages", type=_positive_int, metavar="S", help="pipeline stages: the "
                   "model's blocks cut into S groups of ranks (default 1: no pipeline)")
    g.add_argument("--balance", metavar="N,N,...", help="blocks per pipeline stage, one count "
                   "per stage summing to the model's blocks (default: as equal as counts allow)")
    g.add_argument("--stage-order", metavar="S,S,...", help="which launched stage's ranks run "
                   "each pipeline stage (a planner's pick on devices of unequal speed or memory): "
                   "1,0 runs stage 0 on the ranks launched as stage 1 and stage 1 on stage 0's "
                   "(default: the launch's order)")
    g.add_argument("--micro-batches", type=_positive_int, metavar="M", help="whole-sample "
                   "micro-batches per replica's batch in the pipeline (default 1); BatchNorm "
                   "normalizes each micro-batch by its own statistics (GPipe's semantics)")
    g.add_argument("--pipeline-schedule", choices=("gpipe", "1f1b"), help="pipeline schedule "
                   "(default 1f1b; --schedule is the learning-rate schedule)")
    g.add_argument("--deferred-bn", action=argparse.BooleanOptionalAction, help="BatchNorm "
                   "running statistics updated once per mini-batch from all its micro-batches "
                   "(torchgpipe's DeferredBatchNorm) instead of once per micro-batch (default "
                   "off: the run then equals one process with the same --micro-batches); loss "
                   "and gradients are the same either way")
    g.add_argument("--plan", metavar="FILE|auto", help="take --replicas, --grid, --stages, "
                   "--balance, --stage-order, --micro-batches and --pipeline-schedule from a "
                   "planner's JSON (python -m sparsepipe_hpc.plan --json FILE), or auto: "
                   "profile the model on the data and pick the fastest predicted layout for this "
                   "job's ranks within the memory each has free (options set explicitly are "
                   "kept)")
    g.add_argument("--cuts", choices=("balanced", "uniform"), help="spatial cut placement "
                   "(default balanced)")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                   help="overlap halo exchange with the interior convolution (default on)")
    g.add_argument("--threads", type=_positive_int, metavar="N", help="compute threads per rank "
                   "(default 1 on CPU; on a GPU the rank's share of the node's cores, for the "
                   "host-side data work; spconv's CPU kernels always run on one)")
    g.add_argument("--grad-bucket-mb", type=_nonneg_float, metavar="MB", help="gradient "
                   "all-reduce in buckets of this many MiB, each started during backward as soon "
                   "as its gradients are final (default 4); 0: one flat all-reduce after backward")
    g.add_argument("--transport", choices=TRANSPORTS, help="how ranks exchange data (default "
                   "auto: mpi on CPU); nccl, ipc and staged move device tensors and need "
                   "--device cuda")
    g = p.add_argument_group("device and precision")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where each rank computes "
                   "(default auto: the GPU launch.device gives this local rank when torch sees "
                   "CUDA, else the CPU); cuda without a CUDA device is an error")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="fp32, or mixed "
                   "precision under torch.autocast: convolutions and activations in bf16/fp16, "
                   "float32 master weights, BatchNorm statistics and reductions in float32 or "
                   "wider; fp16 adds dynamic loss scaling (default fp32)")
    return p


def _toml_tokens(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """Turn a TOML config file into command-line tokens (placed before the real ones, so the
    command line wins under argparse's last-one-wins rule)."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    actions = parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    tokens: list[str] = []
    # An option's dest -> the key that set it: `micro_batches` and `micro-batches`, or
    # `augment` and `no_augment`, set one option, and the last would win unseen.
    seen: dict[str, str] = {}
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            known = sorted(s[2:] for s in actions if s.startswith("--")
                           and s not in ("--config", "--help"))
            raise ConfigError(f"--config {path}: unknown key {key!r}; keys are the option names: "
                              f"{', '.join(known)}")
        if action.dest in seen:
            raise ConfigError(f"--config {path}: keys {seen[action.dest]!r} and {key!r} both set "
                              f"--{action.dest.replace('_', '-')}; keep one")
        seen[action.dest] = key
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: key {key!r} must be true or false; "
                                  f"got {value!r}")
            negated = flag.startswith("--no-")
            base = flag[5:] if negated else flag[2:]
            tokens.append(f"--{base}" if value != negated else f"--no-{base}")
        elif isinstance(value, (dict, bool)):
            raise ConfigError(f"--config {path}: key {key!r} must be a "
                              f"{'string or number' if key != 'grid' else 'list like [2, 1, 1]'}"
                              f"; got {value!r}")
        elif isinstance(value, list):
            if flag != "--grid":
                raise ConfigError(f"--config {path}: key {key!r} takes one value; got {value!r}")
            tokens += [flag, ",".join(str(v) for v in value)]
        else:
            tokens += [flag, str(value)]
    # Check the file's values alone first, so an error names the file rather than the command line.
    try:
        parser.parse_args(tokens)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    return tokens


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) with its ``--config`` file into a TrainConfig."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    first = parser.parse_args(argv)
    tokens = _toml_tokens(parser, Path(first.config)) if first.config else []
    ns = parser.parse_args(tokens + argv)
    given = {k: v for k, v in vars(ns).items() if v is not None}
    return resolve(given)


def resolve(given: dict[str, Any]) -> TrainConfig:
    """Fill task defaults into the options that were set (names as TrainConfig fields)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(given) - fields
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}; known: {sorted(fields)}")
    given = _apply_plan(given)
    task = given.get("task", "seg")
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
    values = {**TASK_DEFAULTS[task], **given,
              "defaulted": tuple(k for k in TASK_DEFAULTS[task] if k not in given)}
    model = values["model"]
    if model not in MODEL_TASK:
        raise ConfigError(f"--model must be one of {', '.join(sorted(MODEL_TASK))}; got {model!r}")
    if MODEL_TASK[model] != task:
        want = [m for m, t in MODEL_TASK.items() if t == task]
        raise ConfigError(f"--model {model} is a {MODEL_TASK[model]} model but --task is {task}; "
                          f"pass --model {' or '.join(want)}")
    if "lr" not in given:
        values["lr"] = values["lr"] * OPTIMIZER_LR_SCALE[values.get("optimizer", "adamw")]
    if values.get("balance") is not None:  # one spelling, for the checkpoint's comparison
        values["balance"] = ",".join(map(str, _balance(values["balance"], None)))
    if values.get("stage_order") is not None:  # one spelling, as balance
        values["stage_order"] = ",".join(x.strip() for x in str(values["stage_order"]).split(","))
    cfg = TrainConfig(**values)
    check_input_options(cfg)
    try:
        choose_transport(cfg.transport, "cpu" if cfg.device == "cpu" else None)
    except TransportError as e:
        raise ConfigError(str(e)) from None
    if cfg.resume == "auto" and cfg.out is None:
        raise ConfigError("--resume auto looks for <out>/last.pt, so it needs --out DIR")
    if cfg.trace is not None and Path(cfg.trace).is_dir():  # found now, not after training
        raise ConfigError(f"--trace {cfg.trace} is a directory but names the trace file to "
                          f"write; pass a file such as {Path(cfg.trace) / 'trace.json'}")
    if cfg.plot is not None:
        if Path(cfg.plot).is_dir():
            raise ConfigError(f"--plot {cfg.plot} is a directory but names the picture to "
                              f"write; pass a file such as {Path(cfg.plot) / 'timeline.png'}")
        from sparsepipe_hpc.plot import PlotError, require_matplotlib

        try:  # missing before training, not after it
            require_matplotlib()
        except PlotError as e:
            raise ConfigError(str(e)) from None
    return cfg


def _apply_plan(given: dict[str, Any]) -> dict[str, Any]:
    """``--plan FILE``: its layout values, refusing any that contradict an option set explicitly;
    ``--plan auto``: remember which layout options were set (the search keeps them)."""
    from sparsepipe_hpc.plan.planfile import LAYOUT_FLAGS, PlanFileError, layout_options, read_plan

    plan = given.get("plan")
    if plan is None:
        return given
    if plan == "auto":
        return {**given, "plan_fixed": tuple(k for k in LAYOUT_FLAGS if k in given)}
    try:
        checked = read_plan(plan)
    except PlanFileError as e:
        raise ConfigError(str(e)) from None
    out = dict(given)
    for key, value in layout_options(checked).items():
        if key in given and given[key] != value:
            show = (lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v))
            raise ConfigError(f"{LAYOUT_FLAGS[key]} {show(given[key])} contradicts --plan {plan}, "
                              f"which sets {LAYOUT_FLAGS[key]} {show(value)}; drop "
                              f"{LAYOUT_FLAGS[key]} or the plan")
        out[key] = value
    out["plan_ranks"] = checked["ranks"]
    return out


def check_input_options(cfg: TrainConfig) -> None:
    """ConfigError for ``--input distributed`` with a layout or option it cannot serve; run on
    the options given, and again on the layout ``--plan auto`` picks (:func:`resolve_layout`)."""
    if cfg.input == "distributed" and (cfg.task != "seg" or cfg.stages > 1
                                       or cfg.micro_batches > 1):
        raise ConfigError(f"--input distributed reads scenes (--task seg) for an unpipelined "
                          f"spatial group (no --stages or --micro-batches; here --task "
                          f"{cfg.task}, --stages {cfg.stages}, --micro-batches "
                          f"{cfg.micro_batches}); use --input whole")
    if cfg.prefetch and cfg.input == "distributed":
        raise ConfigError("--prefetch reads the next samples on a host thread, but --input "
                          "distributed reads them collectively (each rank its share, through "
                          "MPI collectives that cannot run beside the step's); pass --input "
                          "whole, or --no-prefetch")


def distributed_input(cfg: TrainConfig) -> bool:
    """Whether each spatial rank reads only its share of the samples (``--input``; auto: for
    seg on a spatial grid, without pipeline stages, micro-batches or ``--prefetch``)."""
    if cfg.input == "auto":
        return (cfg.task == "seg" and math.prod(cfg.grid) > 1 and cfg.stages == 1
                and cfg.micro_batches == 1 and not cfg.prefetch)
    return cfg.input == "distributed"


def use_prefetch(cfg: TrainConfig, device_type: str) -> bool:
    """Whether the trainer reads each next batch ahead (``--prefetch``; by default on a GPU, where
    the host is free while the device computes, with whole-sample input)."""
    if cfg.prefetch is not None:
        return bool(cfg.prefetch)
    return device_type == "cuda" and not distributed_input(cfg)


def _balance(balance: str, stages: Optional[int]) -> tuple[int, ...]:
    from sparsepipe_hpc.pipeline.carry import PipelineError, parse_balance

    try:
        return parse_balance(balance, None, stages)
    except PipelineError as e:
        raise ConfigError(str(e)) from None


def stage_order(cfg: TrainConfig) -> Optional[tuple[int, ...]]:
    """``--stage-order`` checked against ``--stages`` (ConfigError), or None (the launch's)."""
    if cfg.stage_order is None:
        return None
    try:
        return parse_stage_order(cfg.stage_order, cfg.stages, name="--stage-order")
    except LayoutError as e:
        raise ConfigError(f"{e}; --stages is {cfg.stages}") from None


def fit_default_batch(cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, Optional[str]]:
    """(``cfg``, note): where ``--batch-size`` was left at its task default and that does not
    split over the job's replicas (``mpirun -n 8`` on the seg default of 4), the least multiple
    of the replicas above it, and a line saying so; an explicit ``--batch-size`` is kept (and
    :func:`resolve_layout` names what to pass)."""
    if "batch_size" not in cfg.defaulted:
        return cfg, None
    try:
        replicas = RankLayout.from_world(world_size, cfg.grid, cfg.replicas,
                                         stages=cfg.stages).replicas
    except LayoutError:
        return cfg, None  # resolve_layout says what is wrong
    if cfg.batch_size % replicas == 0:
        return cfg, None
    batch = -(-cfg.batch_size // replicas) * replicas
    note = (f"--batch-size {batch}: the {cfg.task} default {cfg.batch_size} does not split over "
            f"{replicas} replicas (pass --batch-size to choose)")
    return dataclasses.replace(cfg, batch_size=batch), note


def option_notes(cfg: TrainConfig) -> list[str]:
    """Lines saying which given options change nothing, or not what they seem to: accepted, as a
    run may mean them (a short trial of a long run's options), but never silently."""
    notes = []
    if cfg.steps is not None and 0 < cfg.steps <= cfg.warmup:
        notes.append(f"note: --warmup {cfg.warmup} is not shorter than --steps {cfg.steps}: the "
                     f"learning rate rises for the whole run and never reaches --lr {cfg.lr:g}")
    unpipelined = cfg.stages == 1 and cfg.micro_batches == 1
    if unpipelined and cfg.deferred_bn:
        notes.append("note: --deferred-bn changes nothing without --stages or --micro-batches "
                     "(BatchNorm's statistics are updated once per step already)")
    if unpipelined and cfg.pipeline_schedule != TrainConfig.pipeline_schedule:
        notes.append(f"note: --pipeline-schedule {cfg.pipeline_schedule} changes nothing without "
                     "--stages or --micro-batches")
    if cfg.trace_steps != TrainConfig.trace_steps and not (cfg.trace or cfg.plot):
        notes.append(f"note: --trace-steps {cfg.trace_steps} changes nothing without --trace or "
                     "--plot")
    if tuple(cfg.grid) == (1, 1, 1):
        given = [f"--cuts {cfg.cuts}"] * (cfg.cuts != TrainConfig.cuts) \
            + ["--no-overlap"] * (not cfg.overlap)
        if given:
            notes.append(f"note: {' and '.join(given)} change(s) nothing on a 1x1x1 --grid "
                         "(no sample is split)")
    return notes


def resolve_layout(cfg: TrainConfig, world_size: int) -> RankLayout:
    """The rank layout for ``world_size`` ranks, checking that the global batch splits evenly
    (and, where ``--plan auto`` picked the layout, the options against it)."""
    check_input_options(cfg)
    if cfg.balance is not None:  # one block count per stage, also where no pipeline reads it
        _balance(cfg.balance, cfg.stages)
    stage_order(cfg)
    grid = cfg.grid or (1, 1, 1)
    if cfg.plan_ranks is not None and cfg.plan_ranks != world_size:
        raise ConfigError(f"--plan {cfg.plan} lays out {cfg.plan_ranks} ranks but the job has "
                          f"{world_size}; start {cfg.plan_ranks} ranks, or plan for {world_size} "
                          f"(python -m sparsepipe_hpc.plan --ranks {world_size}, or --plan auto)")
    if cfg.replicas is None and world_size % math.prod(grid):
        # Said in the trainer's options (the layout's own message is in library terms).
        raise ConfigError(f"--grid {','.join(map(str, grid))} uses {math.prod(grid)} ranks per "
                          f"replica, which does not divide the {world_size} ranks of the job; "
                          f"pass a --grid whose product divides {world_size}, or start a "
                          f"multiple of {math.prod(grid)} ranks")
    try:
        layout = RankLayout.from_world(world_size, cfg.grid, cfg.replicas, stages=cfg.stages)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if cfg.batch_size % layout.replicas:
        raise ConfigError(f"--batch-size {cfg.batch_size} cannot be split over {layout.replicas} "
                          f"replicas; pass a multiple of {layout.replicas}")
    local = cfg.batch_size // layout.replicas
    if cfg.micro_batches > local:
        raise ConfigError(f"--micro-batches {cfg.micro_batches} needs at least that many samples "
                          f"per replica, but --batch-size {cfg.batch_size} over {layout.replicas} "
                          f"replica(s) gives {local}; micro-batches are whole samples: pass "
                          f"--micro-batches {local} or less, or a larger --batch-size")
    if local > MAX_BATCH:  # a replica's samples form one SparseTensor, whose keys hold 8 bits
        raise ConfigError(f"--batch-size {cfg.batch_size} puts {local} samples on each of "
                          f"{layout.replicas} replica(s); a replica takes at most {MAX_BATCH} "
                          f"per step: pass --batch-size {MAX_BATCH * layout.replicas} or less, "
                          "or run more replicas (ranks)")
    return layout


def local_batch_size(cfg: TrainConfig, layout: RankLayout) -> int:
    """Samples per step that one replica (all its spatial ranks together) processes."""
    return cfg.batch_size // layout.replicas
