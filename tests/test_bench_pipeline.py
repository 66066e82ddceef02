"""The pipeline benchmark's measuring parts without MPI (saved-activation meter, bubble from
spans), and the benchmark end to end under mpirun -n 2 at a tiny size (the JSON's structure and
the figures that do not depend on timing; the times themselves measure the machine)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sparsepipe_hpc.bench._activations import SavedTensorMeter
from sparsepipe_hpc.bench.pipeline import bubble_from_spans
from sparsepipe_hpc.tracing import Span
from test_mpi import mpi_env, mpirun_command, run_bounded


def test_meter_counts_saved_activations_once_and_frees_them_with_the_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(10, 10)
    x = torch.randn(32, 10, requires_grad=True)
    meter = SavedTensorMeter(exclude=lin.parameters())
    with meter:
        y1 = lin(x).relu().sum()        # saves x (addmm's input) and relu's output
        one = meter.live_bytes
        y2 = (lin(x) * x).sum()         # x again (the same storage: no new bytes), x for mul
        two = meter.live_bytes
        y1.backward()
        after_first = meter.live_bytes
        y2.backward()
    assert one == 2 * 32 * 10 * 4       # parameters (the weight addmm saves) are excluded
    assert two == one + 32 * 10 * 4     # lin(x) of the second graph, saved by mul; x counted once
    assert meter.peak_bytes == two
    assert after_first == two - 32 * 10 * 4  # relu's output went with the first graph
    assert meter.live_bytes == 0
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_bubble_from_spans_counts_idle_rank_time_in_the_pipeline_window():
    rows = [[Span("F0", "forward", 0.0, 1.0), Span("SA0>1", "send", 1.0, 1.2),
             Span("RG0<1", "recv", 1.2, 3.0), Span("B0", "backward", 3.0, 4.0),
             Span("STEP", "step", 4.0, 9.0)],                      # after the window
            [Span("RA0<0", "recv", 0.0, 1.5), Span("rebuild", "kmap", 1.3, 1.5),
             Span("F0", "forward", 1.5, 2.0), Span("halo wait", "halo", 1.6, 1.7),
             Span("B0", "backward", 2.0, 3.0)]]
    got = bubble_from_spans(rows)
    assert got["window_s"] == pytest.approx(4.0)
    assert got["busy_s"] == pytest.approx([2.0, 1.7])   # kmap rebuilding is work, not idle
    assert got["bubble"] == pytest.approx(1 - 3.7 / 8.0)
    assert got["bubble_model_only"] == pytest.approx(1 - 3.5 / 8.0)
    assert got["fwd_mean_s"] == pytest.approx([1.0, 0.5])
    assert got["recv_s"] == pytest.approx([1.8, 1.5])
    with pytest.raises(ValueError, match="no forward/backward spans"):
        bubble_from_spans([[], []])


def test_pipeline_benchmark_runs_on_two_ranks(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = mpirun_command(2) + [sys.executable, "-m", "sparsepipe_hpc.bench", "pipeline",
                               "--batch", "2", "--points", "1500", "--voxel-size", "0.12",
                               "--width", "4", "--depth", "2", "--micro-batches", "1", "2",
                               "--repeats", "1", "--json", str(out)]
    proc = run_bounded(cmd, 300, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ranks"] == 2 and r["batch"] == 2 and sum(r["balance"]) == 6
    assert set(r["balance_busy_s"]) == {f"{k},{6 - k}" for k in range(1, 6)}
    names = {f"pipe-{k}-m{m}" for k in ("gpipe", "1f1b") for m in (1, 2)} | {"data", "spatial"}
    assert set(r["variants"]) == names
    for name, row in r["variants"].items():
        assert row["step_s"] > 0 and len(row["step_s_all"]) == 1
        assert len(row["peak_saved_bytes_per_rank"]) == 2
        assert all(b > 0 for b in row["peak_saved_bytes_per_rank"]), name
        if name.startswith("pipe"):
            m = row["micro_batches"]
            assert row["bubble_theory"] == pytest.approx(1 / (m + 1))
            assert 0 <= row["bubble_measured"] < 1 and 0 <= row["bubble_simulated"] < 1
            assert len(row["stage_fwd_s"]) == len(row["stage_recv_s"]) == 2
    # Saved activations do not depend on timing: at m = 2 the last stage holds one micro-batch
    # under 1F1B and two under GPipe; the first stage two under both.
    g = r["variants"]["pipe-gpipe-m2"]["peak_saved_bytes_per_rank"]
    f = r["variants"]["pipe-1f1b-m2"]["peak_saved_bytes_per_rank"]
    assert f[1] < g[1] and f[0] == g[0]
    assert "1f1b_peak_below_gpipe_every_stage" not in r["targets"]  # no m >= 4 was run
