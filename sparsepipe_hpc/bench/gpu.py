"""GPU benchmark: the project's U-Net against the same U-Net in spconv's layers (issue 10).

    python -m sparsepipe_hpc.bench gpu --json gpu.json                  # the issue's scene, CUDA
    python -m sparsepipe_hpc.bench gpu --device cpu --rooms 1 --voxel-size 0.2 --width 4 \\
        --depth 2 --points 20000 --layer-channels 8 --repeats 1          # a smoke run on a CPU

Side by side in one run, on one device, every step a forward + backward from fresh coordinates
(kernel maps included, as in training), timed with CUDA events after a synchronize (wall clock
on a CPU), median of ``--repeats`` rounds after a warm-up, the variants of a table alternating
within each round; the JSON is rewritten after each precision (``complete`` once all ran):

  steps        per precision (fp32, and fp16/bf16 under torch.autocast): the plain spconv U-Net
               (:mod:`.spconv_unet`), ``SparseUNet`` on one rank (and ``sparseunet_<variant>`` for
               each other way its layers can run, :func:`._gpu_tables.variants`: on CUDA
               ``explicit``, strided layers by gather-GEMM-scatter instead of spconv's implicit
               GEMM; ``inline``, their maps on the compute stream instead of a side stream), and the
               distributed model on a 1x1x1 grid (every layer through the spatial path, empty
               exchanges; also ``distributed_1x1x1_inline``); step time (``--step-repeats`` rounds,
               every round's kept) and memory, and each one's ratio to plain spconv: time as the
               median of the rounds' paired ratios, with their range; memory as what a step adds to
               what was allocated when it started, every model's gradients freed before it, plus its
               own weights (``step_memory_bytes``; ``peak_bytes`` is the absolute peak). The issue's
               target, <= 1.10 in time and memory for the distributed model (``TARGET``), is
               ``target_met`` where every round's ratio and the memory ratio keep to it. The step
               figures are printed and written before anything else of their precision, and a table
               that fails records its error. ``--triton`` adds the plain U-Net written with
               spconv-triton's layers (``spconv_triton_unet``: a pure-Triton drop-in for spconv,
               GPUs only; Triton tunes each new shape in the warm-up round).
               ``launches`` (unless ``--no-launches``): per network, the kernels, CUDA runtime
               calls, host synchronizations and torch ops of one more step (:mod:`.launches`),
               what made the project's step slow before (issue 10's profile); ``kernel_gap``:
               per network, the kernels by which its step's GPU time exceeds the plain U-Net's,
               with the source lines that launched them (:func:`.launches.kernel_gap`).
  layer        one submanifold 3x3x3 layer, C -> C channels, forward + backward on the scene's
               voxels: project layer (``project``: the default engine; ``project_torch``: the
               own torch engine), spconv's ``SubMConv3d``, and ``torch.mm`` of the same GEMM
               shapes ([N, 27 C] x [27 C, C] and its two gradients); TFLOP/s of useful work
               (2 * pairs * C * C per GEMM pass, three passes); with ``--triton`` also
               spconv-triton's ``SubMConv3d``.
  strided      a U-Net level's strided pair on the scene's voxels, forward + backward, its map
               built each time: ``SparseConv3d`` k2s2 W -> 2W and ``SparseInverseConv3d`` back
               (W = ``--width``), the project's (``project``, and ``project_<variant>`` for each
               of ``sparseunet_<variant>``) against spconv's own (implicit GEMM on CUDA).
  batchnorm    one BatchNorm over the scene's voxels at ``--width`` channels, forward + backward:
               the project's on one rank (as the trainer runs it), the project's group form
               (what each rank of a spatial group runs, all-reduce aside: deferred statistics on
               one rank take the same passes), and ``torch.nn.BatchNorm1d``.
  kernel_maps  index building for the whole U-Net: the project's (spconv's submanifold indices
               plus own strided maps and their implicit-GEMM tables) versus spconv's own, the
               strided layers' part of each alone (where the two differ), and the explicit-pair
               submanifold maps the local path no longer needs.

Defaults are the issue's scene: four synthetic rooms at 2 cm (issue 10 measured 1.78 M voxels),
width 32, depth 4. On a CPU everything runs (``--device cpu``) at whatever size is asked, so a test
checks the JSON's structure; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

import numpy as np
import torch

from sparsepipe_hpc.bench.common import (environment, paired_ratios, time_alternating,
                                         write_json)
from sparsepipe_hpc.bench._gpu_tables import (SKIP_CPU_AUTOCAST, autocast, batchnorm_table,
                                              kernel_maps_table, layer_table, spconv_runs,
                                              strided_table, switched, triton_skip, variants)
from sparsepipe_hpc.bench.launches import describe_gap, kernel_gap, step_launches
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "build_parser", "add_scene_arguments", "bench_device", "synthetic_rooms",
           "unet_steps", "PRECISIONS"]

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def synthetic_rooms(rooms: int, voxel_size: float, points: int, seed: int = 0,
                    size: tuple[float, float, float] = (6.0, 6.0, 3.0)) -> SparseTensor:
    """``rooms`` furnished synthetic rooms voxelized into one batch (3 colour channels)."""
    from sparsepipe_hpc.data.synth import make_room
    from sparsepipe_hpc.voxelize import voxelize

    rng = np.random.default_rng(seed)
    clouds = [make_room(rng, size=size, points=(points, points))[:2] for _ in range(rooms)]
    lo = np.min([xyz.min(0) for xyz, _ in clouds], 0) - voxel_size
    hi = np.max([xyz.max(0) for xyz, _ in clouds], 0)
    shape = np.ceil((hi - lo) / voxel_size).astype(int) + 1
    shape = (np.ceil(shape / 16) * 16).astype(int)
    vox = [voxelize(xyz, rgb.astype(np.float32) / 255.0, voxel_size, lo, shape)
           for xyz, rgb in clouds]
    return SparseTensor.from_voxels(vox, shape)


class UNetStep:
    """One forward + backward of ``model`` (call it); the model rides along so that a benchmark
    can free every model's gradients between steps and count a network's own weights."""

    def __init__(self, fn: Callable[[], None], model: torch.nn.Module) -> None:
        self.fn, self.model = fn, model

    def __call__(self) -> None:
        self.fn()


def unet_steps(x: SparseTensor, width: int, depth: int, device: torch.device,
               dtype: Optional[torch.dtype], triton: bool = False) -> dict[str, UNetStep]:
    """One forward + backward each, from fresh coordinates (kernel maps included): the plain spconv
    U-Net (left out where spconv cannot run it: CPU autocast), ``SparseUNet`` on one rank (also
    each way of :func:`._gpu_tables.variants`: ``sparseunet_<variant>``), and the
    distributed model on a 1x1x1 grid (the same weights as ``sparseunet``; the plain U-Net's
    differ, which its time does not depend on). ``triton``: also the plain U-Net in
    spconv-triton's layers, where :func:`triton_skip` allows."""
    from mpi4py import MPI

    from sparsepipe_hpc.bench.spconv_unet import SpconvUNet
    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    classes = 8
    torch.manual_seed(0)
    plain = SpconvUNet(x.num_channels, classes, width, depth, device).to(device)
    ours = SparseUNet(x.num_channels, classes, width=width, depth=depth).to(device)
    ctx = ParallelContext(MPI.COMM_SELF, RankLayout(1, 1, (1, 1, 1)), force_spatial=True)

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            y = plain(x.to_spconv()).features
        y.float().square().mean().backward()

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            y = ours(x.replace(kmaps={})).feats
        y.float().square().mean().backward()

    def dist_step() -> None:
        ours.zero_grad(set_to_none=True)
        xl, = ctx.distribute(x.replace(kmaps={}), align=ours.total_stride)
        with autocast(device, dtype):
            y = ours(xl).feats
        y.float().square().mean().backward()

    steps = {"spconv_unet": UNetStep(plain_step, plain)} if spconv_runs(device, dtype) else {}
    if triton and triton_skip(device) is None:
        torch.manual_seed(0)
        tri = SpconvUNet(x.num_channels, classes, width, depth, device,
                         package="spconv_triton").to(device)

        def triton_step() -> None:
            tri.zero_grad(set_to_none=True)
            with autocast(device, dtype):
                y = tri(tri.tensor(x)).features
            y.float().square().mean().backward()

        steps["spconv_triton_unet"] = UNetStep(triton_step, tri)

    steps["sparseunet"] = UNetStep(ours_step, ours)
    ways = variants(device)
    steps.update({f"sparseunet_{v}": UNetStep(switched(ours_step, on), ours)
                  for v, on in ways.items()})
    steps["distributed_1x1x1"] = UNetStep(dist_step, ours)
    if "inline" in ways:  # the target network with its maps on the compute stream
        steps["distributed_1x1x1_inline"] = UNetStep(switched(dist_step, ways["inline"]), ours)
    return steps


