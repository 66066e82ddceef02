"""Stopping the trainer under real ``mpirun``: which signal checkpoints, and what a kill loses.

Open MPI's ``mpirun`` forwards SIGUSR1 to its ranks and carries on, so the ranks agree at the next
step boundary, checkpoint and exit 0. On its own SIGTERM it kills the ranks (Open MPI 5: SIGCONT,
SIGTERM 0.25 s later, SIGKILL 0.25 s after that, fixed in PRRTE), too soon for a checkpoint and with
their output already cut off; the next ``--resume`` then says which steps were lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi4py import MPI

from sparsepipe_hpc.data.synth import generate_scenes
from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import parse_config
from sparsepipe_hpc.train.loop import Trainer
from sparsepipe_hpc.train.metrics import read_metrics

try:
    from test_mpi import mpi_env, mpirun_command
except ImportError:  # pytest's importlib mode does not put tests/ on sys.path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mpi import mpi_env, mpirun_command

REPO = Path(__file__).resolve().parent.parent
EVERY = 25  # --checkpoint-every: far apart, so that a kill lands between two checkpoints


@pytest.fixture(scope="module")
def rooms(tmp_path_factory) -> Path:
    return generate_scenes(tmp_path_factory.mktemp("data"), train=8, val=2, seed=0,
                           objects=(2, 4), points=(1500, 2500))


def _env() -> dict[str, str]:
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _start(rooms: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = ["--data", str(rooms), "--out", str(out), "--width", "4", "--depth", "2",
            "--voxel-size", "0.2", "--batch-size", "2", "--no-progress", "--steps", "100000",
            "--checkpoint-every", str(EVERY), *extra]
    cmd = mpirun_command(2) + [sys.executable, "-m", "sparsepipe_hpc.train", *args]
    return subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _train_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    try:
        return [r["step"] for r in read_metrics(path, "train")]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def _signal_at(proc: subprocess.Popen, out: Path, step: int, signum: int) -> tuple[str, str]:
    """Send ``signum`` to mpirun once the run has logged ``step``; its output after it ends."""
    deadline = time.monotonic() + 300
    try:
        while max(_train_steps(out), default=0) < step:
            if proc.poll() is not None:
                pytest.fail(f"the run ended before step {step}:\n{proc.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the run did not reach step {step} in 300 s")
            time.sleep(0.05)
        proc.send_signal(signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_sigusr1_to_mpirun_checkpoints_and_sigterm_loses_steps_it_names(rooms, tmp_path):
    out = tmp_path / "run"

    # 1. SIGTERM to mpirun: the ranks are killed within a second, past the checkpoint at EVERY.
    #    (Their own SIGTERM handler gets 0.25 s before the SIGKILL: with steps that short, the
    #    stop checkpoint is sometimes written in time, so what was saved is read back.)
    proc = _start(rooms, out)
    _signal_at(proc, out, EVERY + 2, signal.SIGTERM)
    assert proc.returncode != 0
    reached = max(_train_steps(out))
    saved = ck.load_checkpoint(out / ck.LAST)["step"]
    assert EVERY <= saved <= reached and reached >= EVERY + 2

    # 2. Resume, then SIGUSR1 to mpirun: every rank gets it, checkpoints at the step it reached,
    #    and the job exits 0. The resumed run names the steps the kill lost.
    proc = _start(rooms, out, "--resume", "auto")
    stdout, stderr = _signal_at(proc, out, saved + 3, signal.SIGUSR1)
    assert proc.returncode == 0, stdout + stderr
    lost = (f"note: the previous run in {out} reached step {reached}, but {out / ck.LAST} holds "
            f"step {saved}: steps {saved + 1}-{reached} were lost")
    assert (lost in stdout) == (reached > saved), stdout
    assert f"resumed at step {saved}" in stdout
    assert "[rank 0] SIGUSR1 received: stop flag set" in stderr
    assert "[rank 1] SIGUSR1 received: stop flag set" in stderr
    steps = _train_steps(out)
    stopped = ck.load_checkpoint(out / ck.LAST)["step"]
    assert steps == list(range(1, stopped + 1)) and stopped >= saved + 3
    assert f"stop requested: checkpoint at step {stopped}" in stdout

    # 3. That checkpoint resumes: the run continues from it, and nothing was lost this time.
    proc = _start(rooms, out, "--resume", "auto")
    stdout, stderr = _signal_at(proc, out, stopped + 1, signal.SIGUSR1)
    assert proc.returncode == 0, stdout + stderr
    assert f"resumed at step {stopped}" in stdout and "were lost" not in stdout
    final = ck.load_checkpoint(out / ck.LAST)["step"]
    assert _train_steps(out) == list(range(1, final + 1)) and final > stopped


def test_resume_names_the_steps_a_killed_run_lost(rooms, tmp_path):
    """A run killed after its checkpoint (here: its log carries on past it, as a SIGKILL leaves
    it, with a line cut short) is resumed: the note names the lost steps, the log is cut back."""
    out = tmp_path / "run"
    args = ["--data", str(rooms), "--out", str(out), "--width", "4", "--depth", "2",
            "--voxel-size", "0.2", "--batch-size", "2", "--no-progress", "--steps", "2"]
    Trainer(parse_config(args), MPI.COMM_SELF, log=None).run()
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as log:
        log.write("".join(f'{{"kind": "train", "step": {s}, "loss": 1.0}}\n' for s in (3, 4, 5)))
        log.write('{"kind": "train", "st')
    said: list[str] = []
    trainer = Trainer(parse_config(args + ["--resume", "auto"]), MPI.COMM_SELF, log=said.append)
    assert said == [f"note: the previous run in {out} reached step 5, but {out / ck.LAST} holds "
                    "step 2: steps 3-5 were lost (the run was killed before it could checkpoint "
                    "them) and are trained again"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "train")] == [1, 2]
    trainer.metrics.close()
