"""launch.run: an exception on one rank ends the whole job promptly; SIGTERM runs the checkpoint.

The MPI cases start real ``mpirun`` jobs (the command and environment of ``tests/test_mpi.py``);
each is bounded by a timeout (``run_bounded``) that ends a hung job and fails the test, so a
regression cannot stall CI; nothing asserts how long a job took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import launch.run as launch_run
from launch.run import abort_on_exception, install_sigterm_handler, stop_requested

try:
    from test_mpi import mpi_env, mpirun_command, run_bounded
except ImportError:  # pytest's importlib mode does not put tests/ on sys.path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mpi import mpi_env, mpirun_command, run_bounded

REPO = Path(__file__).resolve().parent.parent
HANG_S = 120  # a job still running after this long is hung (ending one takes a few seconds)


def _env() -> dict[str, str]:
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in list(env):  # a CI runner inside a SLURM job must not leak its step into the test
        if key.startswith(("SLURM", "PBS_", "PALS_", "PMI_")):
            del env[key]
    return env


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", "run", *args]


# --------------------------------------------------------------------------------------------------
# Abort on an exception


def test_exception_on_rank_1_of_4_ends_the_job(tmp_path):
    script = _script(tmp_path, "boom.py", """\
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            raise RuntimeError("deliberate failure on rank 1")
        if comm.rank == 2:
            comm.recv(source=1)          # waits for a message that never comes
        comm.Barrier()                   # ranks 0 and 3 wait for rank 1 forever
        print("survived", comm.rank)
        """)
    proc = run_bounded(mpirun_command(4) + _launch(str(script)), HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "[rank 1] Traceback (most recent call last):" in proc.stderr
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in proc.stderr
    assert f"[rank 1]   File \"{script}\"" in proc.stderr  # the runner's own frames are trimmed
    assert "survived" not in proc.stdout
    assert "[rank 0] Traceback" not in proc.stderr


def test_nonzero_exit_on_one_rank_ends_the_job(tmp_path):
    script = _script(tmp_path, "leave.py", """\
        import sys
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            sys.exit(3)
        comm.Barrier()
        """)
    proc = run_bounded(mpirun_command(2) + _launch(str(script)), HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert "[rank 1] exited with status 3" in proc.stderr


def test_nonzero_exit_prints_the_error_being_handled(tmp_path):
    script = _script(tmp_path, "leave2.py", """\
        import sys
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            try:
                open("/nonexistent/run.toml")
            except OSError:
                sys.exit(2)  # handled, but the job cannot go on
        comm.Barrier()
        """)
    proc = run_bounded(mpirun_command(2) + _launch(str(script)), HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert ("[rank 1] exited with status 2 (FileNotFoundError: [Errno 2] No such file or "
            "directory: '/nonexistent/run.toml'): aborting all 2 ranks") in proc.stderr


def test_exit_message_is_said_once_with_the_rank(tmp_path):
    script = _script(tmp_path, "leave_msg.py", """\
        import sys
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            sys.exit("cannot read scene 17")
        comm.Barrier()
        """)
    proc = run_bounded(mpirun_command(2) + _launch(str(script)), HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode == 1
    assert "[rank 0] exited with status 1 (cannot read scene 17): aborting all 2 ranks" in \
        proc.stderr
    assert proc.stderr.count("cannot read scene 17") == 1, proc.stderr


def test_trainer_option_bad_on_one_rank_only_is_printed(tmp_path):
    """MPMD: rank 1 gets a bad --steps. The ranks agree on parsing, so rank 0 prints rank 1's
    error once, naming the rank, and 'launch run' says why each rank exited (not a bare status)."""
    common = ["-m", "sparsepipe_hpc.train", "--data", str(tmp_path / "none"), "--out",
              str(tmp_path / "out")]
    cmd = (mpirun_command(1) + _launch(*common, "--steps", "2") + [":", "-n", "1"]
           + _launch(*common, "--steps", "x"))
    proc = run_bounded(cmd, HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0
    bad = "argument --steps: invalid positive int value: 'x' (see --help) (rank 1 of 2)"
    assert f"sparsepipe_hpc.train: error: {bad}" in proc.stderr, proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] exited with status 2 (SetupError: {bad})" in proc.stderr


_EARLY = """\
    import sys
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        {leave}                 # rank 1 is done ...
    else:
        comm.Barrier()          # ... while rank 0 waits for it in a collective
    print("done", comm.rank, flush=True)
    """


@pytest.mark.parametrize("leave", ["pass", "sys.exit(0)"])
def test_rank_that_finishes_early_ends_the_job(tmp_path, leave):
    script = _script(tmp_path, "early.py", _EARLY.format(leave=leave))
    cmd = mpirun_command(2) + _launch("--exit-timeout", "2", str(script))
    proc = run_bounded(cmd, HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("[rank 1] finished 2 s ago, but not all 2 ranks have: the others are presumably "
            "waiting for rank 1 in a collective or a receive it skipped") in proc.stderr
    assert "done 0" not in proc.stdout


def test_exit_timeout_from_the_environment(tmp_path):
    script = _script(tmp_path, "early.py", _EARLY.format(leave="pass"))
    env = dict(_env(), LAUNCH_EXIT_TIMEOUT="1")
    proc = run_bounded(mpirun_command(2) + _launch(str(script)), HANG_S, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert "[rank 1] finished 1 s ago" in proc.stderr


def test_rank_that_finishes_later_is_waited_for(tmp_path):
    """Rank 0 works on alone after the others finished: no abort. The target still initializes
    MPI itself (its mpi4py.rc settings hold)."""
    script = _script(tmp_path, "late.py", """\
        import time
        import mpi4py
        mpi4py.rc.thread_level = "funneled"
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        assert MPI.Query_thread() == MPI.THREAD_FUNNELED, MPI.Query_thread()
        total = comm.allreduce(comm.rank)
        if comm.rank == 0:
            time.sleep(1.5)     # e.g. writing the results alone
        print("done", comm.rank, total, flush=True)
        """)
    cmd = mpirun_command(2) + _launch("--exit-timeout=60", str(script))
    proc = run_bounded(cmd, HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["done 0 1", "done 1 1"]
    assert "aborting" not in proc.stderr


@pytest.mark.parametrize("text, seconds", [("2.5", 2.5), ("0", None), (None, 300.0)])
def test_exit_timeout_parsing(monkeypatch, text, seconds):
    monkeypatch.delenv("LAUNCH_EXIT_TIMEOUT", raising=False)
    assert launch_run.exit_timeout(text) == seconds
    monkeypatch.setenv("LAUNCH_EXIT_TIMEOUT", "7")
    assert launch_run.exit_timeout(None) == 7.0


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf"])
def test_bad_exit_timeout_is_named(text):
    with pytest.raises(launch_run.LaunchError, match=f"--exit-timeout '{text}' is not a number"):
        launch_run.exit_timeout(text)


def test_one_rank_exits_1_without_abort(tmp_path):
    script = _script(tmp_path, "boom1.py", """\
        from mpi4py import MPI
        assert MPI.COMM_WORLD.size == 1
        raise KeyError("alone")
        """)
    proc = subprocess.run(_launch(str(script)), env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "[rank 0] KeyError: 'alone'" in proc.stderr
    assert "MPI_ABORT" not in proc.stderr and "aborting" not in proc.stderr


def test_hook_labels_the_rank_and_returns_without_mpi(monkeypatch, capsys):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(launch_run, "_live_mpi", lambda: None)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    abort_on_exception()
    try:
        raise ValueError("bad voxel")
    except ValueError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # returns: Python would exit 1
    err = capsys.readouterr().err
    assert err.startswith("[rank 3] Traceback (most recent call last):")
    assert "[rank 3] ValueError: bad voxel" in err
    assert all(line.startswith("[rank 3] ") for line in err.splitlines())


def _hook_with_world(monkeypatch, rank: int, size: int) -> list[int]:
    """Install the abort hook over a fake live MPI world; returns the codes Abort was called with."""
    calls: list[int] = []

    class FakeComm:
        def Get_rank(self):
            return rank

        def Get_size(self):
            return size

        def Abort(self, code):
            calls.append(code)

    class FakeMPI:
        COMM_WORLD = FakeComm()

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(launch_run, "_live_mpi", lambda: FakeMPI)
    abort_on_exception()
    return calls


def test_hook_aborts_a_live_multi_rank_world(monkeypatch, capsys):
    calls = _hook_with_world(monkeypatch, 2, 4)
    sys.excepthook(OSError, OSError("disk"), None)
    assert calls == [1]
    assert "[rank 2] OSError: disk" in capsys.readouterr().err


def test_hook_aborts_where_stderr_cannot_be_written(monkeypatch):
    """A full disk under a per-rank ``2> file``: the traceback cannot be written, the abort must
    still happen (it came after the write, which raised: the job hung)."""

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    calls = _hook_with_world(monkeypatch, 1, 2)
    monkeypatch.setattr(sys, "stderr", Full())
    with pytest.raises(OSError, match="No space"):
        sys.excepthook(RuntimeError, RuntimeError("rank 1 failed"), None)
    assert calls == [1]


# --------------------------------------------------------------------------------------------------
# SIGTERM


_TERM_SCRIPT = """\
    import sys, time
    from launch.run import install_sigterm_handler
    try:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank if len(sys.argv) > 2 else 0
        if len(sys.argv) > 2:
            MPI.COMM_WORLD.Barrier()
    except ImportError:
        rank = 0

    def last_checkpoint():
        with open(f"{sys.argv[1]}.{rank}", "w") as handle:
            handle.write(f"checkpoint of rank {rank}\\n")

    install_sigterm_handler(last_checkpoint)
    if rank == 0:
        print("ready", flush=True)
    while True:
        time.sleep(0.02)
    """


def _terminate_when_ready(cmd, tmp_path):
    proc = subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # let every rank reach its sleep loop
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_sigterm_runs_the_callback_then_exits_143(tmp_path):
    script = _script(tmp_path, "term.py", _TERM_SCRIPT)
    code, err = _terminate_when_ready(_launch(str(script), str(tmp_path / "ckpt")), tmp_path)
    assert code == 143, err
    assert (tmp_path / "ckpt.0").read_text() == "checkpoint of rank 0\n"
    assert "[rank 0] SIGTERM received: running the last-checkpoint callback" in err
    assert "Traceback" not in err


def test_sigterm_to_mpirun_checkpoints_every_rank(tmp_path):
    script = _script(tmp_path, "term.py", _TERM_SCRIPT)
    cmd = mpirun_command(2) + _launch(str(script), str(tmp_path / "ckpt"), "mpi")
    code, err = _terminate_when_ready(cmd, tmp_path)
    assert code != 0
    for rank in range(2):
        assert (tmp_path / f"ckpt.{rank}").read_text() == f"checkpoint of rank {rank}\n", err


def test_sigterm_to_one_rank_with_a_callback_ends_the_job(tmp_path):
    """The signal reaches rank 1 alone (a node agent, ``kill``): it runs its callback and leaves
    with 143; rank 0 waits in a collective for it, so the job is aborted after the exit timeout
    (it hung: a Terminated rank was assumed to have company)."""
    script = _script(tmp_path, "term_one.py", """\
        import os, signal, time
        from mpi4py import MPI
        from launch.run import install_sigterm_handler
        comm = MPI.COMM_WORLD
        install_sigterm_handler(lambda: print(f"checkpoint {comm.rank}", flush=True))
        for step in range(10_000):
            if comm.rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            comm.allreduce(step)
            time.sleep(0.01)
        print("finished", comm.rank, flush=True)
        """)
    cmd = mpirun_command(2) + _launch("--exit-timeout", "2", str(script))
    proc = run_bounded(cmd, HANG_S, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "checkpoint 1" in proc.stdout and "finished" not in proc.stdout
    assert ("[rank 1] finished 2 s ago, but not all 2 ranks have: the others are presumably "
            "waiting for rank 1 in a collective or a receive it skipped (it stopped on a signal "
            "they may not have had)") in proc.stderr


@pytest.fixture
def restore_sigterm(monkeypatch):
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(launch_run, "_stop_signal", None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_without_callback_only_the_flag_is_raised(restore_sigterm):
    install_sigterm_handler()
    assert not stop_requested()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary
    assert stop_requested()


def test_callback_without_exit_and_repeat_signal_ignored(restore_sigterm):
    calls = []
    install_sigterm_handler(lambda: calls.append("ckpt"), exit_after=False)
    for _ in range(2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert calls == ["ckpt"] and stop_requested()


def test_callback_then_terminated(restore_sigterm):
    install_sigterm_handler(lambda: None)
    with pytest.raises(launch_run.Terminated) as info:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert info.value.code == 143 and isinstance(info.value, SystemExit)


def test_handler_must_be_installed_from_the_main_thread():
    import threading

    errors = []
    thread = threading.Thread(target=lambda: errors.append(
        pytest.raises(launch_run.LaunchError, install_sigterm_handler, lambda: None)))
    thread.start()
    thread.join()
    assert "main thread" in str(errors[0].value)


# --------------------------------------------------------------------------------------------------
# The runner's command line


_ECHO = """\
    import json, sys
    print(json.dumps({"name": __name__, "argv": sys.argv}))
    """


def test_runs_a_module_with_its_arguments(tmp_path):
    _script(tmp_path, "echo_args.py", _ECHO)
    proc = subprocess.run(_launch("-m", "echo_args", "a", "--b", "c d"), env=_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(proc.stdout)
    assert out["name"] == "__main__" and out["argv"][1:] == ["a", "--b", "c d"]
    assert out["argv"][0].endswith("echo_args.py")


def test_runs_a_script_with_its_arguments(tmp_path):
    script = _script(tmp_path, "echo_args.py", _ECHO)
    proc = subprocess.run(_launch(str(script), "-x", "1"), env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(proc.stdout) == {"name": "__main__", "argv": [str(script), "-x", "1"]}


def test_runs_a_command(tmp_path):
    proc = subprocess.run(_launch("-c", "import sys; print(sys.argv)", "z"), env=_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "['-c', 'z']"


@pytest.mark.parametrize("args, message", [
    ([], "usage"), (["--bogus"], "unknown option '--bogus'"), (["-m"], "-m needs an argument"),
    (["missing.py"], "script 'missing.py' does not exist"),
    (["--exit-timeout"], "--exit-timeout needs a number of seconds"),
    (["--exit-timeout", "soon", "x.py"], "--exit-timeout 'soon' is not a number of seconds"),
    (["-m", "no_such_module"], "no module named 'no_such_module'"),
    (["-m", "no_such.module"], "no module named 'no_such.module'"),
])
def test_bad_command_lines_exit_2(tmp_path, args, message):
    proc = subprocess.run(_launch(*args), env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_top_level_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch", "nonsense"], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown command 'nonsense'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "launch", "--help"], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=True)
    assert all(word in proc.stdout for word in ("info", "run", "job"))


_SLURM_STEP_OF_2 = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}


@pytest.mark.parametrize("command", [
    ["-m", "launch", "run", "-c", "from mpi4py import MPI; print('trained alone')"],
    ["-m", "launch", "info"],
    ["-m", "sparsepipe_hpc.train", "--steps", "1"],
])
def test_a_process_that_mpi_sees_alone_in_a_launcher_step_stops(tmp_path, command):
    """srun started 2 tasks, but MPI was not started by it (an srun without the PMI plugin the
    MPI needs): each process alone would train on its own into one --out."""
    proc = subprocess.run([sys.executable, *command], env={**_env(), **_SLURM_STEP_OF_2},
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "slurm started 2 processes, but MPI gives this one a world of 1" in proc.stderr
    assert "trained alone" not in proc.stdout and not list(tmp_path.iterdir())


def test_the_trainer_help_is_printed_in_any_world(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.train", "--help"],
                          env={**_env(), **_SLURM_STEP_OF_2}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--grid" in proc.stdout, proc.stderr


def test_a_script_started_inside_a_step_of_several_tasks_runs_alone(tmp_path):
    env = {**_env(), **_SLURM_STEP_OF_2, "SLURM_TASK_PID": "1"}  # srun's task is another process
    proc = subprocess.run([sys.executable, "-m", "launch", "run", "-c",
                           "from mpi4py import MPI; print('ran', MPI.COMM_WORLD.Get_size())"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran 1", proc.stderr


def test_a_module_whose_package_fails_to_import_shows_its_own_error(tmp_path):
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_dependency\n")
    (pkg / "main.py").write_text("print('never')\n")
    proc = subprocess.run(_launch("-m", "brokenpkg.main"), env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no_such_dependency" in proc.stderr
    assert "no module named 'brokenpkg.main'" not in proc.stderr

