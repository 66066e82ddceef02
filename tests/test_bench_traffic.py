"""``bench traffic`` counts the bytes each op moves, and runs end to end on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from helpers import repo_env
from sparsepipe_hpc.bench.traffic import count_traffic


def test_counts_inputs_and_outputs_and_skips_views_and_allocations():
    a, b = torch.ones(1000), torch.ones(1000)

    def step():
        c = torch.empty(1000)
        c.copy_(a + b)  # add: 3 x 4000 bytes; copy_: 3 x 4000 (its target read and written)
        c.view(10, 100).sum()  # view: nothing; sum: 4000 in, 4 out

    r = count_traffic(step)
    assert r["ops"] == {"add": {"bytes": 12000, "calls": 1}, "copy_": {"bytes": 12000, "calls": 1},
                        "sum": {"bytes": 4004, "calls": 1}}
    assert r["total_bytes"] == 28004
    assert r["saved_bytes"] == 0  # nothing needed a gradient


def test_saved_bytes_count_each_storage_once():
    """What autograd keeps for backward: x once though two ops save it, y; not the views."""
    x = torch.ones(1000, requires_grad=True)

    def step():
        y = x * x  # mul saves x (twice: both operands)
        y.view(10, 100).exp()  # exp saves its output (a new storage); the view saves nothing

    assert count_traffic(step)["saved_bytes"] == 4000 + 4000


def test_traffic_benchmark_runs_on_cpu_and_writes_its_figures(tmp_path):
    out = tmp_path / "traffic.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sparsepipe_hpc.bench", "traffic", "--rooms", "1", "--voxel-size",
         "0.2", "--points", "20000", "--width", "4", "--depth", "2", "--json", str(out)],
        env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "traffic" and r["scene"]["voxels"] > 0
    nets = r["networks"]
    assert set(nets) == {"spconv_unet", "sparseunet", "distributed_1x1x1"}
    for net in nets.values():
        assert net["total_bytes"] == sum(o["bytes"] for o in net["ops"].values()) > 0
        assert "view" not in net["ops"] and "mm" in net["ops"]
        assert net["saved_bytes"] > 0
    # the two U-Nets do the same GEMMs (spconv's Native algorithm on the CPU calls torch.mm)
    assert nets["sparseunet"]["ops"]["mm"] == nets["spconv_unet"]["ops"]["mm"]
