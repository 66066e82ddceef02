"""launch.env: placement under each launcher's variables (mocked), fallbacks, threads per rank."""

from __future__ import annotations

import os

import pytest

from launch import env as launch_env
from launch.env import (Placement, check_world, detect, expand_tasks_per_node, from_environ,
                        threads_per_rank)
from launch.errors import LaunchError

# Every variable any reader looks at; cleared before each test so the host's own job (a CI runner
# inside SLURM, a developer's mpirun) cannot leak in.
_PREFIXES = ("OMPI_", "PMIX_", "MV2_", "PALS_", "PMI_", "MPI_LOCAL", "I_MPI_", "SLURM", "PBS_",
             "SPARSEPIPE_THREADS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(_PREFIXES):
            monkeypatch.delenv(key)
    return monkeypatch


def setenv(monkeypatch, **values):
    for key, value in values.items():
        monkeypatch.setenv(key, str(value))


# --------------------------------------------------------------------------------------------------
# One test per launcher, with the variables it really sets


def test_openmpi(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=8,
           OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=4,
           OMPI_COMM_WORLD_NODE_RANK=1, PMIX_RANK=5)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.launcher) == (5, 8, 1, 4, "openmpi")
    assert p.node and p.node_index is None


def test_mpich_hydra(monkeypatch):
    setenv(monkeypatch, PMI_RANK=3, PMI_SIZE=4, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=2, PMI_FD=7)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.launcher) == (3, 4, 1, 2, "mpich")


def test_intel_mpi(monkeypatch):
    setenv(monkeypatch, PMI_RANK=6, PMI_SIZE=16, MPI_LOCALRANKID=2, MPI_LOCALNRANKS=8,
           I_MPI_ROOT="/opt/intel/mpi", I_MPI_HYDRA_BOOTSTRAP="slurm")
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.launcher) == (6, 16, 2, 8, "intelmpi")


def test_slurm_srun(monkeypatch):
    setenv(monkeypatch, SLURM_JOB_ID=99, SLURM_STEP_ID=0, SLURM_STEPID=0, SLURM_PROCID=9,
           SLURM_NTASKS=16, SLURM_STEP_NUM_TASKS=12, SLURM_LOCALID=1, SLURM_NODEID=2,
           SLURM_STEP_TASKS_PER_NODE="4(x2),3,1", SLURM_TASKS_PER_NODE="4(x4)",
           SLURMD_NODENAME="gpu042")
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size) == (9, 12, 1, 3)
    assert (p.node, p.node_index, p.launcher) == ("gpu042", 2, "slurm")


def test_slurm_without_step_variables_uses_job_counts(monkeypatch):
    setenv(monkeypatch, SLURM_STEPID=3, SLURM_PROCID=1, SLURM_NTASKS=8, SLURM_LOCALID=1,
           SLURM_NODEID=0, SLURM_TASKS_PER_NODE="4(x2)")
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.node_index) == (1, 8, 1, 4, 0)


def test_pbs_pals_with_pmi_sizes(monkeypatch):
    setenv(monkeypatch, PBS_JOBID="12.pbs", PALS_RANKID=7, PALS_LOCAL_RANKID=3, PALS_NODEID=1,
           PALS_DEPTH=8, PMI_RANK=7, PMI_SIZE=8, PMI_LOCAL_RANK=3, PMI_LOCAL_SIZE=4)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size) == (7, 8, 3, 4)
    assert (p.node_index, p.launcher) == (1, "pals")


def test_pbs_pals_sizes_from_nodefile(monkeypatch, tmp_path):
    host = "x3001c0s13b0n0"
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}.hsn.cm.polaris\n" for _ in range(4))
                        + "".join("x3001c0s13b1n0.hsn.cm.polaris\n" for _ in range(4)))
    monkeypatch.setattr(launch_env.socket, "gethostname", lambda: host)
    setenv(monkeypatch, PBS_NODEFILE=nodefile, PALS_RANKID=2, PALS_LOCAL_RANKID=2, PALS_NODEID=0)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.node) == (2, 8, 2, 4, host)


