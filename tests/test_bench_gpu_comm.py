"""``bench gpu-comm`` on a CPU: its pure parts (hidden fraction, what the n/1-rank ratio means),
its refusals of bad flags, and the overlap and ranks sections end to end under mpirun -n 2 at a
tiny size with ``--device cpu`` (structure only: the figures measure the machine, and a CPU says
nothing about a GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from sparsepipe_hpc.bench._gpu_comm_steps import hidden_fraction, median_se, ranks_note
from test_mpi import mpi_env, mpirun_command, run_bounded

TINY = ["--device", "cpu", "--points", "20000", "--voxel-size", "0.12", "--width", "4",
        "--depth", "2", "--repeats", "2"]
CAVEAT = "about cost, not speed-up"


def test_hidden_fraction_is_the_share_of_the_added_step_time_overlap_removes():
    # without overlap the delay adds 1.0 s, with overlap 0.1 s: 90% hidden
    assert hidden_fraction(on0=1.0, on_d=1.1, off0=1.2, off_d=2.2) == pytest.approx(0.9)
    assert hidden_fraction(1.0, 1.0, 1.0, 1.5) == pytest.approx(1.0)
    assert hidden_fraction(1.0, 2.0, 1.0, 1.5) == pytest.approx(-1.0)  # overlap made it worse
    assert hidden_fraction(1.0, 1.1, 1.2, 1.2) is None  # the delay added nothing: no ratio
    assert hidden_fraction(1.0, 1.1, 1.2, 1.1) is None


def test_median_se_pools_the_spread_of_every_variant_about_its_own_median():
    """Two variants 1 s apart, each spread by +-0.1 s about its median: the pooled median absolute
    deviation is 0.1 s, whatever the variants' own levels."""
    se = median_se([[1.0, 0.9, 1.1, 1.0], [2.1, 1.9, 2.0, 2.0]])
    assert se == pytest.approx(1.2533 * 1.4826 * 0.05 / 2)  # deviations 0,0,.1,.1 x2: median .05
    assert median_se([[1.0, 1.0, 1.0]]) == 0.0


def test_ranks_note_says_when_the_ratio_is_a_cost():
    shared, note = ranks_note("cuda", 2, 2, 16)
    assert shared and CAVEAT in note and "2 ranks share one GPU" in note
    shared, note = ranks_note("cuda", 4, 1, 16)
    assert not shared and "strong-scaling speed-up" in note and CAVEAT not in note
    shared, note = ranks_note("cpu", 4, 4, 2)
    assert shared and "4 ranks share 2 core(s)" in note and CAVEAT in note
    shared, note = ranks_note("cpu", 2, 2, 2)  # a core each: a CPU speed-up, and the GPU caveat
    assert not shared and "core of its own" in note and f"sharing one GPU the ratio is {CAVEAT}" in note


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "gpu-comm", *args],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)


def test_bad_flags_are_refused_with_the_rule():
    out = _bench("--device", "cpu", "--sections", "overlap,speed")
    assert out.returncode == 2
    assert "--sections 'overlap,speed': unknown speed; pass a comma-separated subset of " \
           "sizes,overlap,ranks" in out.stderr, out.stderr
    out = _bench("--device", "cpu", "--transport", "staged", "--sections", "ranks")
    assert out.returncode == 2
    assert "--transport staged moves CUDA device tensors" in out.stderr, out.stderr
    out = _bench("--device", "cpu", "--delay-on", "device")
    assert out.returncode == 2 and "--delay-on device: the mpi transport moves host tensors" \
        in out.stderr, out.stderr
    out = _bench("--device", "cpu", "--delay-ms", "5", "0")
    assert out.returncode == 2 and "--delay-ms 0.0: each delay must be > 0 ms" in out.stderr