#: The network issue 10's targets are about, and what "met" takes: every round's paired time
#: ratio and the step memory ratio at most 1.10.
TARGET = {"network": "distributed_1x1x1", "time_ratio_max": 1.10, "memory_ratio_max": 1.10}


def _time_steps(steps: dict[str, UNetStep], args: Any, device: torch.device,
                precision: str) -> dict[str, Any]:
    """Every network's step time and memory, and its ratios to the plain spconv U-Net: time
    round by round (:func:`.common.paired_ratios`; ``..._range``: the rounds' least and most),
    memory as ``step_memory_bytes`` (what a step adds to what was allocated when it started,
    every model's gradients freed before it, plus its own weights: another network's weights
    and gradients held meanwhile would pull every ratio towards 1)."""
    models = list({id(step.model): step.model for step in steps.values()}.values())

    def free_gradients() -> None:
        for model in models:
            model.zero_grad(set_to_none=True)

    out: dict[str, Any] = {}
    if "spconv_unet" not in steps:
        out["spconv_unet"] = {"skipped": SKIP_CPU_AUTOCAST}
    if args.triton and "spconv_triton_unet" not in steps:
        out["spconv_triton_unet"] = {"skipped": triton_skip(device)}
    repeats = args.step_repeats or 3 * args.repeats
    out.update(time_alternating(steps, device, repeats, before=free_gradients))
    out["networks"] = list(steps)  # the ones timed, in order
    if precision == "bf16":
        out["note"] = ("spconv has no bfloat16: under bf16 autocast its layers compute in fp16 "
                       "and the project's in float32, so the ratios compare other arithmetic")
    for name, step in steps.items():
        added = out[name]["peak_over_start_bytes"]
        if added is not None:
            weights = sum(p.numel() * p.element_size() for p in step.model.parameters())
            out[name]["step_memory_bytes"] = added + weights
    base = out["spconv_unet"]
    for name in steps:
        if name == "spconv_unet" or "median_s" not in base:
            continue
        r = paired_ratios(out, name, "spconv_unet")
        out[f"time_ratio_{name}_over_spconv"] = r["median"]
        out[f"time_ratio_{name}_over_spconv_range"] = [r["min"], r["max"]]
        if base.get("step_memory_bytes"):
            out[f"memory_ratio_{name}_over_spconv"] = (out[name]["step_memory_bytes"]
                                                      / base["step_memory_bytes"])
    net = TARGET["network"]
    if f"memory_ratio_{net}_over_spconv" in out:
        out["target_met"] = (
            out[f"time_ratio_{net}_over_spconv_range"][1] <= TARGET["time_ratio_max"]
            and out[f"memory_ratio_{net}_over_spconv"] <= TARGET["memory_ratio_max"])
    return out