def test_pbs_pals_host_missing_from_the_nodefile_is_named(monkeypatch, tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("other1\nother2\n")
    monkeypatch.setattr(launch_env.socket, "gethostname", lambda: "me")
    setenv(monkeypatch, PBS_NODEFILE=nodefile, PALS_RANKID=1, PALS_LOCAL_RANKID=0)
    with pytest.raises(LaunchError, match=r"host 'me' is not in PBS_NODEFILE=.*PMI_LOCAL_SIZE"):
        detect()


def test_cray_pmi(monkeypatch):
    setenv(monkeypatch, PMI_RANK=2, PMI_SIZE=4, PMI_LOCAL_RANK=0, PMI_LOCAL_SIZE=2)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.launcher) == (2, 4, 0, 2, "pmi")


def test_mvapich(monkeypatch):
    setenv(monkeypatch, MV2_COMM_WORLD_RANK=1, MV2_COMM_WORLD_SIZE=2,
           MV2_COMM_WORLD_LOCAL_RANK=1, MV2_COMM_WORLD_LOCAL_SIZE=2)
    assert detect().launcher == "mvapich"


# --------------------------------------------------------------------------------------------------
# Precedence: an MPI launcher inside a scheduler job inherits the scheduler's variables


def test_mpirun_inside_slurm_prefers_open_mpi(monkeypatch):
    # mpirun's daemons were started by srun: every rank inherits the daemon's SLURM_PROCID (= node).
    setenv(monkeypatch, SLURM_STEP_ID=0, SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_LOCALID=0,
           SLURM_NODEID=1, SLURM_STEP_TASKS_PER_NODE="1(x2)",
           OMPI_COMM_WORLD_RANK=6, OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_LOCAL_RANK=2,
           OMPI_COMM_WORLD_LOCAL_SIZE=4)
    assert (detect().rank, detect().launcher) == (6, "openmpi")


def test_intel_mpirun_inside_slurm_prefers_hydra(monkeypatch):
    setenv(monkeypatch, SLURM_STEP_ID=0, SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_LOCALID=0,
           SLURM_STEP_TASKS_PER_NODE="1(x2)", PMI_RANK=5, PMI_SIZE=8, MPI_LOCALRANKID=1,
           MPI_LOCALNRANKS=4, I_MPI_ROOT="/opt/intel")
    assert (detect().rank, detect().launcher) == (5, "intelmpi")


def test_pals_preferred_over_generic_pmi(monkeypatch):
    setenv(monkeypatch, PALS_RANKID=1, PALS_LOCAL_RANKID=1, PMI_RANK=1, PMI_SIZE=2,
           PMI_LOCAL_RANK=1, PMI_LOCAL_SIZE=2)
    assert detect().launcher == "pals"


def test_batch_script_slurm_variables_are_not_a_step(monkeypatch):
    # The batch shell itself: SLURM_PROCID=0 and SLURM_NTASKS=8 describe the allocation.
    setenv(monkeypatch, SLURM_JOB_ID=1, SLURM_PROCID=0, SLURM_NTASKS=8, SLURM_LOCALID=0,
           SLURM_NODEID=0, SLURM_TASKS_PER_NODE="4(x2)")
    assert from_environ() is None


# --------------------------------------------------------------------------------------------------
# Fallbacks


def test_no_launcher_no_mpi_is_a_lone_process(monkeypatch):
    monkeypatch.setattr(launch_env, "_world", lambda: None)
    p = detect()
    assert (p.rank, p.size, p.local_rank, p.local_size, p.launcher) == (0, 1, 0, 1, "none")


def test_no_launcher_splits_the_communicator(monkeypatch):
    fake = Placement(rank=1, size=2, local_rank=1, local_size=2, node="h", launcher="mpi",
                     node_index=0)
    comm = object()
    seen = []
    monkeypatch.setattr(launch_env, "_world", lambda: comm)
    monkeypatch.setattr(launch_env, "from_comm", lambda c: seen.append(c) or fake)
    assert detect() is fake and seen == [comm]


class _Comm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def test_environment_of_another_world_is_overruled_by_the_communicator(monkeypatch):
    setenv(monkeypatch, SLURM_STEP_ID=0, SLURM_PROCID=0, SLURM_NTASKS=8, SLURM_LOCALID=0,
           SLURM_STEP_TASKS_PER_NODE="8")
    lone = Placement(rank=0, size=1, local_rank=0, local_size=1, node="h", launcher="mpi")
    monkeypatch.setattr(launch_env, "from_comm", lambda c: lone)
    p = detect(_Comm(0, 1))
    assert (p.size, p.launcher) == (1, "mpi")
    assert "world size 8" in p.note and "slurm" in p.note


