"""``bench gpu`` runs end to end on a CPU at a tiny size and writes the JSON the issue's table
needs (structure only: the figures measure the machine, and a CPU says nothing about a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import repo_env
from sparsepipe_hpc.bench.gpu import synthetic_rooms
from sparsepipe_hpc.bench.spconv_unet import SpconvUNet
from sparsepipe_hpc.nn import SparseUNet

TINY = ["--rooms", "1", "--voxel-size", "0.2", "--width", "4", "--depth", "2", "--points",
        "20000", "--layer-channels", "8", "--repeats", "1"]


def test_reference_unet_is_sparseunets_architecture():
    """The plain spconv U-Net does the same arithmetic: same parameter count, same output rows."""
    x = synthetic_rooms(1, 0.2, 20000)
    ref = SpconvUNet(3, 8, width=4, depth=2)
    ours = SparseUNet(3, 8, width=4, depth=2)
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in ours.parameters())
    y = ref(x.to_spconv())
    assert y.features.shape == (x.num_voxels, 8) and torch.equal(y.indices, x.coords)


def run(args, tmp_path):
    env = repo_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "gpu", *args],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_gpu_benchmark_runs_on_cpu_and_writes_the_table(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run(["--device", "cpu", *TINY, "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["scene"]["voxels"] > 0
    assert r["targets"] == {"time_ratio_max": 1.10, "memory_ratio_max": 1.10,
                            "network": "distributed_1x1x1"}
    assert set(r["steps"]) == {"fp32", "fp16"} and set(r["layer"]) == {"fp32", "fp16"}
    fp32 = r["steps"]["fp32"]
    nets = ("spconv_unet", "sparseunet", "distributed_1x1x1")
    for net in nets:
        assert fp32[net]["median_s"] > 0 and fp32[net]["peak_bytes"] is None  # no device memory
    assert fp32["time_ratio_distributed_1x1x1_over_spconv"] > 0
    lo, hi = fp32["time_ratio_distributed_1x1x1_over_spconv_range"]  # round by round, paired
    assert lo <= fp32["time_ratio_distributed_1x1x1_over_spconv"] <= hi
    assert len(fp32["spconv_unet"]["all_s"]) == fp32["spconv_unet"]["repeats"] == 3  # 3 x 1
    assert "target_met" not in fp32  # no device memory on a CPU: no verdict
    assert "distributed_1x1x1 / spconv_unet: time" in proc.stdout
    assert fp32["networks"] == list(nets)  # no other way to run on a CPU
    for net in nets:  # a CPU has torch ops only
        n = fp32["launches"][net]
        assert n["aten_ops"] > 100 and n["kernels"] == n["syncs"] == 0, n
    assert "launches sparseunet" in proc.stdout
    assert "skipped" in r["steps"]["fp16"]["spconv_unet"]  # spconv has no CPU autocast path
    assert r["steps"]["fp16"]["sparseunet"]["median_s"] > 0
    layer = r["layer"]["fp32"]
    assert layer["pairs"] > layer["voxels"] > 0
    for net in ("project", "project_torch", "spconv", "torch_mm"):
        assert layer[net]["tflops"] > 0
    strided = r["strided"]["fp32"]
    assert strided["channels"] == [4, 8] and strided["voxels"] == r["scene"]["voxels"]
    for name in ("project", "spconv"):
        assert strided[name]["median_s"] > 0
    assert "project_explicit" not in strided and "sparseunet_explicit" not in fp32  # CUDA only
    assert strided["time_ratio_project_over_spconv"] > 0
    assert "skipped" in r["strided"]["fp16"]["spconv"]
    assert "fp32 strided 4->8->4 (map included): project" in proc.stdout
    for precision in ("fp32", "fp16"):
        bn = r["batchnorm"][precision]
        assert bn["voxels"] == r["scene"]["voxels"] and bn["channels"] == 4
        for name in ("project", "project_group", "torch"):
            assert bn[name]["median_s"] > 0
        assert bn["time_ratio_project_over_torch"] > 0
    km = r["kernel_maps"]
    assert km["project"]["median_s"] > 0 and km["spconv"]["median_s"] > 0
    assert km["project_strided"]["median_s"] > 0 and km["ratio_strided_project_over_spconv"] > 0


def test_triton_variants_are_skipped_with_the_reason_where_they_cannot_run(tmp_path):
    """``--triton`` on a CPU: spconv-triton's U-Net and layer are recorded as skipped, with why;
    the rest of the table is measured as without it."""
    out = tmp_path / "gpu.json"
    proc = run(["--device", "cpu", *TINY, "--precisions", "fp32", "--triton", "--no-launches",
                "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    steps, layer = r["steps"]["fp32"], r["layer"]["fp32"]
    assert steps["spconv_triton_unet"] == {"skipped": "spconv-triton runs on GPUs only"}
    assert layer["spconv_triton"] == {"skipped": "spconv-triton runs on GPUs only"}
    assert "time_ratio_spconv_triton_unet_over_spconv" not in steps
    assert steps["sparseunet"]["median_s"] > 0 and r["complete"]
    assert "launches" not in steps and "launches" not in proc.stdout  # --no-launches
    assert steps["networks"] == ["spconv_unet", "sparseunet", "distributed_1x1x1"]


def test_the_variants_switch_one_thing_each_on_cuda_only():
    """``sparseunet_explicit`` times the strided layers as they ran before implicit GEMM became
    CUDA's default, ``..._inline`` with their maps on the compute stream, as before the side
    stream became the default: each context turns its one switch, and puts it back after."""
    from sparsepipe_hpc.bench._gpu_tables import variants
    from sparsepipe_hpc.engine import spconv_igemm

    from sparsepipe_hpc import mapstream

    assert variants(torch.device("cpu")) == {}
    ways = variants(torch.device("cuda"))
    assert list(ways) == ["explicit", "inline"] and spconv_igemm.DEVICES == ("cuda",)
    assert mapstream.ASIDE
    with ways["explicit"]():
        assert spconv_igemm.DEVICES == () and mapstream.ASIDE
    assert spconv_igemm.DEVICES == ("cuda",)
    with ways["inline"]():
        assert not mapstream.ASIDE and spconv_igemm.DEVICES == ("cuda",)
    assert mapstream.ASIDE


def test_defaults_are_the_issues_scene(monkeypatch):
    """Four synthetic rooms at 2 cm (issue 10: 1.78 M voxels), width 32, depth 4."""
    from sparsepipe_hpc.bench import gpu

    seen = {}

    class Stop(Exception):
        pass

    def fake_rooms(rooms, voxel_size, points):
        seen.update(rooms=rooms, voxel_size=voxel_size)
        raise Stop

    monkeypatch.setattr(gpu, "synthetic_rooms", fake_rooms)
    with pytest.raises(Stop):
        gpu.main(["--device", "cpu"])
    assert seen == {"rooms": 4, "voxel_size": 0.02}
    defaults = {a.dest: a.default for a in gpu.build_parser()._actions}
    assert defaults["width"] == 32 and defaults["depth"] == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tmp_path):
    proc = run(["--device", "cuda", *TINY], tmp_path)
    assert proc.returncode != 0
    assert "--device cuda: torch sees no CUDA device" in proc.stderr


def test_launch_counts_tell_blocking_calls_and_torch_syncs_apart():
    """What ``bench gpu`` reports per step, from a GPU profile's events (made up here)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from sparsepipe_hpc.bench.launches import summarize

    def ev(name, device=DeviceType.CPU, us=0.0, parent=None):
        return SimpleNamespace(name=name, device_type=device, device_time_total=us,
                               cpu_parent=parent)

    empty, nonzero = ev("aten::empty"), ev("aten::nonzero")
    events = ([ev("aten::mm"), ev("aten::add_"), ev("cudaLaunchKernel")] * 3
              + [ev("gemm_kernel", DeviceType.CUDA, 30.0)] * 2
              + [ev("scatter_kernel", DeviceType.CUDA, 5.0),
                 ev("Memcpy DtoH", DeviceType.CUDA, 1.0)]
              + [ev(n) for n in ("cudaMalloc", "cudaMemcpyAsync", "cudaDeviceSynchronize",
                                 "cudaMemcpy", "cuLaunchKernel", "cudaEventSynchronize")]
              + [ev("cudaFree", parent=empty)] * 2
              # a runtime call inside another one is put down to the op around both
              + [ev("cudaStreamSynchronize", parent=ev("cudaMemcpyAsync", parent=nonzero))])
    n = summarize(events, [("called a synchronizing CUDA operation", "halo/kmap.py:217"),
                           ("another warning", "x.py:1"),
                           # torch 2.11, on setting the mode: not a wait
                           ("Synchronization debug mode is a prototype feature and does not yet "
                            "detect all synchronizing operations", "torch/cuda/__init__.py:1270"),
                           ("called a synchronizing CUDA operation", "halo/kmap.py:217")], top=3)
    assert (n["kernels"], n["aten_ops"], n["torch_host_syncs"]) == (4, 6, 2)
    assert n["sync_sites"] == {"torch sync at halo/kmap.py:217": 2, "cudaFree in aten::empty": 2,
                               "cudaStreamSynchronize in aten::nonzero": 1,
                               "cudaMalloc in ?": 1, "cudaDeviceSynchronize in ?": 1,
                               "cudaMemcpy in ?": 1, "cudaEventSynchronize in ?": 1}
    assert n["kernel_time_s"] == pytest.approx(66e-6)
    assert [k["name"] for k in n["top_kernels"]] == ["gemm_kernel", "scatter_kernel", "Memcpy DtoH"]
    assert n["runtime_calls"]["cudaLaunchKernel"] == 3 and n["runtime_calls"]["cudaFree"] == 2
    # blocking: the three Synchronize calls and the synchronous cudaMemcpy, not ...Async
    assert n["syncs"] == 4