def _profile_steps(steps: dict[str, UNetStep], out: dict[str, Any],
                   device: torch.device) -> None:
    """``out["launches"]`` and ``out["kernel_gap"]``: one more step of each network, profiled."""
    out["launches"] = {}
    for name, fn in steps.items():
        try:  # a diagnostic: a profiler that fails must not cost the timings
            out["launches"][name] = step_launches(fn, device)
        except Exception as e:
            out["launches"][name] = {"error": f"{type(e).__name__}: {e}"}
    plain = out["launches"].get("spconv_unet", {})
    if "kernel_times" in plain:  # where each network's kernels take longer than the plain one's
        out["kernel_gap"] = {name: kernel_gap(n, plain) for name, n in out["launches"].items()
                             if name != "spconv_unet" and "kernel_times" in n}


def _print_steps(name: str, steps: dict[str, Any]) -> None:
    timed = steps["networks"]
    for net in [n for n in ("spconv_unet", "spconv_triton_unet") if n not in timed] + timed:
        t = steps.get(net)
        if t is None:
            continue
        if "skipped" in t:
            print(f"{name} step {net:18s} skipped: {t['skipped']}")
            continue
        mem = (f", step memory {t['step_memory_bytes'] / 2**30:.2f} GiB (peak "
               f"{t['peak_bytes'] / 2**30:.2f})" if t.get("step_memory_bytes") else "")
        print(f"{name} step {net:18s} {t['median_s']:8.3f} s (min {t['min_s']:.3f}, "
              f"{t['repeats']} rounds){mem}")
    for net in timed:
        key = f"time_ratio_{net}_over_spconv"
        if key not in steps:
            continue
        lo, hi = steps[key + "_range"]
        memory = steps.get(f"memory_ratio_{net}_over_spconv")
        print(f"{name} {net} / spconv_unet: time {steps[key]:.3f}x (rounds {lo:.3f}-{hi:.3f})"
              + ("" if memory is None else f", memory {memory:.3f}x")
              + (" <- issue 10's target network" if net == TARGET["network"] else ""))
    if "target_met" in steps:
        print(f"{name} target (every round and memory <= {TARGET['time_ratio_max']:.2f}x): "
              f"{'met' if steps['target_met'] else 'NOT met'}")
    if "note" in steps:
        print(f"{name} note: {steps['note']}")


