"""GPU benchmark: the project's U-Net against the same U-Net in spconv's layers (issue 10).

    python -m sparsepipe_hpc.bench gpu --json gpu.json                  # the issue's scene, CUDA
    python -m sparsepipe_hpc.bench gpu --device cpu --rooms 1 --voxel-size 0.2 --width 4 \\
        --depth 2 --points 20000 --layer-channels 8 --repeats 1          # a smoke run on a CPU

Side by side in one run, on one device, every step a forward + backward from fresh coordinates
(kernel maps included, as in training), timed with CUDA events after a synchronize (wall clock
on a CPU), median of ``--repeats`` rounds after a warm-up, the variants of a table alternating
within each round; the JSON is rewritten after each precision (``complete`` once all ran):

  steps        per precision (fp32, and fp16/bf16 under torch.autocast): the plain spconv U-Net
               (:mod:`.spconv_unet`), ``SparseUNet`` on one rank (and ``sparseunet_<variant>``
               for each other way its layers can run, :func:`._gpu_tables.variants`: on CUDA
               ``explicit``, strided layers by gather-GEMM-scatter instead of spconv's implicit
               GEMM), and the distributed model on a 1x1x1 grid (every layer through the spatial
               path, empty exchanges); step time and peak device memory, and each one's ratio to
               plain spconv (the issue's target: <= 1.10 in time and memory). ``--triton`` adds
               the plain U-Net written with spconv-triton's layers (``spconv_triton_unet``: a
               pure-Triton drop-in for spconv, GPUs only; Triton tunes each new shape in the
               warm-up round).
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

from sparsepipe_hpc.bench.common import environment, time_alternating, write_json
from sparsepipe_hpc.bench._gpu_tables import (SKIP_CPU_AUTOCAST, autocast, batchnorm_table,
                                              kernel_maps_table, layer_table, spconv_runs,
                                              strided_table, switched, triton_skip, variants)
from sparsepipe_hpc.bench.launches import describe_gap, kernel_gap, step_launches
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "build_parser", "synthetic_rooms", "unet_steps", "PRECISIONS"]

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


def unet_steps(x: SparseTensor, width: int, depth: int, device: torch.device,
               dtype: Optional[torch.dtype], triton: bool = False
               ) -> dict[str, Callable[[], None]]:
    """One forward + backward each, from fresh coordinates (kernel maps included): the plain spconv
    U-Net (left out where spconv cannot run it: CPU autocast), ``SparseUNet`` on one rank (also
    each way of :func:`._gpu_tables.variants`: ``sparseunet_<variant>``), and the
    distributed model on a 1x1x1 grid; the same seed, so the U-Nets start alike. ``triton``: also
    the plain U-Net in spconv-triton's layers, where :func:`triton_skip` allows."""
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

    steps = {"spconv_unet": plain_step} if spconv_runs(device, dtype) else {}
    if triton and triton_skip(device) is None:
        torch.manual_seed(0)
        tri = SpconvUNet(x.num_channels, classes, width, depth, device,
                         package="spconv_triton").to(device)

        def triton_step() -> None:
            tri.zero_grad(set_to_none=True)
            with autocast(device, dtype):
                y = tri(tri.tensor(x)).features
            y.float().square().mean().backward()

        steps["spconv_triton_unet"] = triton_step

    steps["sparseunet"] = ours_step
    steps.update({f"sparseunet_{v}": switched(ours_step, on) for v, on in variants(device).items()})
    steps["distributed_1x1x1"] = dist_step
    return steps