def test_launch_counts_name_where_each_top_kernel_was_launched():
    """A profile with stacks puts Python frames (``path(line): function``) around the ops: a
    kernel is put down to its op and the innermost frame in the project, and a frame whose
    path starts with "cu" (cumm's) is no runtime call."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from sparsepipe_hpc.bench.launches import summarize

    def ev(name, parent=None, kernels=(), device=DeviceType.CPU, us=0.0):
        return SimpleNamespace(name=name, device_type=device, device_time_total=us,
                               cpu_parent=parent, kernels=list(kernels))

    def k(us):
        return SimpleNamespace(name="gather_kernel", duration=us)

    step = ev("/work/sparsepipe_hpc/bench/gpu.py(150): step")
    backward = ev("/x/site-packages/sparsepipe_hpc/engine/spconv_engine.py(231): split_backward",
                  parent=ev("torch/autograd/function.py(300): apply", parent=step))
    cumm = ev("/x/.site/cumm/tensorview/__init__.py(12): from_torch", parent=backward)
    events = [step, backward, cumm,
              ev("aten::index", parent=backward, kernels=[k(4.0), k(2.0)]),
              ev("aten::index", parent=ev("aten::gather", parent=step), kernels=[k(1.0)]),
              ev("cudaStreamSynchronize", parent=cumm),
              ev("gather_kernel", device=DeviceType.CUDA, us=7.0)]
    n = summarize(events, [], top=1)
    assert n["top_kernels"] == [{"name": "gather_kernel", "time_s": pytest.approx(7e-6), "from": {
        "aten::index at sparsepipe_hpc/engine/spconv_engine.py:231": pytest.approx(6e-6),
        "aten::index at sparsepipe_hpc/bench/gpu.py:150": pytest.approx(1e-6)}}]
    assert n["runtime_calls"] == {"cudaStreamSynchronize": 1}
    assert n["sync_sites"] == {
        "cudaStreamSynchronize in cumm/tensorview/__init__.py(12): from_torch "
        "at sparsepipe_hpc/engine/spconv_engine.py:231": 1}


def test_sync_sites_name_the_op_the_project_line_and_the_labelled_range():
    """A blocking call is put down to the innermost op, the project's line around it and the
    innermost range (a tracing span or profiled block), which is all a backward has: the
    profiler records no Python frames on autograd's thread. C functions lose their address."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from sparsepipe_hpc.bench.launches import summarize

    def ev(name, parent=None, annotation=False):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, device_time_total=0.0,
                               cpu_parent=parent, is_user_annotation=annotation)

    start = ev("dist_conv halo start", annotation=True,
               parent=ev("/w/sparsepipe_hpc/parallel/spatial.py(330): _start"))
    plan = ev("/w/halo/plan.py(145): _rows_inside", parent=start)
    nonzero = ev("aten::nonzero", parent=ev("<built-in method nonzero of Tensor object at "
                                            "0x7f00>", parent=plan))
    backward = ev("_DistConvBackward", parent=ev("autograd::engine::evaluate_function: "
                                                 "_DistConvBackward"))
    halo = ev("dist_conv halo part", parent=backward, annotation=True)
    spconv = ev("<built-in method implicit_gemm of pybind11_builtins.pybind11_detail_function_"
                "record object at 0x7f01>", parent=halo)
    events = [start, plan, nonzero, backward, halo, spconv,
              ev("cudaStreamSynchronize", parent=ev("cudaMemcpyAsync", parent=nonzero)),
              ev("cudaStreamSynchronize", parent=halo), ev("cudaStreamSynchronize", parent=halo),
              ev("cudaEventSynchronize", parent=spconv)]
    assert summarize(events, [])["sync_sites"] == {
        "cudaStreamSynchronize in dist_conv halo part": 2,
        "cudaStreamSynchronize in aten::nonzero at halo/plan.py:145 within dist_conv halo start": 1,
        "cudaEventSynchronize in built-in method implicit_gemm within dist_conv halo part": 1}