def _print_launches(name: str, steps: dict[str, Any]) -> None:
    for net, n in steps["launches"].items():
        print(f"{name} launches {net:18s} " + (n["error"] if "error" in n else
              f"{n['kernels']} kernels (GPU busy {n['gpu_busy_s'] * 1e3:.1f} ms, idle "
              f"{n['gpu_idle_s'] * 1e3:.1f} ms between them), {n['syncs']} host syncs "
              f"({n['torch_host_syncs']} in "
              f"torch ops), {n['runtime_calls'].get('cudaFree', 0)} cudaFree, "
              f"{n['runtime_calls'].get('cudaMalloc', 0)} cudaMalloc, {n['aten_ops']} torch "
              "ops"))
        if n.get("sync_sites"):
            print("    from: " + ", ".join(f"{k} x{v}" for k, v in
                                           list(n["sync_sites"].items())[:6]))
    base = steps["launches"].get("spconv_unet", {})
    for net, gap in steps.get("kernel_gap", {}).items() if base.get("kernels") else ():
        extra = steps["launches"][net]["kernel_time_s"] - base["kernel_time_s"]
        print(f"{name} kernel time {net} over spconv_unet: {extra * 1e3:+.2f} ms; most: "
              + describe_gap(gap, "plain"))


def _print_table(table: str, name: str, t: dict[str, Any], args: Any) -> None:
    if table == "layer":
        for net in ("project", "project_torch", "spconv", "spconv_triton", "torch_mm"):
            row = t.get(net, {"skipped": "not asked for"})
            if "skipped" not in row:
                print(f"{name} layer {args.layer_channels}->{args.layer_channels} {net:8s} "
                      f"{row['median_s'] * 1e3:8.2f} ms {row['tflops']:8.3f} TFLOP/s")
    elif table == "strided":
        print(f"{name} strided {args.width}->{2 * args.width}->{args.width} (map included): "
              + ", ".join(f"{run} {row['median_s'] * 1e3:.2f} ms" for run, row in t.items()
                          if isinstance(row, dict) and "median_s" in row))
    else:
        print(f"{name} batchnorm {args.width} ch: project {t['project']['median_s'] * 1e3:.2f} "
              f"ms, group form {t['project_group']['median_s'] * 1e3:.2f} ms, torch "
              f"{t['torch']['median_s'] * 1e3:.2f} ms")