def test_one_rank_on_cpu_says_what_it_skipped(tmp_path):
    out = tmp_path / "gc.json"
    proc = _bench(*TINY, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "device transports" in r["sizes"]["skipped"] and "--device cuda" in r["sizes"]["skipped"]
    assert "needs >= 2" in r["overlap"]["skipped"] and "needs >= 2" in r["ranks"]["skipped"]
    assert "scene" not in r  # nothing to measure: no scene was built


def test_overlap_and_ranks_sections_on_two_cpu_ranks(tmp_path):
    out, trace = tmp_path / "gc.json", tmp_path / "trace"
    cmd = mpirun_command(2) + [sys.executable, "-m", "sparsepipe_hpc.bench", "gpu-comm", *TINY,
                               "--sections", "overlap,ranks", "--delay-ms", "30", "60",
                               "--trace", str(trace), "--trace-steps", "1", "--json", str(out)]
    proc = run_bounded(cmd, 240, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["transport"] == "mpi" and r["world_size"] == 2
    assert r["figures"].startswith("CPU") and "sizes" not in r
    ov = r["overlap"]
    assert ov["delay_on"] == "host"  # the mpi transport's wait blocks the host: so does its delay
    assert set(ov["variants"]) == {f"{o}_delay{d}ms" for o in ("overlap", "no_overlap")
                                   for d in (0, 30, 60)}
    for row in ov["variants"].values():
        assert len(row["all_s"]) == 2 and row["median_s"] > 0 and row["exposed_wait_s"] >= 0
    exchanges = ov["variants"]["overlap_delay0ms"]["halo_exchanges_per_step"]
    assert exchanges > 0
    assert {row["halo_exchanges_per_step"] for row in ov["variants"].values()} == {exchanges}
    v = {k: row["median_s"] for k, row in ov["variants"].items()}
    assert ov["without_delay"]["saved_s"] == pytest.approx(v["no_overlap_delay0ms"]
                                                           - v["overlap_delay0ms"])
    assert [d["delay_s"] for d in ov["delays"]] == [0.03, 0.06]
    for d in ov["delays"]:
        ms = f"{d['delay_s'] * 1e3:g}"
        assert d["injected_s_per_step"] == pytest.approx(exchanges * d["delay_s"])
        assert d["added_s_overlap"] == pytest.approx(v[f"overlap_delay{ms}ms"] - v["overlap_delay0ms"])
        assert d["added_s_no_overlap"] == pytest.approx(v[f"no_overlap_delay{ms}ms"]
                                                        - v["no_overlap_delay0ms"])
        assert isinstance(d["hidden_fraction"], float) and math.isfinite(d["hidden_fraction"])
        assert d["hidden_fraction"] == pytest.approx(1 - d["added_s_overlap"] / d["added_s_no_overlap"])
        assert d["hidden_fraction_se"] == pytest.approx(2 * ov["median_step_se_s"]
                                                        / d["added_s_no_overlap"])
    rk = r["ranks"]
    assert rk["ranks"] == 2 and rk["one_rank"]["median_s"] > 0 and rk["n_ranks"]["median_s"] > 0
    assert rk["ratio_n_over_1"] == pytest.approx(rk["n_ranks"]["median_s"] / rk["one_rank"]["median_s"])
    assert isinstance(rk["shared_device"], bool) and CAVEAT in rk["note"]
    assert rk["launches"]["aten_ops"] > 100 and rk["launches"]["syncs"] == 0  # CPU: no CUDA calls
    # Rank 0 alone, for the kernels the split adds (none on a CPU: no kernels at all).
    assert rk["launches_one_rank"]["aten_ops"] > 100 and rk["kernel_gap"] == []
    assert "blocking calls" in proc.stdout
    for i, path in enumerate(r["trace"]):
        assert path.endswith(f"gpu_comm_rank{i}.json")
        events = json.loads(open(path).read())["traceEvents"]
        assert any(e.get("name") == "step 0" for e in events)
    assert len(r["trace"]) == 2