def test_step_launches_profiles_again_when_torch_cannot_read_its_events(monkeypatch):
    """torch's profiler may fail to read a freed Python frame's name (pytorch#130622): the step
    is profiled again, the last time without stacks; ranks profiling a collective step retry
    together (one rank's failure is every rank's)."""
    from sparsepipe_hpc.bench import launches

    # A real profile of a CPU step first: the labelled ranges are in it.
    from sparsepipe_hpc.tracing import profiled

    def step():
        with profiled("part"):
            torch.ones(3).sum()

    real = launches._profile(step, torch.device("cpu"), False)[0]  # stacks: torch's bug may hit
    assert real is not None and "part" in {e.name for e in real}
    tries: list[bool] = []

    def flaky(fails):
        def profile(fn, device, stacks):
            tries.append(stacks)
            return (None if len(tries) <= fails else real), []
        return profile

    class Comm:  # another rank (1) could not read its first profile
        def __init__(self):
            self.calls = 0

        def allgather(self, state):
            self.calls += 1
            return [state, (False, self.calls == 1)]

    for fails, comm, expect in ((0, None, [True]), (1, None, [True, True]),
                                (2, None, [True, True, False]), (0, Comm(), [True, True])):
        tries.clear()
        monkeypatch.setattr(launches, "_profile", flaky(fails))
        out = launches.step_launches(step, torch.device("cpu"), comm=comm)
        assert tries == expect and out["stacks"] == expect[-1]
        assert out["aten_ops"] >= 1
    tries.clear()
    monkeypatch.setattr(launches, "_profile", flaky(3))
    with pytest.raises(RuntimeError, match="could not read its events, even without"):
        launches.step_launches(step, torch.device("cpu"))

    class Failed(Comm):  # the step raised on rank 1: this rank raises too, at once
        def allgather(self, state):
            return [state, (True, True)]

    monkeypatch.setattr(launches, "_profile", flaky(0))
    with pytest.raises(RuntimeError, match=r"the profiled step failed on rank\(s\) \[1\]"):
        launches.step_launches(step, torch.device("cpu"), comm=Failed())

    def broken(fn, device, stacks):
        raise KeyError("mine")

    monkeypatch.setattr(launches, "_profile", broken)
    with pytest.raises(KeyError, match="mine"):  # its own error, after telling the others
        launches.step_launches(step, torch.device("cpu"), comm=Comm())


