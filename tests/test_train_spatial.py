"""The trainer, spatially parallel end to end under mpirun, against the single-process trainer.

Same data, same seed, same global batch: the loss curve and the final evaluation of
``--grid 2,1,1`` over 2 replicas (4 ranks) and of ``--grid 3,1,1`` (3 ranks, an odd count) equal
the single-process run's to float32 rounding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparsepipe_hpc.data.synth import generate_scenes
from sparsepipe_hpc.train.metrics import read_metrics
from test_mpi import mpi_env, mpirun_command


@pytest.fixture(scope="module")
def rooms(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rooms")
    return generate_scenes(root, train=8, val=2, seed=1, objects=(2, 4), points=(3000, 4000))


def run(rooms: Path, out: Path, n: int, *extra: str) -> list[dict]:
    args = ["-m", "sparsepipe_hpc.train", "--data", str(rooms), "--out", str(out),
            "--width", "4", "--depth", "2", "--voxel-size", "0.1", "--batch-size", "2",
            "--steps", "4", "--optimizer", "sgd", "--lr", "0.05", "--eval-every", "4",
            "--no-progress", *extra]
    cmd = (mpirun_command(n) if n > 1 else []) + [sys.executable, *args]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("n,grid", [(4, "2,1,1"), (3, "3,1,1")])
def test_spatial_trainer_matches_single_process(rooms, tmp_path, n, grid):
    ref = run(rooms, tmp_path / "serial", 1)
    got = run(rooms, tmp_path / f"grid{n}", n, "--grid", grid)
    ref_train = [r["loss"] for r in ref if r["kind"] == "train"]
    got_train = [r["loss"] for r in got if r["kind"] == "train"]
    assert len(got_train) == len(ref_train) == 4
    assert got_train == pytest.approx(ref_train, rel=1e-4)
    (e_ref,), (e_got,) = ([r for r in m if r["kind"] == "eval"] for m in (ref, got))
    assert e_got["voxels"] == e_ref["voxels"]
    assert e_got["oa"] == pytest.approx(e_ref["oa"], abs=2 / e_ref["voxels"])


def test_spatial_trainer_resumes_exactly(rooms, tmp_path):
    """Stopped after 2 steps and resumed to 4 on a 2-rank grid: the uninterrupted loss curve."""
    common = ("--grid", "2,1,1", "--schedule", "constant")
    full = run(rooms, tmp_path / "full", 2, *common)
    run(rooms, tmp_path / "part", 2, *common, "--steps", "2")
    resumed = run(rooms, tmp_path / "part", 2, *common, "--resume", "auto")
    assert [r["loss"] for r in resumed if r["kind"] == "train"] == \
        [r["loss"] for r in full if r["kind"] == "train"]


def test_grid_finer_than_the_data_is_refused_before_step_1(rooms, tmp_path):
    """--grid 1,1,2 over rooms one stride-8 block tall: a clear error naming the options, exit 2,
    on every rank (it was a CutError traceback in "align 8" terms and an MPI abort mid-step)."""
    args = ["-m", "sparsepipe_hpc.train", "--data", str(rooms), "--out", str(tmp_path / "out"),
            "--width", "4", "--depth", "3", "--voxel-size", "0.5", "--batch-size", "1",
            "--steps", "1", "--grid", "1,1,2", "--no-progress"]
    proc = subprocess.run(mpirun_command(2) + [sys.executable, *args], env=mpi_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stderr.splitlines()[0]
    assert first.startswith("sparsepipe_hpc.train: error: --grid 1,1,2 cuts z into 2 boxes")
    assert "use at most 1 rank(s) along z in --grid" in first
    assert "Traceback" not in proc.stderr


def test_distributed_input_trains_the_same_run(rooms, tmp_path):
    """--input distributed (each rank reads its share of every scene's points) gives the loss
    curve and evaluation of --input whole bit for bit, augmentation on; auto picks it here."""
    common = ("--grid", "3,1,1", "--augment")
    whole = run(rooms, tmp_path / "whole", 3, *common, "--input", "whole")
    dist = run(rooms, tmp_path / "dist", 3, *common, "--input", "distributed")
    auto = run(rooms, tmp_path / "auto", 3, *common)
    assert [r["loss"] for r in dist if r["kind"] == "train"] == \
        [r["loss"] for r in whole if r["kind"] == "train"] == \
        [r["loss"] for r in auto if r["kind"] == "train"]
    (e_whole,), (e_dist,) = ([r for r in m if r["kind"] == "eval"] for m in (whole, dist))
    assert e_dist["oa"] == e_whole["oa"] and e_dist["voxels"] == e_whole["voxels"]