@pytest.mark.parametrize("values, world, launcher", [
    ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 1, "SLURM_STEP_NUM_TASKS": 4, "SLURM_LOCALID": 1,
      "SLURM_STEP_TASKS_PER_NODE": "4"}, 1, "slurm"),
    ({"OMPI_COMM_WORLD_RANK": 0, "OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": 0,
      "OMPI_COMM_WORLD_LOCAL_SIZE": 2}, 1, "openmpi"),
])
def test_processes_that_mpi_sees_alone_are_refused(monkeypatch, values, world, launcher):
    setenv(monkeypatch, **values)
    with pytest.raises(LaunchError, match=rf"{launcher} started \d processes, but MPI gives "
                                          r"this one a world of 1.*srun --mpi=pmix"):
        check_world(world)
    check_world(int(values.get("SLURM_STEP_NUM_TASKS", values.get("OMPI_COMM_WORLD_SIZE"))))


def test_a_process_srun_did_not_start_itself_may_run_alone(monkeypatch):
    """A shell of `srun -n 4 --pty bash`, or a sweep script's own python in a step of several
    tasks: not the task srun started (SLURM_TASK_PID), so it runs alone as asked."""
    setenv(monkeypatch, SLURM_STEP_ID=0, SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=4, SLURM_LOCALID=0,
           SLURM_STEP_TASKS_PER_NODE="4", SLURM_TASK_PID=os.getpid() + 1)
    check_world(1)
    setenv(monkeypatch, SLURM_TASK_PID=os.getpid())  # srun's task itself: refused
    with pytest.raises(LaunchError, match="slurm started 4 processes"):
        check_world(1)


def test_a_lone_process_or_a_sub_world_passes_the_world_check(monkeypatch):
    check_world(1)  # no launcher
    setenv(monkeypatch, SLURM_STEP_ID=0, SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=1, SLURM_LOCALID=0,
           SLURM_STEP_TASKS_PER_NODE="1")
    check_world(1)
    setenv(monkeypatch, SLURM_STEP_NUM_TASKS=4, SLURM_STEP_TASKS_PER_NODE="4")
    check_world(2)  # another size than 1: detect() says so in its note, launch info warns


def test_environment_matching_the_communicator_is_kept(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2,
           OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=2)
    monkeypatch.setattr(launch_env, "from_comm", lambda c: pytest.fail("must not split"))
    assert detect(_Comm(1, 2)).launcher == "openmpi"


# --------------------------------------------------------------------------------------------------
# Errors name the variable, the rule and the value


@pytest.mark.parametrize("values, words", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": 0,
      "OMPI_COMM_WORLD_LOCAL_SIZE": 1}, ["OMPI_COMM_WORLD_RANK", "'x'", "integer"]),
    ({"OMPI_COMM_WORLD_RANK": 4, "OMPI_COMM_WORLD_SIZE": 4, "OMPI_COMM_WORLD_LOCAL_RANK": 0,
      "OMPI_COMM_WORLD_LOCAL_SIZE": 1}, ["rank 4", "size 4"]),
    ({"PMI_RANK": -1, "PMI_SIZE": 2, "MPI_LOCALRANKID": 0, "MPI_LOCALNRANKS": 1},
     ["PMI_RANK", "'-1'", "negative"]),
    ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 0, "SLURM_NTASKS": 2, "SLURM_LOCALID": 0,
      "SLURM_STEP_TASKS_PER_NODE": "2(y3)"}, ["SLURM_STEP_TASKS_PER_NODE", "'2(y3)'", "N(xK)"]),
    ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 0, "SLURM_LOCALID": 0,
      "SLURM_STEP_TASKS_PER_NODE": "2"}, ["SLURM_NTASKS", "world size"]),
    ({"PALS_RANKID": 0, "PALS_LOCAL_RANKID": 0}, ["PMI_SIZE", "PBS_NODEFILE"]),
    ({"PALS_RANKID": 0, "PMI_SIZE": 1, "PMI_LOCAL_SIZE": 1}, ["PALS_LOCAL_RANKID"]),
    ({"OMPI_COMM_WORLD_RANK": 0, "OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": 0,
      "OMPI_COMM_WORLD_LOCAL_SIZE": 3}, ["local size 3", "world size 2"]),
    # A launcher's variable missing beside the others: named, not a KeyError
    ({"OMPI_COMM_WORLD_RANK": 0, "OMPI_COMM_WORLD_SIZE": 2},
     ["OMPI_COMM_WORLD_LOCAL_RANK is not set", "other variables of its launcher"]),
    ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 0, "SLURM_NTASKS": 2,
      "SLURM_STEP_TASKS_PER_NODE": "2"}, ["SLURM_LOCALID is not set"]),
    ({"PMI_RANK": 0, "MPI_LOCALRANKID": 0, "MPI_LOCALNRANKS": 1}, ["PMI_SIZE is not set"]),
])
def test_malformed_variables_raise(monkeypatch, values, words):
    setenv(monkeypatch, **values)
    with pytest.raises(LaunchError) as info:
        detect()
    for word in words:
        assert word in str(info.value)