def test_kernel_gap_lists_the_kernels_that_make_a_step_slower_than_the_plain_one():
    """From two profiles' per-kernel times: the kernels by which ours takes longer, the largest
    first, with where ours launched them; a kernel of one step only counts in full."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from sparsepipe_hpc.bench.launches import kernel_gap, summarize

    def run(kernels):
        step = SimpleNamespace(name="/w/halo/kmap.py(212): kernel_map", device_type=DeviceType.CPU,
                               device_time_total=0.0, cpu_parent=None, kernels=[])
        op = SimpleNamespace(name="aten::sort", device_type=DeviceType.CPU, device_time_total=0.0,
                             cpu_parent=step, kernels=[SimpleNamespace(name=n, duration=us)
                                                       for n, us in kernels])
        return summarize([step, op] + [SimpleNamespace(name=n, device_type=DeviceType.CUDA,
                                                       device_time_total=us, cpu_parent=None)
                                       for n, us in kernels], [])

    ours = run([("gemm", 50.0), ("radix_sort", 4.0), ("radix_sort", 3.0), ("gather", 2.0),
                ("relu", 1.0)])
    plain = run([("gemm", 49.0), ("radix_sort", 2.0), ("relu", 1.5), ("hash", 1.0)])
    gap = kernel_gap(ours, plain)
    assert [(g["name"], round(g["extra_s"] * 1e6, 3), g["launches"], g["base_launches"])
            for g in gap] == [("radix_sort", 5.0, 2, 1), ("gather", 2.0, 1, 0), ("gemm", 1.0, 1, 1)]
    assert gap[0]["from"] == {"aten::sort at halo/kmap.py:212": pytest.approx(7e-6)}
    assert ours["kernel_times"]["radix_sort"]["launches"] == 2
    assert kernel_gap(ours, plain, top=1) == gap[:1] and kernel_gap(plain, plain) == []


def test_gpu_idle_time_is_the_span_of_the_kernels_less_their_union():
    """Kernels overlapping on two streams count once; the gaps between them are idle time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from sparsepipe_hpc.bench.launches import summarize

    def k(a, b):
        return SimpleNamespace(name="k", device_type=DeviceType.CUDA, device_time_total=b - a,
                               cpu_parent=None, time_range=SimpleNamespace(start=a, end=b))

    n = summarize([k(100, 110), k(105, 112), k(120, 125), k(121, 122)], [])
    assert n["gpu_busy_s"] == pytest.approx(17e-6) and n["gpu_idle_s"] == pytest.approx(8e-6)
    assert summarize([], [])["gpu_busy_s"] == summarize([], [])["gpu_idle_s"] == 0


