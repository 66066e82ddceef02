"""Who am I: this process's rank, world size, local rank, local size and node, under any launcher.

Usage::

    from launch.env import detect, threads_per_rank

    placement = detect()                  # launcher variables first; MPI split as the fallback
    torch.set_num_threads(threads_per_rank(placement))
    print(placement.rank, placement.size, placement.local_rank, placement.node)

Launchers recognised, first match wins (``Placement.launcher`` in brackets)::

    Open MPI    [openmpi]   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    MVAPICH     [mvapich]   MV2_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    PBS + PALS  [pals]      PALS_RANKID, PALS_LOCAL_RANKID, PALS_NODEID; sizes from PMI_SIZE and
                            PMI_LOCAL_SIZE, else from the lines of PBS_NODEFILE (one per process)
    Intel MPI   [intelmpi]  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (Hydra), and some
                            I_MPI_* variable
    MPICH       [mpich]     the same Hydra variables, no I_MPI_*
    SLURM srun  [slurm]     SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID,
                            SLURM_STEP_TASKS_PER_NODE (``4(x2),3``), SLURM_NODEID, SLURMD_NODENAME
    Cray PMI    [pmi]       PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK, PMI_LOCAL_SIZE
    otherwise   [mpi]       a COMM_TYPE_SHARED split of the communicator (collective)
                [none]      no launcher and no MPI: a lone process

The order matters. An ``mpirun`` inside a SLURM or PBS job starts its daemons with ``srun`` or the
PBS task manager, so every rank inherits the *daemon's* ``SLURM_PROCID`` (its node number, not the
rank): the MPI launcher's own variables are read before the scheduler's. SLURM's variables count
only inside a job step (``SLURM_STEP_ID`` set): a batch script's own ``SLURM_PROCID=0`` and
``SLURM_NTASKS`` describe the allocation, not a running step. Intel MPI is told from MPICH by its
``I_MPI_*`` variables.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, MutableMapping

from launch.errors import LaunchError

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

__all__ = [
    "Placement", "detect", "from_environ", "from_comm", "check_world", "threads_per_rank",
    "available_cores",
    "ranks_sharing_cores", "expand_tasks_per_node", "prefer_shared_memory", "THREADS_VARIABLE",
]

#: Environment variable that sets the compute threads per rank, overriding the computed value.
THREADS_VARIABLE = "SPARSEPIPE_THREADS"


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job.

    ``rank``/``size``: in the MPI world; ``local_rank``/``local_size``: among the ranks on this node
    (``0 <= local_rank < local_size <= size``); ``node``: host name; ``node_index``: this node's
    number in the job (0-based) when the launcher says it, else ``None``; ``launcher``: which rule
    found it (see the module table; ``"none"`` for a lone process without MPI); ``note``: why the
    environment was overruled, if it was.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: str
    launcher: str
    node_index: int | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise LaunchError(f"{self.launcher}: rank {self.rank} is outside the world of "
                              f"size {self.size} (need 0 <= rank < size)")
        if not 0 <= self.local_rank < self.local_size:
            raise LaunchError(f"{self.launcher}: local rank {self.local_rank} is outside the "
                              f"node's {self.local_size} ranks (need 0 <= local_rank < local_size)")
        if self.local_size > self.size:
            raise LaunchError(f"{self.launcher}: local size {self.local_size} exceeds the world "
                              f"size {self.size}")

    def describe(self) -> str:
        """One short line, e.g. ``rank 1/4 local 1/4 node n01 (#0) via slurm``."""
        where = self.node if self.node_index is None else f"{self.node} (#{self.node_index})"
        text = (f"rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size} "
                f"node {where} via {self.launcher}")
        return f"{text} [{self.note}]" if self.note else text


# --------------------------------------------------------------------------------------------------
# Reading variables


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:  # its launcher's other variables are set: an incomplete environment
        raise LaunchError(f"launcher variable {name} is not set, though other variables of its "
                          f"launcher are; start the ranks with that launcher (mpirun, srun, "
                          f"mpiexec), or set {name} too")
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"launcher variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise LaunchError(f"launcher variable {name}={raw!r} is negative (need >= 0)")
    return value


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int(env, name)
    return None


def _hostname(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    return socket.gethostname()


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise LaunchError(f"launcher variable {name}={text!r}: item {item!r} is not "
                              "'N' or 'N(xK)'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _nodefile_counts(env: Mapping[str, str], host: str) -> tuple[int, int] | None:
    """(lines in ``PBS_NODEFILE``, lines naming this host); PBS writes one line per MPI process."""
    path = env.get("PBS_NODEFILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            hosts = [line.strip() for line in handle if line.strip()]
    except OSError as err:
        raise LaunchError(f"PBS_NODEFILE={path!r} cannot be read: {err}") from None
    short = host.split(".")[0]
    return len(hosts), sum(1 for h in hosts if h.split(".")[0] == short)


# --------------------------------------------------------------------------------------------------
# One reader per launcher: each returns None when its variables are absent.


def _openmpi(env: Mapping[str, str]) -> Placement | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return Placement(
        rank=_int(env, "OMPI_COMM_WORLD_RANK"), size=_int(env, "OMPI_COMM_WORLD_SIZE"),
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        node=_hostname(env), launcher="openmpi")


def _mvapich(env: Mapping[str, str]) -> Placement | None:
    if "MV2_COMM_WORLD_RANK" not in env:
        return None
    return Placement(
        rank=_int(env, "MV2_COMM_WORLD_RANK"), size=_int(env, "MV2_COMM_WORLD_SIZE"),
        local_rank=_int(env, "MV2_COMM_WORLD_LOCAL_RANK"),
        local_size=_int(env, "MV2_COMM_WORLD_LOCAL_SIZE"),
        node=_hostname(env), launcher="mvapich")


def _pals(env: Mapping[str, str]) -> Placement | None:
    if "PALS_RANKID" not in env:
        return None
    host = _hostname(env)
    size = _first_int(env, "PMI_SIZE", "PALS_SIZE")
    local_size = _first_int(env, "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE")
    if size is None or local_size is None:
        counts = _nodefile_counts(env, host)
        if counts is None:
            raise LaunchError("PALS_RANKID is set but neither PMI_SIZE/PMI_LOCAL_SIZE nor "
                              "PBS_NODEFILE is: cannot tell the world and node sizes")
        if local_size is None and counts[1] == 0:
            raise LaunchError(f"this host {host!r} is not in PBS_NODEFILE="
                              f"{env['PBS_NODEFILE']!r}: cannot tell the ranks on this node; "
                              "set PMI_LOCAL_SIZE (mpiexec --ppn N sets it)")
        size = counts[0] if size is None else size
        local_size = counts[1] if local_size is None else local_size
    local_rank = _first_int(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
    if local_rank is None:
        raise LaunchError("PALS_RANKID is set but neither PALS_LOCAL_RANKID nor PMI_LOCAL_RANK "
                          "is: cannot tell the local rank")
    return Placement(
        rank=_int(env, "PALS_RANKID"), size=size, local_rank=local_rank,
        local_size=local_size, node=host, launcher="pals",
        node_index=_first_int(env, "PALS_NODEID"))


def _hydra(env: Mapping[str, str]) -> Placement | None:
    if "PMI_RANK" not in env or "MPI_LOCALRANKID" not in env:
        return None
    intel = any(key.startswith("I_MPI_") for key in env)
    return Placement(
        rank=_int(env, "PMI_RANK"), size=_int(env, "PMI_SIZE"),
        local_rank=_int(env, "MPI_LOCALRANKID"), local_size=_int(env, "MPI_LOCALNRANKS"),
        node=_hostname(env), launcher="intelmpi" if intel else "mpich")


def _slurm(env: Mapping[str, str]) -> Placement | None:
    if "SLURM_PROCID" not in env or not ({"SLURM_STEP_ID", "SLURM_STEPID"} & env.keys()):
        return None
    size = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if size is None:
        raise LaunchError("SLURM_PROCID is set but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, "
                          "SLURM_NPROCS is: cannot tell the world size")
    node_index = _first_int(env, "SLURM_NODEID")
    local_size: int | None = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_tasks_per_node(env[name], name)
            index = node_index or 0
            local_size = counts[index] if index < len(counts) else counts[-1]
            break
    if local_size is None:
        raise LaunchError("SLURM_PROCID is set but SLURM_STEP_TASKS_PER_NODE and "
                          "SLURM_TASKS_PER_NODE are not: cannot tell the ranks on this node")
    return Placement(
        rank=_int(env, "SLURM_PROCID"), size=size, local_rank=_int(env, "SLURM_LOCALID"),
        local_size=local_size, node=_hostname(env, "SLURMD_NODENAME"), launcher="slurm",
        node_index=node_index)


def _pmi(env: Mapping[str, str]) -> Placement | None:
    if not {"PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"} <= env.keys():
        return None
    return Placement(
        rank=_int(env, "PMI_RANK"), size=_int(env, "PMI_SIZE"),
        local_rank=_int(env, "PMI_LOCAL_RANK"), local_size=_int(env, "PMI_LOCAL_SIZE"),
        node=_hostname(env), launcher="pmi")


_READERS: tuple[Callable[[Mapping[str, str]], Placement | None], ...] = (
    _openmpi, _mvapich, _pals, _hydra, _slurm, _pmi)


def from_environ(env: Mapping[str, str] | None = None) -> Placement | None:
    """The placement the launcher's variables describe, or ``None`` when no launcher is recognised.

    Pure: reads ``env`` (default ``os.environ``) and, for PBS without PMI sizes, ``PBS_NODEFILE``.
    Raises :class:`LaunchError` naming the variable when a recognised launcher's value is malformed.
    """
    env = os.environ if env is None else env
    for reader in _READERS:
        placement = reader(env)
        if placement is not None:
            return placement
    return None


def check_world(world_size: int, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`LaunchError` when the launcher started several processes but MPI gives this
    one a world of 1 (``world_size``, ``COMM_WORLD``'s): each would train alone, all into one
    ``--out``. The usual cause is an MPI the launcher did not start: ``srun`` without the PMI
    plugin mpi4py's MPI needs, or another MPI's ``mpirun``. Under SLURM only the process srun
    started counts (``SLURM_TASK_PID``): a shell of ``srun --pty bash`` or a script's own python
    in a step of several tasks runs alone as it should."""
    if world_size != 1:
        return
    env = os.environ if env is None else env
    found = from_environ(env)
    if found is None or found.size == 1:
        return
    task = env.get("SLURM_TASK_PID", "").strip()
    if found.launcher == "slurm" and task.isdigit() and int(task) != os.getpid():
        return  # a process that srun's task started (a shell, a script's python): not a rank
    raise LaunchError(
        f"{found.launcher} started {found.size} processes, but MPI gives this one a world of "
        f"{world_size}: mpi4py's MPI was not started by that launcher, so every process would run "
        "alone (under srun pass the PMI plugin your MPI needs, e.g. srun --mpi=pmix for Open MPI "
        "5, see 'srun --mpi=list'; under mpirun use the one of the MPI mpi4py is built with, "
        "'python -c \"import mpi4py; print(mpi4py.get_config())\"')")


# --------------------------------------------------------------------------------------------------
# MPI fallback


def _world() -> Any:
    """``MPI.COMM_WORLD`` when mpi4py is importable and MPI is initialized, else ``None``."""
    mpi: Any = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        try:
            import mpi4py.MPI  # initializes MPI unless mpi4py.rc says otherwise
        except ImportError:
            return None
        mpi = mpi4py.MPI
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD


def from_comm(comm: MPI.Intracomm) -> Placement:
    """The placement from a ``COMM_TYPE_SHARED`` split of ``comm``. **Collective** over ``comm``.

    Node index: the rank of this node's leader (local rank 0) among all leaders, so nodes are
    numbered 0, 1, ... in the order of their lowest rank.
    """
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leaders = comm.Split(0 if local.Get_rank() == 0 else MPI.UNDEFINED, key=comm.Get_rank())
        node_index = -1
        if leaders != MPI.COMM_NULL:
            node_index = leaders.Get_rank()
            leaders.Free()
        node_index = local.bcast(node_index, root=0)
        return Placement(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local.Get_rank(),
                         local_size=local.Get_size(), node=MPI.Get_processor_name(),
                         launcher="mpi", node_index=node_index)
    finally:
        local.Free()


def detect(comm: MPI.Intracomm | None = None) -> Placement:
    """This process's placement: the launcher's variables, else a split of the communicator.

    ``comm``: the communicator to split when no launcher is recognised (default ``COMM_WORLD``;
    importing mpi4py for it initializes MPI, as any use of mpi4py does). When ``comm`` is given
    and its size differs from the world size the variables state (say, a leftover
    ``SLURM_NTASKS`` seen by a lone process), the variables are ignored and ``comm`` is split; the
    result's ``note`` says so. The split is **collective** over ``comm``; the variable path
    communicates nothing. Without launcher variables and without mpi4py, the result is a lone
    process (``launcher="none"``).
    """
    found = from_environ(os.environ)
    if found is not None:
        if comm is None or comm.Get_size() == found.size:
            return found
        note = (f"{found.launcher} variables say world size {found.size}, the communicator has "
                f"{comm.Get_size()}: used the communicator")
        return replace(from_comm(comm), note=note)
    if comm is None:
        comm = _world()
    if comm is None:
        return Placement(rank=0, size=1, local_rank=0, local_size=1, node=socket.gethostname(),
                         launcher="none", node_index=0)
    return from_comm(comm)


# --------------------------------------------------------------------------------------------------
# Threads


def _positive(raw: object, name: str) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise LaunchError(f"{name}={raw!r} must be a positive integer (compute threads per rank)")
    return value


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def ranks_sharing_cores(comm: MPI.Intracomm) -> int:
    """How many ranks of this node (this one included) may run on this rank's cores: those whose
    affinity masks meet its own. **Collective** over ``comm``.

    1 where the launcher bound each rank to cores of its own (Open MPI's default binding to a core
    for 2 ranks, ``--map-by ...:PE=n``); the node's rank count where every rank sees the same
    cores (no binding, or a container's cpuset): the divisor that turns a mask into a share.
    """
    from mpi4py import MPI

    mine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        masks = local.allgather(mine)
    finally:
        local.Free()
    return sum(1 for m in masks if m is None or mine is None or m & mine)


def threads_per_rank(placement: Placement, override: int | None = None,
                     sharing: int | None = None) -> int:
    """Compute threads for this rank: its share of the node's cores, at least 1.

    In order: ``override``; the ``SPARSEPIPE_THREADS`` variable; the CPUs the launcher granted each
    rank (``SLURM_CPUS_PER_TASK`` under srun, ``PALS_DEPTH`` under PALS), capped by the affinity
    mask; else the cores in this process's affinity mask divided by ``sharing``, the ranks that
    share them (:func:`ranks_sharing_cores`; default ``placement.local_size``: all of the node's).
    """
    if override is not None:
        return _positive(override, "threads override")
    raw = os.environ.get(THREADS_VARIABLE, "").strip()
    if raw:
        return _positive(raw, THREADS_VARIABLE)
    cores = available_cores()
    granted = {"slurm": "SLURM_CPUS_PER_TASK", "pals": "PALS_DEPTH"}.get(placement.launcher)
    if granted and os.environ.get(granted, "").strip():
        return min(_positive(os.environ[granted], granted), cores)
    return max(1, cores // (placement.local_size if sharing is None else max(1, sharing)))


def prefer_shared_memory(environ: MutableMapping[str, str] | None = None, *,
                         library: str | None = None) -> bool:
    """On one node under Open MPI, use only its shared-memory and self transports.

    Open MPI probes every network transport at ``MPI_Init`` (~1 s per process on a machine without
    a fast network); on one node ``pml=ob1`` with ``btl=self,sm`` (Open MPI 5) or ``self,vader``
    (Open MPI 3.x and 4.x: the same transport under its old name) is all it needs and starts in
    ~0.1 s. The name comes from the MPI library's version string (``library``; default: asked of
    the library mpi4py loads, without initializing MPI, see :mod:`launch.mpilib`). Call before
    mpi4py initializes MPI. Sets nothing, and returns False, when the job spans nodes, the launcher
    is not Open MPI (nor a lone process), the user set either variable, or the library is not an
    Open MPI whose transport name is known (another MPI, or a version string that cannot be read):
    Open MPI's own defaults always work, only slower to start.
    """
    env = os.environ if environ is None else environ
    if "OMPI_MCA_pml" in env or "OMPI_MCA_btl" in env:
        return False
    size, local = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    try:
        launcher = from_environ(env)
    except LaunchError:  # malformed variables: said where the placement is needed, not here
        return False
    if size is None and launcher is not None:
        return False  # another launcher: leave its MPI alone
    if size is not None and size != local:
        return False
    from launch.mpilib import library_version, shared_memory_btl

    btl = shared_memory_btl(library_version() if library is None else library)
    if btl is None:
        return False
    env["OMPI_MCA_pml"] = "ob1"
    env["OMPI_MCA_btl"] = f"self,{btl}"
    return True