def add_scene_arguments(p: argparse.ArgumentParser) -> None:
    """``--json``, ``--device`` and the scene and U-Net options (issue 10's by default), which
    ``bench host`` shares."""
    p.add_argument("--json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rooms", type=positive_int, default=4)
    p.add_argument("--voxel-size", type=float, default=0.02)
    p.add_argument("--points", type=positive_int, default=2_000_000, help="points per room")
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--depth", type=positive_int, default=4)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench gpu")
    add_scene_arguments(p)
    p.add_argument("--layer-channels", type=positive_int, default=64)
    p.add_argument("--precisions", default=None,
                   help="comma-separated (default fp32,fp16). spconv 2.3.8 has no bfloat16: under "
                   "bf16 autocast its own layers compute in fp16 (their custom_fwd casts to "
                   "float16 whatever the autocast dtype) and the project's in float32")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="rounds of each table (default 5)")
    p.add_argument("--step-repeats", type=positive_int, default=None,
                   help="rounds of the U-Net steps, whose ratios decide the target (default 3 x "
                   "--repeats: a median of 5 rounds moved the fp16 ratio across 1.10)")
    p.add_argument("--launches", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one more step of each network (kernels, runtime calls, host "
                   "syncs; slow at the issue's scene): --no-launches leaves the timings only")
    p.add_argument("--triton", action="store_true", help="also time the plain U-Net and the layer "
                   "in spconv-triton's layers (pip install spconv-triton; GPUs only)")
    return p


def bench_device(name: str) -> torch.device:
    """``--device`` resolved; on a CPU with one torch thread (spconv's CPU kernels race with
    more)."""
    from sparsepipe_hpc.train.device import resolve_device

    device = resolve_device(name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    return device


def main(argv: list[str]) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    device = bench_device(args.device)
    precisions = args.precisions or "fp32,fp16"
    names = [s.strip() for s in precisions.split(",") if s.strip()]
    bad = [s for s in names if s not in PRECISIONS]
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {sorted(PRECISIONS)}")

    x = synthetic_rooms(args.rooms, args.voxel_size, args.points)
    x = x.to(device)
    print(f"{args.rooms} room(s) at {args.voxel_size} m: {x.num_voxels} voxels, grid "
          f"{x.spatial_shape}; U-Net width {args.width} depth {args.depth}; device {device}")
    result: dict[str, Any] = {
        "env": environment(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "scene": {"rooms": args.rooms, "voxel_size": args.voxel_size, "points": args.points,
                  "voxels": x.num_voxels, "spatial_shape": list(x.spatial_shape),
                  "width": args.width, "depth": args.depth},
        "targets": TARGET, "steps": {}, "layer": {}, "strided": {}, "batchnorm": {},
        "complete": False}
    for name in names:
        dtype = PRECISIONS[name]
        nets = unet_steps(x, args.width, args.depth, device, dtype, args.triton)
        steps = result["steps"][name] = _time_steps(nets, args, device, name)
        _print_steps(name, steps)
        write_json(args.json, result)  # the step times first: they survive what comes after
        if args.launches:
            _profile_steps(nets, steps, device)
            _print_launches(name, steps)
        del nets
        for table, run in (("layer", lambda: layer_table(x, args.layer_channels, args, device,
                                                          dtype)),
                           ("strided", lambda: strided_table(x, args.width, args, device, dtype)),
                           ("batchnorm", lambda: batchnorm_table(x, args.width, args, device,
                                                                 dtype))):
            try:  # one table that fails (or runs out of memory) keeps the others and the steps
                result[table][name] = run()
            except Exception as e:
                result[table][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} {table}: {result[table][name]['error']}")
                continue
            _print_table(table, name, result[table][name], args)
            write_json(args.json, result)
    km = result["kernel_maps"] = kernel_maps_table(x, args.depth, device, args.repeats)
    print(f"kernel maps: project {km['project']['median_s'] * 1e3:.1f} ms, spconv "
          f"{km['spconv']['median_s'] * 1e3:.1f} ms, explicit subm maps "
          f"{km['explicit_subm_maps']['median_s'] * 1e3:.1f} ms; the strided layers' alone: "
          f"project {km['project_strided']['median_s'] * 1e3:.1f} ms, spconv "
          f"{km['spconv_strided']['median_s'] * 1e3:.1f} ms")
    result["complete"] = True
    write_json(args.json, result)
