"""``bench prefetch`` runs end to end on a CPU at a tiny size and writes its JSON (structure
only: the figures measure the machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import repo_env
from sparsepipe_hpc.data.synth import generate_scenes


def run(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "prefetch", *args],
                          env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


def test_prefetch_benchmark_runs_on_cpu_and_writes_its_figures(tmp_path):
    data = generate_scenes(tmp_path / "data", train=6, val=2, seed=0, objects=(2, 3),
                           points=(1000, 1500))
    out = tmp_path / "prefetch.json"
    proc = run(["--device", "cpu", "--steps", "2", "--rounds", "2", "--json", str(out), "--",
                "--data", str(data), "--width", "4", "--depth", "2", "--voxel-size", "0.25",
                "--batch-size", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hidden" in proc.stdout
    r = json.loads(out.read_text())
    assert r["benchmark"] == "prefetch" and r["config"]["width"] == 4
    assert r["steps_per_mode"] == 4 == len(r["inline_steps_s"]) == len(r["ahead_steps_s"])
    assert r["inline_step_s"] > 0 and r["ahead_step_s"] > 0 and r["read_s"] > 0
    assert r["environment"]["threads"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_cuda_is_a_clear_error(tmp_path):
    proc = run(["--device", "cuda"], tmp_path)
    assert proc.returncode != 0 and "torch sees no CUDA device" in proc.stderr


@pytest.mark.parametrize("option", ["--device", "--steps=3", "--no-prefetch"])
def test_trainer_options_the_benchmark_sets_are_refused(tmp_path, option):
    """Appended after the user's, the benchmark's own options won silently (a --device cuda
    after '--' ran on the CPU)."""
    proc = run(["--", option, "x"], tmp_path)
    flag = option.split("=")[0]
    assert proc.returncode != 0 and f"the trainer option {flag} is the benchmark's own" \
        in proc.stderr