def _steps(x: SparseTensor, args: Any, device: torch.device,
           dtype: Optional[torch.dtype]) -> dict[str, Any]:
    steps = unet_steps(x, args.width, args.depth, device, dtype, args.triton)
    out: dict[str, Any] = {}
    if "spconv_unet" not in steps:
        out["spconv_unet"] = {"skipped": SKIP_CPU_AUTOCAST}
    if args.triton and "spconv_triton_unet" not in steps:
        out["spconv_triton_unet"] = {"skipped": triton_skip(device)}
    out.update(time_alternating(steps, device, args.repeats))
    out["networks"] = list(steps)  # the ones timed, in order
    out["launches"] = {}
    for name, fn in steps.items() if args.launches else ():
        try:  # a diagnostic: a profiler that fails must not cost the timings above
            out["launches"][name] = step_launches(fn, device)
        except Exception as e:
            out["launches"][name] = {"error": f"{type(e).__name__}: {e}"}
    plain = out["launches"].get("spconv_unet", {})
    if "kernel_times" in plain:  # where each network's kernels take longer than the plain one's
        out["kernel_gap"] = {name: kernel_gap(n, plain) for name, n in out["launches"].items()
                             if name != "spconv_unet" and "kernel_times" in n}
    base = out["spconv_unet"]
    for name in steps:
        if name == "spconv_unet":
            continue
        if "median_s" in base:
            out[f"time_ratio_{name}_over_spconv"] = out[name]["median_s"] / base["median_s"]
        if base.get("peak_bytes"):
            out[f"memory_ratio_{name}_over_spconv"] = out[name]["peak_bytes"] / base["peak_bytes"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench gpu")
    p.add_argument("--json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rooms", type=positive_int, default=4)
    p.add_argument("--voxel-size", type=float, default=0.02)
    p.add_argument("--points", type=positive_int, default=2_000_000, help="points per room")
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--depth", type=positive_int, default=4)
    p.add_argument("--layer-channels", type=positive_int, default=64)
    p.add_argument("--precisions", default=None,
                   help="comma-separated (default fp32,fp16). spconv 2.3.8 has no bfloat16: under "
                   "bf16 autocast its own layers compute in fp16 (their custom_fwd casts to "
                   "float16 whatever the autocast dtype) and the project's in float32")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--launches", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one more step of each network (kernels, runtime calls, host "
                   "syncs; slow at the issue's scene): --no-launches leaves the timings only")
    p.add_argument("--triton", action="store_true", help="also time the plain U-Net and the layer "
                   "in spconv-triton's layers (pip install spconv-triton; GPUs only)")
    return p


def main(argv: list[str]) -> None:
    p = build_parser()
    args = p.parse_args(argv)

    from sparsepipe_hpc.train.device import resolve_device

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # spconv's CPU kernels race with more
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
        "targets": {"time_ratio_max": 1.10, "memory_ratio_max": 1.10},
        "steps": {}, "layer": {}, "strided": {}, "batchnorm": {},
        "complete": False}
    for name in names:
        steps = result["steps"][name] = _steps(x, args, device, PRECISIONS[name])
        timed = steps["networks"]
        for net in [n for n in ("spconv_unet", "spconv_triton_unet") if n not in timed] + timed:
            t = steps.get(net)
            if t is None:
                continue
            if "skipped" in t:
                print(f"{name} step {net:18s} skipped: {t['skipped']}")
                continue
            mem = f", peak {t['peak_bytes'] / 2**30:.2f} GiB" if t["peak_bytes"] else ""
            print(f"{name} step {net:18s} {t['median_s']:8.3f} s{mem}")
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
        if "time_ratio_distributed_1x1x1_over_spconv" in steps:
            print(f"{name} distributed / spconv: time "
                  f"{steps['time_ratio_distributed_1x1x1_over_spconv']:.2f}")
        layer = result["layer"][name] = layer_table(x, args.layer_channels, args, device,
                                               PRECISIONS[name])
        for net in ("project", "project_torch", "spconv", "spconv_triton", "torch_mm"):
            t = layer.get(net, {"skipped": "not asked for"})
            if "skipped" in t:
                continue
            print(f"{name} layer {args.layer_channels}->{args.layer_channels} {net:8s} "
                  f"{t['median_s'] * 1e3:8.2f} ms {t['tflops']:8.3f} TFLOP/s")
        st = result["strided"][name] = strided_table(x, args.width, args, device, PRECISIONS[name])
        print(f"{name} strided {args.width}->{2 * args.width}->{args.width} (map included): "
              + ", ".join(f"{run} {t['median_s'] * 1e3:.2f} ms" for run, t in st.items()
                          if isinstance(t, dict) and "median_s" in t))
        bn = result["batchnorm"][name] = batchnorm_table(x, args.width, args, device,
                                                    PRECISIONS[name])
        print(f"{name} batchnorm {args.width} ch: project {bn['project']['median_s'] * 1e3:.2f} ms"
              f", group form {bn['project_group']['median_s'] * 1e3:.2f} ms, torch "
              f"{bn['torch']['median_s'] * 1e3:.2f} ms")
        write_json(args.json, result)  # what is measured so far survives a later crash
    km = result["kernel_maps"] = kernel_maps_table(x, args.depth, device, args.repeats)
    print(f"kernel maps: project {km['project']['median_s'] * 1e3:.1f} ms, spconv "
          f"{km['spconv']['median_s'] * 1e3:.1f} ms, explicit subm maps "
          f"{km['explicit_subm_maps']['median_s'] * 1e3:.1f} ms; the strided layers' alone: "
          f"project {km['project_strided']['median_s'] * 1e3:.1f} ms, spconv "
          f"{km['spconv_strided']['median_s'] * 1e3:.1f} ms")
    result["complete"] = True
    write_json(args.json, result)
