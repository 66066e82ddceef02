"""Ranks that disagree stop together with the values, under real mpirun (MPMD: one command per rank).

Before these checks each case hung forever (a config file failing on one rank, --grid or --steps
differing), crashed in MPI (--width: MPI_ERR_TRUNCATE) or trained silently (--lr, other data).
Each run is bounded by a timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparsepipe_hpc.data.synth import generate_scenes
from test_mpi import mpi_env, mpirun_command

HANG = 180  # seconds: far beyond the few seconds a refusal takes


@pytest.fixture(scope="module")
def rooms(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("agree")
    generate_scenes(root / "a", train=4, val=2, seed=1, objects=(2, 3),
                    points=(800, 1000))
    generate_scenes(root / "b", train=6, val=2, seed=1, objects=(2, 3),
                    points=(800, 1000))
    return root


def trainer_args(data: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparsepipe_hpc.train", "--data", data, "--out", str(out),
            "--width", "4", "--depth", "2", "--voxel-size", "0.25", "--batch-size", "2",
            "--steps", "2", "--no-progress", *extra]


def mpmd(per_rank: list[list[str]], wdirs: list[Path]) -> subprocess.CompletedProcess:
    """``mpirun -n 1 [--wdir D0] CMD0 : -n 1 [--wdir D1] CMD1``: each rank its own command line."""
    cmd = mpirun_command(1)
    for i, (args, wdir) in enumerate(zip(per_rank, wdirs)):
        cmd += ([":", "-n", "1"] if i else []) + ["--wdir", str(wdir)] + args
    return subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=HANG)


@pytest.mark.parametrize("option,values,shown", [
    ("--lr", ("0.01", "0.02"), "lr: rank 0 0.01, rank 1 0.02"),
    ("--steps", ("2", "3"), "steps: rank 0 2, rank 1 3"),
    ("--width", ("4", "8"), "width: rank 0 4, rank 1 8"),
    ("--grid", ("2,1,1", "1,1,1"), "grid: rank 0 [2, 1, 1], rank 1 [1, 1, 1]"),
])
def test_different_options_on_one_rank_stop_every_rank(rooms, tmp_path, option, values, shown):
    data = str(rooms / "a" / "scenes")
    proc = mpmd([trainer_args(data, tmp_path / "out", option, v) for v in values],
                [tmp_path, tmp_path])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "the ranks disagree on the configuration" in proc.stderr
    assert shown in proc.stderr
    assert not (tmp_path / "out" / "last.pt").exists()


def test_config_file_failing_on_one_rank_stops_every_rank(rooms, tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("lr = 0.01\n")
    bad.write_text("lr = = 0.01\n")
    data = str(rooms / "a" / "scenes")
    proc = mpmd([trainer_args(data, tmp_path / "out", "--config", str(f)) for f in (good, bad)],
                [tmp_path, tmp_path])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bad.toml: not valid TOML" in proc.stderr and "(rank 1 of 2)" in proc.stderr


def test_help_on_one_rank_stops_every_rank(rooms, tmp_path):
    """argparse's --help exits (SystemExit) inside the agreed parse: alone, rank 1 left the
    others waiting for it for ever."""
    data = str(rooms / "a" / "scenes")
    proc = mpmd([trainer_args(data, tmp_path / "out"), trainer_args(data, tmp_path / "out",
                                                                    "--help")],
                [tmp_path, tmp_path])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 1 of 2 left (SystemExit: exit status 0: --help" in proc.stderr
    assert not (tmp_path / "out" / "last.pt").exists()


def test_an_exit_inside_an_agreed_step_leaves_as_asked():
    """A signal handler's exit (launch.run.Terminated, status 143) inside agree() is re-raised
    after the allgather, not turned into a SetupError (exit 2)."""
    from mpi4py import MPI

    from launch.run import Terminated
    from sparsepipe_hpc.train.agreement import agree

    def stopped():
        raise Terminated(143)

    with pytest.raises(Terminated) as info:
        agree(MPI.COMM_SELF, stopped)
    assert info.value.code == 143


def test_help_on_every_rank_prints_it_and_exits_0(rooms, tmp_path):
    proc = mpmd([trainer_args("scenes", tmp_path / "out", "--help")] * 2, [tmp_path, tmp_path])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("usage: ") == 2 and "error" not in proc.stderr


def test_node_local_checkpoints_of_other_steps_stop_every_rank(rooms, tmp_path):
    """--out relative to each rank's directory (a node-local disk) holding checkpoints of other
    steps: each rank resumed from its own, and they trained on from steps 2 and 1."""
    data = str(rooms / "a" / "scenes")
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d, steps in zip(dirs, ("2", "1")):
        d.mkdir()
        args = trainer_args(data, Path("out"))
        args[args.index("--steps") + 1] = steps
        done = subprocess.run(args, cwd=d, env=mpi_env(), capture_output=True, text=True,
                              timeout=HANG)
        assert done.returncode == 0, done.stderr[-3000:]
    resume = trainer_args(data, Path("out"), "--resume", "auto")
    resume[resume.index("--steps") + 1] = "3"
    proc = mpmd([resume, resume], dirs)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "the ranks disagree on the checkpoint resumed (step: rank 0 2, rank 1 1)" in proc.stderr


def test_different_data_under_the_same_path_stops_every_rank(rooms, tmp_path):
    """`--data scenes` read from two working directories: 4 training scenes on rank 0, 6 on rank 1."""
    proc = mpmd([trainer_args("scenes", tmp_path / "out")] * 2, [rooms / "a", rooms / "b"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "the ranks disagree on the data" in proc.stderr
    assert "train.samples: rank 0 4, rank 1 6" in proc.stderr


def test_agreeing_ranks_still_train(rooms, tmp_path):
    data = str(rooms / "a" / "scenes")
    proc = mpmd([trainer_args(data, tmp_path / "out")] * 2, [tmp_path, tmp_path])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "last.pt").exists()


def test_disk_full_at_a_checkpoint_mid_run_ends_every_rank_with_one_message(rooms, tmp_path):
    """Rank 0's checkpoint write fails at step 1 (ENOSPC, as on a full disk):
    every rank stops with one message and exit 2, not a traceback per rank or a hang."""
    runner = tmp_path / "run.py"
    runner.write_text(
        "import errno, sys\n"
        "from sparsepipe_hpc.train import checkpoint\n"
        "def full(*a, **k):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "checkpoint._save_to = full\n"
        "from sparsepipe_hpc.train.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    args = trainer_args(str(rooms / "a" / "scenes"), tmp_path / "out", "--checkpoint-every", "1")
    args = [sys.executable, str(runner), *args[3:]]
    proc = subprocess.run(mpirun_command(2) + args, env=mpi_env(), capture_output=True,
                          text=True, timeout=HANG)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    first = proc.stderr.splitlines()[0]
    assert first.startswith("sparsepipe_hpc.train: error: ") and "No space left" in first
    assert "Traceback" not in proc.stderr
