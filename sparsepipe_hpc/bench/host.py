"""Host time of a U-Net step: where the host spends it, per network of ``bench gpu``.

    python -m sparsepipe_hpc.bench host --json host.json          # the issue's scene, fp16, CUDA
    python -m sparsepipe_hpc.bench host --device cpu --rooms 1 --voxel-size 0.2 --width 4 \\
        --depth 2 --points 20000 --precision fp32 --repeats 1      # a smoke run on a CPU

On an H100 the project's fp16 step ran the same GPU time of kernels as the plain spconv U-Net
(57-58 ms) and still took 1.14x as long: the device waited on the host (``bench gpu``'s
``gpu_idle_s``). This benchmark says where that host time goes, per network:

  step_s      the step (forward + backward from fresh coordinates), CUDA-event timed, median
  issue_s     host seconds until the step returned (its kernels launched, not finished; the
              host syncs inside count), median: near ``step_s``, the device waits on the host
  functions   one more step under :mod:`cProfile`: the ``--top`` functions by own time and
              the project's by total time, seconds per step (the profiler slows the host:
              compare rows, not totals). It sees the calling thread only; on CUDA autograd
              runs the backward on a thread of its own, so:
  backward    one more step under torch's profiler (host side only): the host time of each
              kind of autograd node's backward (``evaluate_function``: its ops and launches),
              the ``--top`` by total, and their sum (``total_s``)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sparsepipe_hpc.bench._args import positive_int
from sparsepipe_hpc.bench.common import environment, time_once, write_json

__all__ = ["main", "build_parser"]

_ROOT = Path(__file__).parents[2]  # the checkout: its sparsepipe_hpc/ and halo/
_OURS = tuple(str(_ROOT / name) + os.sep for name in ("sparsepipe_hpc", "halo"))
_BENCH = str(_ROOT / "sparsepipe_hpc" / "bench") + os.sep


def _issue_times(step: Any, device: torch.device, repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` steps: device step time, and host time to issue the step."""
    steps, issued = [], []
    for _ in range(repeats):
        steps.append(time_once(step, device)[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step()
        issued.append(time.perf_counter() - t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {"step_s": statistics.median(steps), "issue_s": statistics.median(issued)}


def _functions(step: Any, device: torch.device, top: int) -> dict[str, list]:
    """One profiled step: the ``top`` functions by own time, and the project's by total time."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows, ours = [], []
    for (file, line, name), (_, calls, own, total, _) in stats.items():
        row = (f"{file.split('site-packages/')[-1]}:{line} {name}", calls, own, total)
        rows.append(row)
        if file.startswith(_OURS) and not file.startswith(_BENCH):
            ours.append(row)
    return {"by_own": sorted(rows, key=lambda r: -r[2])[:top],
            "ours_by_total": sorted(ours, key=lambda r: -r[3])[:top]}


def _backward(step: Any, device: torch.device, top: int) -> dict[str, Any]:
    """One profiled step: host seconds per kind of autograd node in its backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    node = "autograd::engine::evaluate_function: "
    rows = [(e.key[len(node):], e.count, e.cpu_time_total / 1e6) for e in prof.key_averages()
            if e.key.startswith(node)]
    return {"total_s": sum(r[2] for r in rows), "nodes": sorted(rows, key=lambda r: -r[2])[:top]}


def build_parser() -> argparse.ArgumentParser:
    from sparsepipe_hpc.bench.gpu import add_scene_arguments

    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench host")
    add_scene_arguments(p)
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp16")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--top", type=positive_int, default=30)
    p.add_argument("--networks", default="spconv_unet,sparseunet,distributed_1x1x1",
                   help="comma-separated names of bench gpu's networks")
    return p


def main(argv: list[str]) -> None:
    from sparsepipe_hpc.bench.gpu import PRECISIONS, bench_device, synthetic_rooms, unet_steps

    p = build_parser()
    args = p.parse_args(argv)
    device = bench_device(args.device)
    x = synthetic_rooms(args.rooms, args.voxel_size, args.points).to(device)
    nets = unet_steps(x, args.width, args.depth, device, PRECISIONS[args.precision])
    names = list(dict.fromkeys(n.strip() for n in args.networks.split(",") if n.strip()))
    unknown = [n for n in names if n not in nets]
    if unknown or not names:
        p.error(f"--networks: {unknown or 'none'} not among this device's networks "
                f"{sorted(nets)}")
    print(f"{x.num_voxels} voxels, U-Net width {args.width} depth {args.depth}, "
          f"{args.precision} on {device}")
    result: dict[str, Any] = {"env": environment(), "device": str(device),
                              "precision": args.precision, "voxels": x.num_voxels,
                              "networks": {}}
    for name in names:  # warm-up: spconv tunes its kernels on first use
        nets[name]()
        nets[name]()
    for name in names:
        r = result["networks"][name] = _issue_times(nets[name], device, args.repeats)
        print(f"{name:20s} step {r['step_s'] * 1e3:7.1f} ms, host issues it in "
              f"{r['issue_s'] * 1e3:7.1f} ms")
    for name in names:
        f = result["networks"][name]["functions"] = _functions(nets[name], device, args.top)
        print(f"{name}: by own time (calls, own ms, total ms)")
        for where, calls, own, total in f["by_own"]:
            print(f"  {calls:6d} {own * 1e3:8.2f} {total * 1e3:8.2f}  {where}")
        print(f"{name}: the project's functions by total time")
        for where, calls, own, total in f["ours_by_total"]:
            print(f"  {calls:6d} {own * 1e3:8.2f} {total * 1e3:8.2f}  {where}")
        b = result["networks"][name]["backward"] = _backward(nets[name], device, args.top)
        print(f"{name}: backward on the host {b['total_s'] * 1e3:.1f} ms (profiled), by node "
              f"(calls, ms)")
        for what, calls, total in b["nodes"]:
            print(f"  {calls:6d} {total * 1e3:8.2f}  {what}")
        write_json(args.json, result)