def test_unreadable_nodefile_is_named(monkeypatch, tmp_path):
    setenv(monkeypatch, PALS_RANKID=0, PALS_LOCAL_RANKID=0, PBS_NODEFILE=tmp_path / "missing")
    with pytest.raises(LaunchError, match="PBS_NODEFILE"):
        detect()


def test_launch_error_is_a_value_error():
    assert issubclass(LaunchError, ValueError)


@pytest.mark.parametrize("text, counts", [("4", [4]), ("4(x2)", [4, 4]),
                                          ("4(x2),3", [4, 4, 3]), ("1,2(x3)", [1, 2, 2, 2])])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_describe_is_one_line():
    p = Placement(rank=1, size=4, local_rank=1, local_size=2, node="n01", launcher="slurm",
                  node_index=0)
    assert p.describe() == "rank 1/4 local 1/2 node n01 (#0) via slurm"


# --------------------------------------------------------------------------------------------------
# Threads


def _placement(local_size=1, launcher="openmpi"):
    return Placement(rank=0, size=local_size, local_rank=0, local_size=local_size, node="h",
                     launcher=launcher)


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n):
        monkeypatch.setattr(launch_env, "available_cores", lambda: n)
    return set_cores


def test_threads_divide_the_cores(cores):
    cores(32)
    assert threads_per_rank(_placement(4)) == 8
    assert threads_per_rank(_placement(3)) == 10
    assert threads_per_rank(_placement(1)) == 32


def test_threads_divide_only_among_the_ranks_sharing_the_cores(cores):
    cores(8)  # a rank bound to 8 cores of its own, 4 ranks on the node
    assert threads_per_rank(_placement(4), sharing=1) == 8
    assert threads_per_rank(_placement(4), sharing=2) == 4
    assert threads_per_rank(_placement(4)) == 2  # not known: all the node's ranks


def test_threads_at_least_one(cores):
    cores(2)
    assert threads_per_rank(_placement(4)) == 1


def test_threads_override_and_variable(cores, monkeypatch):
    cores(32)
    monkeypatch.setenv("SPARSEPIPE_THREADS", "3")
    assert threads_per_rank(_placement(4)) == 3
    assert threads_per_rank(_placement(4), override=5) == 5


def test_threads_from_launcher_grant(cores, monkeypatch):
    cores(64)  # no binding: all the node's cores visible
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert threads_per_rank(_placement(8, "slurm")) == 6
    assert threads_per_rank(_placement(8, "openmpi")) == 8  # not SLURM's rank: ignore the grant
    cores(4)  # bound to fewer cores than granted: the mask wins
    assert threads_per_rank(_placement(8, "slurm")) == 4
    monkeypatch.setenv("PALS_DEPTH", "16")
    cores(64)
    assert threads_per_rank(_placement(4, "pals")) == 16


@pytest.mark.parametrize("raw", ["0", "-2", "many", "1.5"])
def test_bad_thread_setting_is_named(monkeypatch, raw):
    monkeypatch.setenv("SPARSEPIPE_THREADS", raw)
    with pytest.raises(LaunchError) as info:
        threads_per_rank(_placement())
    assert "SPARSEPIPE_THREADS" in str(info.value) and repr(raw) in str(info.value)


def test_available_cores_is_the_affinity_mask():
    assert launch_env.available_cores() == len(os.sched_getaffinity(0))