def test_rounds_are_kept_and_ratios_paired_round_by_round():
    """A slow round slows both sides: the ratio is taken within each round, and every round's
    time is kept, so that a ratio near the target can be judged by its spread."""
    from sparsepipe_hpc.bench.common import paired_ratios, time_alternating

    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    t = time_alternating(fns, torch.device("cpu"), repeats=2, warmup=1,
                         before=lambda: calls.append("free"))
    # One warm-up round, two timed, each round starting one function later than the last.
    assert calls == ["free", "a", "free", "b"] * 2 + ["free", "b", "free", "a"]
    assert len(t["a"]["all_s"]) == 2 and t["a"]["peak_over_start_bytes"] is None
    times = {"ours": {"all_s": [2.0, 4.0, 3.0]}, "base": {"all_s": [1.0, 2.0, 3.0]}}
    assert paired_ratios(times, "ours", "base") == {"median": 2.0, "min": 1.0, "max": 2.0}


def test_the_plain_spconv_unet_computes_what_sparseunet_computes():
    """The benchmark's reference is issue 10's 'equivalent U-Net': with SparseUNet's weights
    copied in, module by module, both give the same outputs and gradients (train and eval), so
    the two steps do the same work at every level and a time ratio compares implementations."""
    from sparsepipe_hpc.bench.gpu import synthetic_rooms
    from sparsepipe_hpc.nn import SparseUNet

    width, depth = 4, 3
    x = synthetic_rooms(1, 0.1, 20000)
    torch.manual_seed(0)
    plain, ours = SpconvUNet(3, 8, width, depth), SparseUNet(3, 8, width=width, depth=depth)

    def residual(r, unit):
        pairs = [(r.c1, unit.body[0]), (r.b1, unit.body[1]), (r.c2, unit.body[3]),
                 (r.b2, unit.body[4])]
        return pairs + ([(r.skip[0], unit.skip[0]), (r.skip[1], unit.skip[1])]
                        if r.skip is not None else [])

    blocks = ours.blocks
    pairs = [(plain.stem, blocks[0].net[0]), (plain.stem_bn, blocks[0].net[1])]
    pairs += residual(plain.stem_res, blocks[0].net[3])
    for i in range(depth):
        pairs += [(plain.down[i], blocks[1 + i].net[0]), (plain.down_bn[i], blocks[1 + i].net[1])]
        pairs += residual(plain.down_res[i], blocks[1 + i].net[3])
    for j in range(depth):
        i, up = depth - 1 - j, blocks[1 + depth + j]
        pairs += [(plain.up[i], up.up[0]), (plain.up_bn[i], up.up[1])]
        pairs += residual(plain.up_res[i], up.net[0])
    pairs.append((plain.head, blocks[-1].linear))
    with torch.no_grad():
        for a, b in pairs:
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                pb.copy_(pa)
    assert sum(p.numel() for a, _ in pairs for p in a.parameters()) == \
        sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in plain.parameters())
    for train in (True, False):
        plain.train(train), ours.train(train)
        ya, yb = plain(x.to_spconv()).features, ours(x.replace(kmaps={})).feats
        assert ya.shape == yb.shape
        assert (ya - yb).abs().max() <= 1e-4 * ya.abs().max()
        ya.square().mean().backward()
        yb.square().mean().backward()
    for a, b in pairs:
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-3, atol=1e-5 * pa.grad.abs().max())


