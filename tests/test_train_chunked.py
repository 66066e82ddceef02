"""The trainer on the chunked scene layout under mpirun: each spatial rank reads only the chunks
near its box (distributed input, picked by --input auto), and the loss curve and evaluation equal
the single-process run's to float32 rounding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparsepipe_hpc.data.scenes import SceneDataset
from sparsepipe_hpc.data.synth import generate_scenes
from sparsepipe_hpc.train.metrics import read_metrics
from test_mpi import mpi_env, mpirun_command


@pytest.fixture(scope="module")
def rooms(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chunked_rooms")
    d = generate_scenes(root, train=6, val=2, seed=3, objects=(2, 4), points=(3000, 4000),
                        chunk_size=0.4)
    assert SceneDataset(d, "train").chunk_table(0) is not None
    return d


def run(rooms: Path, out: Path, n: int, *extra: str) -> list[dict]:
    args = ["-m", "sparsepipe_hpc.train", "--data", str(rooms), "--out", str(out),
            "--width", "4", "--depth", "2", "--voxel-size", "0.1", "--batch-size", "2",
            "--steps", "4", "--optimizer", "sgd", "--lr", "0.05", "--eval-every", "4",
            "--augment", "--no-progress", *extra]
    cmd = (mpirun_command(n) if n > 1 else []) + [sys.executable, *args]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


def losses(metrics: list[dict]) -> list[float]:
    return [r["loss"] for r in metrics if r["kind"] == "train"]


@pytest.mark.parametrize("n,grid,cuts", [(4, "2,2,1", "balanced"), (2, "1,2,1", "uniform")])
def test_chunked_layout_trains_like_single_process(rooms, tmp_path, n, grid, cuts):
    ref = run(rooms, tmp_path / "serial", 1)
    got = run(rooms, tmp_path / f"grid{n}", n, "--grid", grid, "--cuts", cuts)
    assert len(losses(got)) == len(losses(ref)) == 4
    assert losses(got) == pytest.approx(losses(ref), rel=1e-4)
    (e_ref,), (e_got,) = ([r for r in m if r["kind"] == "eval"] for m in (ref, got))
    assert e_got["voxels"] == e_ref["voxels"]
    assert e_got["oa"] == pytest.approx(e_ref["oa"], abs=2 / e_ref["voxels"])
    if cuts == "uniform":  # the same boxes either way: the chunked read is the whole read, bit
        whole = run(rooms, tmp_path / "whole", n, "--grid", grid, "--cuts", cuts,  # for bit
                    "--input", "whole")
        assert losses(got) == losses(whole)
