"""Job scripts for SLURM, PBS Pro and one machine, filled from options or a planner's plan.

Usage::

    python -m launch job --scheduler slurm --nodes 4 --gpus-per-node 8 --time 02:00:00 \\
        --account proj42 -- --epochs 10 > job.sh && sbatch job.sh
    python -m launch job --scheduler pbs --plan plan.json --queue gpu > job.pbs && qsub job.pbs
    python -m launch job --scheduler local --cpu-only --ranks-per-node 4 > run.sh && bash run.sh

    from launch.jobs import JobSpec, render
    print(render(JobSpec("slurm", nodes=2, gpus_per_node=4, trainer_args=("--epochs", "3"))))

Templates are plain shell scripts under ``jobs/<scheduler>/{gpu,cpu}.sh`` in the repository, with
``{{name}}`` placeholders (double braces, so the shell's own ``${VAR}`` needs no escaping). A line
that is a lone placeholder and renders empty (an optional ``#SBATCH --account``) is dropped. Every
value that lands outside quotes (names, accounts, times) is checked against a strict pattern first;
trainer arguments are shell-quoted. The ``jobs/`` folder is found next to the ``launch`` package (an
editable install or a checkout), else from ``--templates DIR`` or ``$SPARSEPIPE_JOBS``.

A plan (JSON, from the planner) gives at least ``nodes``, ``gpus_per_node`` (or ``ranks_per_node``),
``grid`` ``[x, y, z]``, ``replicas`` and ``stages``; its layout must fill the job exactly
(``replicas * stages * x * y * z == nodes * gpus_per_node``), and it adds ``--grid x,y,z
--replicas R`` (plus ``--stages S`` when S > 1 and ``--micro-batches M`` when the plan has
``micro_batches``, ``--balance`` for a pipeline with ``balance`` and ``--pipeline-schedule``)
before the trainer arguments given after ``--``. The planner's ``--json`` output (``{"plans":
[chosen, ...]}``) is read as its chosen plan.

A trainer job given ``--out`` and no ``--resume`` gets ``--resume auto``: a job the scheduler
requeues (after a node failure) or that is submitted again continues from the checkpoint its
SIGTERM wrote, where it would start over and replace it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from launch.errors import LaunchError

__all__ = ["JobSpec", "render", "fill", "context", "find_templates", "template_path", "load_plan",
           "spec_from_plan", "SCHEDULERS", "MPI_FLAVOURS", "main"]

SCHEDULERS = ("slurm", "pbs", "local")
#: How ``mpiexec`` is spelled (PBS) or which ``mpirun`` runs (local): Open MPI, MPICH/Hydra,
#: Intel MPI (Hydra), HPE Cray PALS.
MPI_FLAVOURS = ("openmpi", "mpich", "intelmpi", "pals")
TEMPLATES_VARIABLE = "SPARSEPIPE_JOBS"
DEFAULT_CPUS_PER_RANK = 8  # a GPU rank's host threads; a CPU rank computes on 1 (train --threads)
DEFAULT_CPU_RANKS_PER_NODE = 4

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# SLURM's time forms but a bare number: [D-]H..., with minutes and seconds after colons.
_TIME = re.compile(r"^(?:(\d{1,3})-)?(\d{1,5})(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_MAX_SIGNAL_LEAD = 0xFFFF  # sbatch --signal refuses a longer warning time
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$")
_WORD = re.compile(r"^[A-Za-z0-9_.@+,-]{1,128}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Variables the scripts export and Open MPI's mpiexec must forward (-x) to other nodes.
_FORWARD_CPU = ("PATH", "OMP_NUM_THREADS", "SPARSEPIPE_THREADS", "PYTHONUNBUFFERED",
                "PYTHONFAULTHANDLER")
_FORWARD_GPU = _FORWARD_CPU + ("NCCL_DEBUG", "UCX_WARN_UNUSED_ENV_VARS")


@dataclass(frozen=True)
class JobSpec:
    """What to ask the scheduler for, and what to run.

    ``gpus_per_node == 0`` makes a CPU-only job. Ranks per node default to the GPUs per node (one
    rank per GPU, the only layout a GPU job allows), or to 4 for CPU-only jobs. ``cpus_per_rank``
    defaults to 8 for a GPU rank on a cluster (the host reads and voxelizes its samples), 1 for a
    CPU rank (the trainer computes on one thread there) and "cores / ranks" on one machine.
    ``time``: ``HH:MM:SS``, ``MM:SS`` or ``D-HH[:MM[:SS]]`` as SLURM reads them, written to the
    script as ``HH:MM:SS``; ``signal_lead`` is how many seconds before it SLURM sends SIGTERM
    (the trainer's last checkpoint); ``mpi`` picks the ``mpiexec`` of PBS and the ``mpirun`` of a
    local run.
    """

    scheduler: str
    nodes: int = 1
    gpus_per_node: int = 4
    ranks_per_node: int | None = None
    cpus_per_rank: int | None = None
    time: str = "01:00:00"
    account: str | None = None
    queue: str | None = None
    job_name: str = "sparsepipe"
    mpi: str = "openmpi"
    module: str = "sparsepipe_hpc.train"
    signal_lead: int = 120
    trainer_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise LaunchError(f"scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.mpi not in MPI_FLAVOURS:
            raise LaunchError(f"mpi {self.mpi!r} is not one of {', '.join(MPI_FLAVOURS)}")
        _check_count("nodes", self.nodes, 1)
        _check_count("gpus_per_node", self.gpus_per_node, 0)
        if self.scheduler == "local" and self.nodes != 1:
            raise LaunchError(f"nodes {self.nodes}: a local run uses one machine (nodes 1); "
                              "use --scheduler slurm or pbs for more")
        if self.ranks_per_node is not None:
            _check_count("ranks_per_node", self.ranks_per_node, 1)
            if self.gpus_per_node and self.ranks_per_node != self.gpus_per_node:
                raise LaunchError(f"ranks_per_node {self.ranks_per_node} != gpus_per_node "
                                  f"{self.gpus_per_node}: a GPU job runs one rank per GPU; "
                                  "use --cpu-only for other layouts")
        if self.cpus_per_rank is not None:
            _check_count("cpus_per_rank", self.cpus_per_rank, 1)
        total = self.seconds
        _check_count("signal_lead", self.signal_lead, 1)
        if self.scheduler == "slurm" and self.signal_lead >= total:
            raise LaunchError(f"signal_lead (--signal-lead) {self.signal_lead} s, when SLURM "
                              f"warns the job before its limit, is not shorter than the time "
                              f"limit {self.time} ({total} s): pass a longer --time or a "
                              f"smaller --signal-lead")
        if self.scheduler == "slurm" and self.signal_lead > _MAX_SIGNAL_LEAD:
            raise LaunchError(f"signal_lead (--signal-lead) {self.signal_lead} s is more than "
                              f"sbatch's --signal takes ({_MAX_SIGNAL_LEAD} s)")
        if not _NAME.match(self.job_name):
            raise LaunchError(f"job_name {self.job_name!r} must start with a letter and hold "
                              "only letters, digits, '_', '.', '-' (at most 63)")
        for name in ("account", "queue"):
            value = getattr(self, name)
            if value is not None and not _WORD.match(value):
                raise LaunchError(f"{name} {value!r} may hold only letters, digits and "
                                  "'_.@+,-' (it goes into a #SBATCH/#PBS line unquoted)")
        if not _MODULE.match(self.module):
            raise LaunchError(f"module {self.module!r} is not a dotted Python module name")

    @property
    def seconds(self) -> int:
        """The time limit in seconds, from ``time`` in any of SLURM's forms but a bare number
        (``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``)."""
        return _time_seconds(self.time)

    @property
    def walltime(self) -> str:
        """The time limit as ``H:MM:SS`` (hours past 24 as they are), which SLURM and PBS read."""
        minutes, seconds = divmod(self.seconds, 60)
        return f"{minutes // 60:02d}:{minutes % 60:02d}:{seconds:02d}"

    @property
    def cpu_only(self) -> bool:
        return self.gpus_per_node == 0

    @property
    def ranks(self) -> int:
        """Ranks per node."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return self.gpus_per_node or DEFAULT_CPU_RANKS_PER_NODE

    @property
    def ntasks(self) -> int:
        """MPI ranks in the job: nodes x ranks per node."""
        return self.nodes * self.ranks


def _time_seconds(text: str) -> int:
    """Seconds in the time limit ``text`` (see :attr:`JobSpec.seconds`)."""
    match = _TIME.match(text.strip())
    if match is None:
        raise LaunchError(f"time {text!r} is not HH:MM:SS, MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
                          "(e.g. 02:30:00, 1-12:00): the trainer's last checkpoint needs a "
                          "finite limit")
    days, first, *rest = match.groups()
    if days is None and rest[0] is None:
        minutes = int(first)
        raise LaunchError(f"time {text!r} is ambiguous (minutes to SLURM, seconds to PBS): write "
                          f"{minutes // 60:02d}:{minutes % 60:02d}:00 for {minutes} minutes")
    if days is not None:  # D-HH[:MM[:SS]]
        fields = [int(days) * 24 + int(first)] + [int(r or 0) for r in rest]
        if int(first) >= 24:
            raise LaunchError(f"time {text!r}: the hours after the days must be below 24")
    elif rest[1] is None:  # MM:SS, the minutes unbounded ("90:00" is 90 minutes)
        fields = [0, int(first), int(rest[0])]
    else:  # HH:MM:SS
        fields = [int(first), int(rest[0]), int(rest[1])]
    hours, minutes, seconds = fields
    after_colon = [seconds] + ([minutes] if days is not None or rest[1] is not None else [])
    if max(after_colon) >= 60:
        raise LaunchError(f"time {text!r}: minutes and seconds after a colon must be below 60")
    total = hours * 3600 + minutes * 60 + seconds
    if total == 0:
        raise LaunchError(f"time {text!r} is zero")
    return total


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(f"{name} {value!r} must be an integer >= {minimum}")


# --------------------------------------------------------------------------------------------------
# Plans


def load_plan(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a plan: nodes, gpus_per_node (or ranks_per_node), grid, replicas, stages."""
    try:
        with open(path, encoding="utf-8") as handle:
            plan = json.load(handle)
    except OSError as err:
        raise LaunchError(f"plan {os.fspath(path)!r} cannot be read: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise LaunchError(f"plan {os.fspath(path)!r} is not JSON: {err}") from None
    if not isinstance(plan, dict):
        raise LaunchError(f"plan {os.fspath(path)!r} must be a JSON object, got "
                          f"{type(plan).__name__}")
    where = f"plan {os.fspath(path)!r}"
    if isinstance(plan.get("plans"), list) and plan["plans"] and isinstance(plan["plans"][0], dict):
        plan = plan["plans"][0]   # python -m sparsepipe_hpc.plan --json: the chosen plan first
    elif isinstance(plan.get("chosen"), dict):
        plan = plan["chosen"]     # a plan file as the trainer reads it
    if "gpus_per_node" not in plan and "ranks_per_node" in plan:
        plan = {**plan, "gpus_per_node": plan["ranks_per_node"]}
    if "ranks" in plan and ("nodes" not in plan or "gpus_per_node" not in plan):
        raise LaunchError(f"{where} lays out {plan['ranks']!r} ranks but names no nodes and "
                          "gpus_per_node: the planner leaves them out when its ranks do not fill "
                          "whole nodes, and a job runs as many ranks on every node; plan for a "
                          "multiple of the ranks per node")
    for key in ("nodes", "gpus_per_node", "grid", "replicas", "stages"):
        if key not in plan:
            raise LaunchError(f"{where} has no {key!r} (needs nodes, gpus_per_node, grid, "
                              "replicas, stages)")
    for key in ("nodes", "gpus_per_node", "replicas", "stages"):
        _check_count(f"{where}: {key}", plan[key], 1)
    grid = plan["grid"]
    if (not isinstance(grid, list) or len(grid) != 3
            or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid)):
        raise LaunchError(f"{where}: grid {grid!r} must be three positive integers [x, y, z]")
    if "micro_batches" in plan:
        _check_count(f"{where}: micro_batches", plan["micro_batches"], 1)
    balance = plan.get("balance")
    if balance is not None and (
            not isinstance(balance, list) or len(balance) != plan["stages"]
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance)):
        raise LaunchError(f"{where}: balance {balance!r} must list {plan['stages']} positive "
                          "block counts, one per stage")
    order = plan.get("stage_order", list(range(plan["stages"])))
    if (not isinstance(order, list) or any(isinstance(o, bool) or not isinstance(o, int)
                                           for o in order)
            or sorted(order) != list(range(plan["stages"]))):
        raise LaunchError(f"{where}: stage_order {order!r} must list each of the "
                          f"{plan['stages']} stage(s) 0..{plan['stages'] - 1} once")
    if plan.get("pipeline_schedule", "1f1b") not in ("1f1b", "gpipe"):
        raise LaunchError(f"{where}: pipeline_schedule {plan['pipeline_schedule']!r} must be "
                          "1f1b or gpipe")
    used = plan["replicas"] * plan["stages"] * math.prod(grid)
    have = plan["nodes"] * plan["gpus_per_node"]
    if used != have:
        raise LaunchError(
            f"{where}: replicas {plan['replicas']} x stages {plan['stages']} x grid "
            f"{'x'.join(map(str, grid))} = {used} ranks, but nodes {plan['nodes']} x "
            f"gpus_per_node {plan['gpus_per_node']} = {have}; the layout must fill the job")
    return plan


def plan_trainer_args(plan: Mapping[str, Any]) -> list[str]:
    """The trainer options a plan implies: ``--grid x,y,z --replicas R [--stages S ...]``
    (``--stage-order`` where the plan moves stages off the launch's order).

    ``--stages`` only for a pipelined plan (stages > 1) and ``--micro-batches`` only when the plan
    has ``micro_batches``, so that plans without a pipeline run on a trainer without one.
    """
    args = ["--grid", ",".join(map(str, plan["grid"])), "--replicas", str(plan["replicas"])]
    if plan["stages"] > 1:
        args += ["--stages", str(plan["stages"])]
    if "micro_batches" in plan:
        args += ["--micro-batches", str(plan["micro_batches"])]
    if plan["stages"] > 1 and plan.get("balance"):
        args += ["--balance", ",".join(map(str, plan["balance"]))]
    if list(plan.get("stage_order", range(plan["stages"]))) != list(range(plan["stages"])):
        args += ["--stage-order", ",".join(map(str, plan["stage_order"]))]
    if "pipeline_schedule" in plan and (plan["stages"] > 1 or plan.get("micro_batches", 1) > 1):
        args += ["--pipeline-schedule", str(plan["pipeline_schedule"])]
    return args


def spec_from_plan(plan: Mapping[str, Any], **options: Any) -> JobSpec:
    """A :class:`JobSpec` whose layout and trainer options come from ``plan``.

    ``options``: the other :class:`JobSpec` fields; ``nodes``/``gpus_per_node`` given here must
    agree with the plan, and ``trainer_args`` must not repeat an option the plan sets.
    """
    cpu_only = bool(options.pop("cpu_only", False))
    for key in ("nodes", "gpus_per_node"):
        given = options.pop(key, None)
        if given is not None and given != plan[key]:
            raise LaunchError(f"--{key.replace('_', '-')} {given} disagrees with the plan's "
                              f"{key} {plan[key]}; drop one of them")
    implied = plan_trainer_args(plan)
    user = tuple(options.pop("trainer_args", ()))
    for flag in implied[::2]:
        if any(arg == flag or arg.startswith(flag + "=") for arg in user):
            raise LaunchError(f"trainer argument {flag} is set by the plan; drop it after '--'")
    layout: dict[str, Any] = {"nodes": plan["nodes"]}
    if cpu_only:
        layout.update(gpus_per_node=0, ranks_per_node=plan["gpus_per_node"])
    else:
        layout["gpus_per_node"] = plan["gpus_per_node"]
    return JobSpec(**options, **layout, trainer_args=tuple(implied) + user)


# --------------------------------------------------------------------------------------------------
# Templates


def find_templates(override: str | os.PathLike[str] | None = None) -> Path:
    """The ``jobs/`` folder: ``override``, else ``$SPARSEPIPE_JOBS``, else beside the package."""
    if override is not None:
        root, origin = Path(override), "--templates"
    elif os.environ.get(TEMPLATES_VARIABLE):
        root, origin = Path(os.environ[TEMPLATES_VARIABLE]), f"${TEMPLATES_VARIABLE}"
    else:
        root, origin = Path(__file__).resolve().parent.parent / "jobs", "the launch package's place"
    if not all((root / scheduler).is_dir() for scheduler in SCHEDULERS):
        raise LaunchError(
            f"job templates not found: {root} (from {origin}) has no slurm/, pbs/ and local/ "
            "folders. Install the project editable (pip install -e .) from its checkout, or pass "
            f"--templates DIR (or set {TEMPLATES_VARIABLE}) to the repository's jobs/ folder")
    return root


def template_path(spec: JobSpec, root: Path) -> Path:
    """``<root>/<scheduler>/{gpu,cpu}.sh`` for ``spec``."""
    path = root / spec.scheduler / ("cpu.sh" if spec.cpu_only else "gpu.sh")
    if not path.is_file():
        raise LaunchError(f"template {path} does not exist")
    return path


def fill(text: str, values: Mapping[str, str], name: str = "template") -> str:
    """Replace every ``{{key}}`` in ``text`` by ``values[key]``; drop lines left empty by it.

    Raises :class:`LaunchError` naming the template and the placeholder when a value is missing.
    """
    missing = sorted({key for key in _PLACEHOLDER.findall(text) if key not in values})
    if missing:
        raise LaunchError(f"{name}: no value for placeholder(s) {', '.join(missing)}; known: "
                          f"{', '.join(sorted(values))}")
    lines = []
    for line in text.splitlines(keepends=True):
        filled = _PLACEHOLDER.sub(lambda m: values[m.group(1)], line)
        if filled.strip() == "" and _PLACEHOLDER.fullmatch(line.strip()):
            continue  # a lone optional directive that is not wanted
        lines.append(filled)
    return "".join(lines)


def _mpiexec(spec: JobSpec, cpus: int) -> str:
    """The PBS launcher command for ``spec.mpi`` (bash array body; one rank per slot)."""
    n, ppn = spec.ntasks, spec.ranks
    if spec.mpi == "openmpi":
        forward = " ".join(f"-x {name}" for name in
                           (_FORWARD_CPU if spec.cpu_only else _FORWARD_GPU))
        return (f'mpiexec -n {n} --hostfile "$PBS_NODEFILE" --map-by ppr:{ppn}:node:PE={cpus} '
                f"--bind-to core {forward}")
    if spec.mpi == "pals":
        return f"mpiexec -n {n} --ppn {ppn} --depth {cpus} --cpu-bind depth"
    if spec.mpi == "intelmpi":
        return f'mpiexec -n {n} -ppn {ppn} -f "$PBS_NODEFILE" -genv I_MPI_PIN_DOMAIN omp'
    return f'mpiexec -n {n} -ppn {ppn} -f "$PBS_NODEFILE" -bind-to core:{cpus}'


def _mpirun(spec: JobSpec) -> str:
    """The local launcher command (bash array body; ``$NRANKS`` ranks on this machine)."""
    if spec.mpi == "openmpi":
        return 'mpirun -n "$NRANKS" --oversubscribe --bind-to none'
    return 'mpiexec -n "$NRANKS"'


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def script_trainer_args(spec: JobSpec) -> list[str]:
    """The arguments the script passes to ``spec.module``: the trainer's ``--out`` without a
    ``--resume`` gets ``--resume auto``, so a rerun of the script continues its checkpoint."""
    args = list(spec.trainer_args)
    if (spec.module == "sparsepipe_hpc.train" and _given(args, "--out")
            and not _given(args, "--resume")):
        args += ["--resume", "auto"]
    return args


def context(spec: JobSpec, command: str = "") -> dict[str, str]:
    """Every placeholder's value for ``spec``; ``command`` is echoed in the script's header."""
    local = spec.scheduler == "local"
    cpus = spec.cpus_per_rank or (1 if spec.cpu_only else DEFAULT_CPUS_PER_RANK)
    directive = {"slurm": ("#SBATCH --account={}", "#SBATCH --partition={}"),
                 "pbs": ("#PBS -A {}", "#PBS -q {}"),
                 "local": ("", "")}[spec.scheduler]
    return {
        "job_name": spec.job_name,
        "nodes": str(spec.nodes),
        "gpus_per_node": str(spec.gpus_per_node),
        "ranks_per_node": str(spec.ranks),
        "ntasks": str(spec.ntasks),
        "cpus_per_rank": "auto" if local and spec.cpus_per_rank is None else str(cpus),
        "cpus_per_node": str(spec.ranks * cpus),
        "time": spec.walltime,
        "signal_lead": str(spec.signal_lead),
        "account_directive": directive[0].format(spec.account) if spec.account else "",
        "queue_directive": directive[1].format(spec.queue) if spec.queue else "",
        "mpiexec": _mpiexec(spec, cpus),
        "mpirun": _mpirun(spec),
        "mpirun_root": ('if [ "$(id -u)" -eq 0 ]; then MPIRUN+=(--allow-run-as-root); fi'
                        if spec.mpi == "openmpi" else ""),
        "module": spec.module,
        "trainer_args": shlex.join(script_trainer_args(spec)),
        "command": (command or "(library call)").replace("\n", "\\n"),
    }


def render(spec: JobSpec, templates: str | os.PathLike[str] | None = None,
           command: str = "") -> str:
    """The job script for ``spec``, from the templates in :func:`find_templates` ``(templates)``."""
    path = template_path(spec, find_templates(templates))
    return fill(path.read_text(encoding="utf-8"), context(spec, command), str(path))


# --------------------------------------------------------------------------------------------------
# python -m launch job


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch job",
        usage="python -m launch job --scheduler {slurm,pbs,local} [options] [-- trainer args]",
        description="Print a job script that runs 'python -m launch run -m <module> <trainer "
                    "args>' with one rank per GPU (or CPU ranks), threads and NCCL/UCX set.")
    add = parser.add_argument
    add("--scheduler", required=True, choices=SCHEDULERS)
    add("--nodes", type=int, help="nodes (default 1, or the plan's)")
    add("--gpus-per-node", type=int,
        help="GPUs per node = ranks per node (default 4, or the plan's); with --cpu-only, the "
             "ranks per node unless --ranks-per-node is given")
    add("--cpu-only", action="store_true", help="no GPUs: CPU ranks, no NCCL")
    add("--ranks-per-node", type=int,
        help=f"CPU-only ranks per node (default {DEFAULT_CPU_RANKS_PER_NODE})")
    add("--cpus-per-rank", type=int,
        help=f"CPU cores (threads) per rank (default {DEFAULT_CPUS_PER_RANK} per GPU rank, 1 per "
             "CPU rank, which the trainer computes on; local: cores / ranks)")
    add("--time", help="wall-clock limit HH:MM:SS, MM:SS or D-HH[:MM[:SS]] (default 01:00:00)")
    add("--account", help="account / project to charge (#SBATCH --account, #PBS -A)")
    add("--partition", "--queue", dest="queue", help="partition (SLURM) or queue (PBS)")
    add("--job-name", default="sparsepipe")
    add("--mpi", choices=MPI_FLAVOURS,
        help="MPI whose mpiexec/mpirun the PBS and local scripts call (default openmpi)")
    add("--module", default="sparsepipe_hpc.train", help="module to run (default %(default)s)")
    add("--signal-lead", type=int,
        help="SLURM: seconds before the time limit to send SIGTERM for a last checkpoint "
             "(default 120)")
    add("--plan", help="plan JSON from the planner: nodes, gpus_per_node, grid, replicas, stages")
    add("--templates",
        help=f"the jobs/ folder (default: beside the package, or ${TEMPLATES_VARIABLE})")
    return parser


def ignored_options(options: argparse.Namespace) -> list[str]:
    """The options given that the scheduler's script does not use."""
    unused = {"local": ("time", "account", "queue", "signal_lead"), "slurm": ("mpi",),
              "pbs": ("signal_lead",)}[options.scheduler]
    flags = {"queue": "--partition/--queue", "mpi": "--mpi"}
    return [flags.get(name, "--" + name.replace("_", "-")) for name in unused
            if getattr(options, name) is not None]


def spec_from_options(options: argparse.Namespace, trainer_args: Sequence[str]) -> JobSpec:
    given = {name: getattr(options, name) for name in ("time", "mpi", "signal_lead")}
    common: dict[str, Any] = dict(  # options not given take JobSpec's defaults
        scheduler=options.scheduler, cpus_per_rank=options.cpus_per_rank, account=options.account,
        queue=options.queue, job_name=options.job_name, module=options.module,
        **{name: value for name, value in given.items() if value is not None})
    if options.plan:
        if options.ranks_per_node is not None:
            raise LaunchError("--ranks-per-node conflicts with --plan (the plan sets the layout)")
        return spec_from_plan(load_plan(options.plan), nodes=options.nodes,
                              gpus_per_node=options.gpus_per_node, cpu_only=options.cpu_only,
                              trainer_args=tuple(trainer_args), **common)
    nodes = 1 if options.nodes is None else options.nodes
    if options.cpu_only:
        ranks = options.ranks_per_node if options.ranks_per_node is not None else (
            options.gpus_per_node or DEFAULT_CPU_RANKS_PER_NODE)
        return JobSpec(nodes=nodes, gpus_per_node=0, ranks_per_node=ranks,
                       trainer_args=tuple(trainer_args), **common)
    gpus = 4 if options.gpus_per_node is None else options.gpus_per_node
    if gpus < 1:
        raise LaunchError(f"--gpus-per-node {gpus} must be >= 1; use --cpu-only for a CPU job")
    return JobSpec(nodes=nodes, gpus_per_node=gpus, ranks_per_node=options.ranks_per_node,
                   trainer_args=tuple(trainer_args), **common)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m launch job ... [-- trainer args]``: print the rendered script on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args.index("--") if "--" in args else len(args)
    ours, trainer_args = args[:cut], args[cut + 1:]
    parser = _parser()
    options = parser.parse_args(ours)
    command = shlex.join(["python", "-m", "launch", "job", *args])
    try:
        spec = spec_from_options(options, trainer_args)
        script = render(spec, options.templates, command)
    except LaunchError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    for flag in ignored_options(options):
        print(f"{parser.prog}: note: {flag} does nothing for --scheduler {options.scheduler}",
              file=sys.stderr)
    if options.time and options.time.count(":") == 1 and "-" not in options.time:
        print(f"{parser.prog}: note: --time {options.time} is MM:SS, as SLURM reads it: "
              f"{spec.walltime}; write HH:MM:00 for hours and minutes", file=sys.stderr)
    sys.stdout.write(script)
