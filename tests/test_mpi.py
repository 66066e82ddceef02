"""Run the suites under ``tests/mpi/`` under real ``mpirun`` at several world sizes.

Each (file, world size) pair is one test here, so a failure names both. A deadlock is ended by the
per-test timeout inside the MPI run (pytest-timeout, thread method) and by the outer timeout below.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.env import prefer_shared_memory

HERE = Path(__file__).parent
MPI_FILES = sorted(p.name for p in (HERE / "mpi").glob("test_*.py"))
WORLD_SIZES = (1, 2, 3, 4)


def mpirun_command(n: int) -> list[str]:
    cmd = ["mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    # One node: shared memory and self only (Open MPI's transport probing costs ~1 s per rank),
    # under the name this Open MPI gives its shared-memory transport; nothing for another MPI.
    prefer_shared_memory(env)
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONHASHSEED"] = "0"
    return env


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` (typically ``mpirun ...``) and fail the test if it is still running after
    ``timeout`` s: a hang. The hung job is ended first -- SIGTERM to ``mpirun``, which kills its
    ranks, then SIGKILL to its process group -- so no rank is left spinning in a collective."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} ... hung: still running after {timeout} s\n"
                    f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", MPI_FILES)
def test_under_mpirun(name: str, n: int) -> None:
    cmd = mpirun_command(n) + [
        sys.executable, "-m", "pytest", str(HERE / "mpi" / name),
        "-q", "-p", "no:cacheprovider", "--timeout=300", "--timeout-method=thread",
        "-o", "addopts=", "-x",
    ]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode not in (0, 5):  # 5: nothing collected at this size
        pytest.fail(f"{' '.join(cmd[:4])} {name} exited {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout[-20000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
