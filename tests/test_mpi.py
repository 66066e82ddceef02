"""Run the suites under ``tests/mpi/`` under real ``mpirun`` at several world sizes.

Each (file, world size) pair is one test here, so a failure names both. A deadlock is ended by the
per-test timeout inside the MPI run (pytest-timeout, thread method) and by the outer timeout below.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
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
        "-o", "addopts=", "-x", "-rs", "--color=no",
    ]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:  # 5, nothing collected, too: every file has tests at every size
        pytest.fail(f"{' '.join(cmd[:4])} {name} exited {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout[-20000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    report_skips(proc.stdout)


def report_skips(stdout: str) -> None:
    """Make the inner runs' skips visible outside (their output is dropped on success): skip this
    test when no inner test ran (a GPU-only file on a CPU), else warn with the skip reasons."""
    skipped = sorted({line.strip() for line in stdout.splitlines()
                      if line.startswith("SKIPPED")})
    ran = max((int(m) for m in re.findall(r"(\d+) passed", stdout)), default=0)
    if ran == 0:
        pytest.skip("every test skipped: " + "; ".join(skipped))
    if skipped:
        warnings.warn("inner skips: " + "; ".join(skipped), stacklevel=2)


# --------------------------------------------------------------------------------------------------
# The harness itself (tests/mpi/conftest.py): one rank's failure fails fast on every rank


_HARNESS_CASES = {
    # A fixture fails on rank 0 before the bcast that rank 1 is already waiting in.
    "setup_before_collective": ("""\
        @pytest.fixture
        def shared(comm):
            data = None
            if comm.rank == 0:
                raise OSError("cannot make the shared data (injected)")
            return comm.bcast(data, root=0)

        def test_uses_shared(shared):
            assert shared is None
        """, "test_uses_shared: setup failed on this rank"),
    # The test body fails on rank 0 while rank 1 goes on into a collective.
    "call_before_collective": ("""\
        def test_fails_on_rank_0(comm):
            assert comm.rank != 0, "injected failure on rank 0"
            comm.allreduce(1)
        """, "test_fails_on_rank_0: call failed on this rank"),
    # A fixture's teardown fails on rank 0 before the barrier rank 1 waits in.
    "teardown_before_collective": ("""\
        @pytest.fixture
        def resource(comm):
            yield
            if comm.rank == 0:
                raise OSError("cleanup failed (injected)")
            comm.Barrier()

        def test_with_resource(resource):
            pass
        """, "test_with_resource: teardown failed on this rank"),
}


def _harness_run(tmp_path: Path, body: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((HERE / "mpi" / "conftest.py").read_text())
    (tmp_path / "test_generated.py").write_text("import pytest\n\n" + textwrap.dedent(body))
    env = dict(mpi_env(), MPI_TEST_AGREE_TIMEOUT="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    cmd = mpirun_command(2) + [sys.executable, "-m", "pytest", str(tmp_path / "test_generated.py"),
                               "-q", "-p", "no:cacheprovider", "--timeout=300", "--color=no",
                               "--timeout-method=thread", "-o", "addopts=", "-x", *extra]
    return run_bounded(cmd, 120, env=env, cwd=tmp_path)


@pytest.mark.parametrize("case", sorted(_HARNESS_CASES))
def test_failure_on_one_rank_before_a_collective_fails_fast(tmp_path, case):
    body, message = _HARNESS_CASES[case]
    proc = _harness_run(tmp_path, body)
    assert proc.returncode not in (0, 5), proc.stdout + proc.stderr
    assert f"[rank 0] test_generated.py::{message}, and the other ranks did not finish" \
        in proc.stderr, proc.stdout + proc.stderr
    assert "injected" in proc.stderr  # rank 0's own failure is printed before the abort


def test_fixture_failing_on_one_rank_fails_the_test_on_every_rank(tmp_path):
    body = """\
        @pytest.fixture
        def only_rank_1_fails(comm):
            if comm.rank == 1:
                raise ValueError("bad fixture on rank 1 (injected)")

        def test_collective(only_rank_1_fails, comm):
            comm.Barrier()

        def test_next(comm):
            comm.Barrier()
        """
    proc = _harness_run(tmp_path, body, "-rA")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(summary) == 2, proc.stdout  # one per rank: both report the setup error
    assert "setup failed on 1 other rank(s)" in proc.stdout
    assert "bad fixture on rank 1 (injected)" in proc.stdout
    assert "aborting" not in proc.stderr and "PASSED" not in proc.stdout


# --------------------------------------------------------------------------------------------------
# The suite's own processes: a killed launcher's leftovers do not stop the next launch


def _plant_stale_launcher_sessions(tmp: Path, count: int) -> None:
    """Open MPI's session files, as a launcher killed by SIGKILL leaves them in ``tmp``, for each
    of the next ``count`` pids."""
    host = socket.gethostname().split(".")[0]
    pid_max = Path("/proc/sys/kernel/pid_max")
    wrap = int(pid_max.read_text()) if pid_max.exists() else 1 << 22
    last = int(subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout)
    for pid in ((last + i) % wrap for i in range(1, count + 1)):
        (tmp / f"ompi.{pid}").mkdir(exist_ok=True)
        (tmp / f"ompi.{pid}" / f"pmix.{host}.tool").write_text("stale\n")


def test_a_killed_launchers_leftovers_do_not_stop_the_suites_launches(tmp_path):
    machine_tmp = tmp_path / "machine-tmp"
    machine_tmp.mkdir()
    _plant_stale_launcher_sessions(machine_tmp, 500)
    env = dict(mpi_env(), TMPDIR=str(machine_tmp))
    launch = mpirun_command(1) + ["true"]
    plain = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=60)
    if plain.returncode == 0:
        pytest.skip("this MPI's launcher starts beside stale session files")
    # The same launch from a test, through the suite's conftest.
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_generated.py").write_text(
        f"import subprocess\n\n\ndef test_launch():\n"
        f"    subprocess.run({launch!r}, check=True, timeout=60)\n")
    proc = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts=", "test_generated.py"], 120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, plain.stderr + proc.stdout + proc.stderr