def test_host_benchmark_runs_on_cpu_and_names_where_the_host_time_goes(tmp_path):
    """``bench host``: per network the step, the host's time to issue it and the functions
    that took it, the project's among them (structure only, on a CPU)."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "host", "--device",
                           "cpu", *TINY[:-4], "--precision", "fp32", "--repeats", "1", "--top",
                           "5", "--networks", "sparseunet,distributed_1x1x1", "--json", str(out)],
                          env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    nets = json.loads(out.read_text())["networks"]
    assert sorted(nets) == ["distributed_1x1x1", "sparseunet"]
    for r in nets.values():
        assert 0 < r["issue_s"] and 0 < r["step_s"]
        assert len(r["functions"]["by_own"]) == 5
        assert any("sparsepipe_hpc/nn/" in row[0] for row in r["functions"]["ours_by_total"])
        nodes = {row[0] for row in r["backward"]["nodes"]}
        assert "_SparseConvBackward" in nodes or "_DistConvBackward" in nodes, nodes
        assert r["backward"]["total_s"] >= sum(row[2] for row in r["backward"]["nodes"]) > 0
    bad = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "host", "--device", "cpu",
                          *TINY[:-4], "--networks", "sparseunet,nope"],
                         env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert bad.returncode == 2 and "--networks: ['nope']" in bad.stderr
    none = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.bench", "host", "--device",
                           "cpu", *TINY[:-4], "--networks", " , "],
                          env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert none.returncode == 2 and "--networks: none" in none.stderr
