"""launch.mpilib and prefer_shared_memory: Open MPI's shared-memory transport under the name its
version uses (``vader`` in 3.x/4.x, ``sm`` from 5.0), nothing for other MPIs; read without MPI_Init.

Open MPI 4 and MPICH are mocked by their version strings; Open MPI 5 is the real library here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import mpilib
from launch.env import prefer_shared_memory
from launch.mpilib import LibraryVersion, parse_library_version, shared_memory_btl

try:
    from test_mpi import mpi_env, mpirun_command
except ImportError:  # pytest's importlib mode does not put tests/ on sys.path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mpi import mpi_env, mpirun_command

REPO = Path(__file__).resolve().parent.parent

# Version strings as each library prints them (MPI_Get_library_version).
OPEN_MPI_5 = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
              "repo rev: v5.0.11rc1, Sep 16, 2026")
OPEN_MPI_4 = ("Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, "
              "Sep 30, 2023")
OPEN_MPI_3 = ("Open MPI v3.1.6, package: Open MPI builder@host Distribution, ident: 3.1.6, "
              "repo rev: v3.1.6, Mar 18, 2020")
OPEN_MPI_2 = ("Open MPI v2.1.1, package: Open MPI buildd@lcy01 Distribution, ident: 2.1.1, "
              "repo rev: v2.1.0-100-ga2fdb5b, May 10, 2017")
MPICH = ("MPICH Version:      4.1.2\nMPICH Release date: Wed Jun  7 15:22:45 CDT 2023\n"
         "MPICH ABI:          15:1:3\nMPICH Device:       ch4:ofi\n")
INTEL_MPI = "Intel(R) MPI Library 2021.10 for Linux* OS\n"
MVAPICH = ("MVAPICH2 Version      :\t2.3.7\n"
           "MVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022\n")
CRAY_MPICH = "MPI VERSION    : CRAY MPICH version 8.1.25.17 (ANL base 3.4a2)\n"

ONE_NODE = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}


@pytest.mark.parametrize("text, parsed, btl", [
    (OPEN_MPI_5, LibraryVersion("openmpi", (5, 0, 11)), "sm"),
    ("Open MPI v6.0.0a1, package: Open MPI git", LibraryVersion("openmpi", (6, 0, 0)), "sm"),
    (OPEN_MPI_4, LibraryVersion("openmpi", (4, 1, 6)), "vader"),
    (OPEN_MPI_3, LibraryVersion("openmpi", (3, 1, 6)), "vader"),
    (OPEN_MPI_2, LibraryVersion("openmpi", (2, 1, 1)), None),
    (MPICH, LibraryVersion("mpich", (4, 1, 2)), None),
    (INTEL_MPI, LibraryVersion("intelmpi", (2021, 10)), None),
    (MVAPICH, LibraryVersion("mvapich", (2, 3, 7)), None),
    (CRAY_MPICH, LibraryVersion("other", ()), None),
    ("", LibraryVersion("other", ()), None),
    (None, None, None),
])
def test_btl_name_follows_the_library_version(text, parsed, btl):
    assert parse_library_version(text) == parsed
    assert shared_memory_btl(text) == btl


@pytest.mark.parametrize("text, btl", [(OPEN_MPI_5, "self,sm"), (OPEN_MPI_4, "self,vader"),
                                       (OPEN_MPI_3, "self,vader")])
def test_prefer_shared_memory_names_the_transport_of_this_open_mpi(monkeypatch, text, btl):
    monkeypatch.setattr(mpilib, "library_version", lambda: text)
    for env in (dict(ONE_NODE), {}):  # under mpirun on one node, and a lone process
        assert prefer_shared_memory(env)
        assert (env["OMPI_MCA_pml"], env["OMPI_MCA_btl"]) == ("ob1", btl)
    env = dict(ONE_NODE)
    assert prefer_shared_memory(env, library=OPEN_MPI_4) and env["OMPI_MCA_btl"] == "self,vader"


@pytest.mark.parametrize("text", [MPICH, INTEL_MPI, OPEN_MPI_2, "garbage", None])
def test_prefer_shared_memory_sets_nothing_when_unsure(monkeypatch, text):
    monkeypatch.setattr(mpilib, "library_version", lambda: text)
    for env in (dict(ONE_NODE), {}):
        before = dict(env)
        assert not prefer_shared_memory(env)
        assert env == before


def test_prefer_shared_memory_only_on_one_open_mpi_node(monkeypatch):
    monkeypatch.setattr(mpilib, "library_version", lambda: OPEN_MPI_5)
    two_nodes = dict(ONE_NODE, OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert not prefer_shared_memory(two_nodes) and "OMPI_MCA_btl" not in two_nodes
    user_set = dict(ONE_NODE, OMPI_MCA_btl="self,tcp")
    assert not prefer_shared_memory(user_set) and user_set["OMPI_MCA_btl"] == "self,tcp"
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0",
             "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}
    assert not prefer_shared_memory(slurm) and "OMPI_MCA_btl" not in slurm


def _clean_env() -> dict[str, str]:
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in list(env):
        if key.startswith(("OMPI_MCA_pml", "OMPI_MCA_btl", "SLURM", "PBS_", "PALS_", "PMI_")):
            del env[key]
    return env


def test_real_library_is_read_without_initializing_mpi(tmp_path):
    code = """if True:
        import sys
        from launch.mpilib import library_version
        text = library_version()
        assert "mpi4py.MPI" not in sys.modules
        import mpi4py
        mpi4py.rc.initialize = mpi4py.rc.finalize = False
        from mpi4py import MPI
        assert not MPI.Is_initialized(), "reading the version initialized MPI"
        assert text == MPI.Get_library_version().rstrip("\\0"), (text, MPI.Get_library_version())
        print(text)
        """
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert parse_library_version(proc.stdout).name in ("openmpi", "mpich", "intelmpi", "mvapich")


def test_real_open_mpi_starts_with_the_chosen_transport(tmp_path):
    """Under this machine's mpirun, with no MCA variables set, 'launch run' chooses the transport
    by the library's version and MPI_Init succeeds with it on every rank."""
    text = mpilib.library_version()
    found = parse_library_version(text)
    if found is None or found.name != "openmpi":
        pytest.skip(f"the MPI here is not Open MPI: {text!r}")
    code = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print(c.rank, os.environ.get('OMPI_MCA_pml'), os.environ.get('OMPI_MCA_btl'), "
            "c.allreduce(1))")
    proc = subprocess.run(mpirun_command(2) + [sys.executable, "-m", "launch", "run", "-c", code],
                          env=_clean_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = f"ob1 self,{shared_memory_btl(text)} 2"
    assert sorted(proc.stdout.splitlines()) == [f"0 {want}", f"1 {want}"]
