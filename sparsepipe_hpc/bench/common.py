"""Shared pieces of the benchmarks: a synthetic room as a SparseTensor, timing (side by side,
CUDA events on a GPU), JSON output."""

from __future__ import annotations

import json
import sys
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import numpy as np
import torch

from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.voxelize import voxelize

__all__ = ["synthetic_room", "sync", "time_once", "time_alternating", "time_step", "paired_ratios",
           "rotated", "write_json", "environment"]

T = TypeVar("T")


def synthetic_room(voxel_size: float = 0.03, size=(6.0, 6.0, 3.0), points: int = 1_000_000,
                   seed: int = 0, channels: int = 3, stride_multiple: int = 16) -> SparseTensor:
    """One furnished room from the synthetic generator, voxelized (batch of 1).

    The defaults give about 160k voxels of 3 cm: the scale of the papers' indoor rooms.
    """
    from sparsepipe_hpc.data.synth import make_room

    rng = np.random.default_rng(seed)
    xyz, rgb, _ = make_room(rng, size=size, points=(points, points))
    lo = xyz.min(0) - voxel_size
    shape = np.ceil((xyz.max(0) - lo) / voxel_size).astype(int) + 1
    shape = (np.ceil(shape / stride_multiple) * stride_multiple).astype(int)
    feats = rgb.astype(np.float32)[:, :channels] / 255.0
    vox = voxelize(xyz, feats, voxel_size, lo, shape)
    return SparseTensor.from_voxels([vox], shape)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s work so far (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device
               ) -> tuple[float, Optional[int], Optional[int]]:
    """Seconds of one ``fn()`` (CUDA events on a GPU, wall clock on a CPU), the peak device
    memory during it and the memory allocated when it started (None, None on a CPU)."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(device), base


def time_alternating(fns: Mapping[str, Callable[[], Any]], device: torch.device, repeats: int,
                     warmup: int = 1, before: Optional[Callable[[], Any]] = None
                     ) -> dict[str, dict[str, Any]]:
    """Per name of ``fns``: median and min seconds of one call, every round's (``all_s``), the
    peak device memory (``peak_bytes``) and the most a call added to what was allocated when it
    started (``peak_over_start_bytes``: its own activations, gradients and workspace, not what
    other functions' objects hold meanwhile).

    ``warmup`` rounds, then ``repeats`` rounds that call every function once in turn, so that
    drift (clocks, other load, allocator state) falls on all of them alike, each round starting
    one function later than the last (no function always runs first, or after the same one);
    ``before`` runs untimed ahead of every call (say, to free every model's gradients).
    """
    for _ in range(warmup):
        for fn in fns.values():
            if before is not None:
                before()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, Optional[int]] = {name: None for name in fns}
    added: dict[str, Optional[int]] = {name: None for name in fns}
    for r in range(repeats if fns else 0):
        for name in rotated(list(fns), r):
            fn = fns[name]
            if before is not None:
                before()
            t, peak, base = time_once(fn, device)
            times[name].append(t)
            if peak is not None and base is not None:
                peaks[name] = max(peaks[name] or 0, peak)
                added[name] = max(added[name] or 0, peak - base)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts,
                   "repeats": repeats, "peak_bytes": peaks[name],
                   "peak_over_start_bytes": added[name]} for name, ts in times.items()}


def rotated(items: list[T], r: int) -> list[T]:
    """``items`` starting at ``r`` (mod their count): round ``r``'s order, so that no variant
    always runs first, or after the same one. ``items`` not empty."""
    k = r % len(items)
    return items[k:] + items[:k]


def paired_ratios(times: dict[str, dict[str, Any]], name: str, base: str) -> dict[str, float]:
    """``name``'s time over ``base``'s, round by round (both from one :func:`time_alternating`):
    their median, min and max. Paired, so a slow round (clocks, other load) slows both sides."""
    ratios = sorted(a / b for a, b in zip(times[name]["all_s"], times[base]["all_s"]))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def time_step(fn: Callable[[], Any], device: torch.device, repeats: int,
              warmup: int = 1) -> dict[str, Any]:
    """Median and min seconds of ``fn`` (CUDA events on a GPU) and the peak device memory."""
    return time_alternating({"fn": fn}, device, repeats, warmup)["fn"]


def environment(comm: Optional[Any] = None) -> dict[str, Any]:
    import spconv

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "spconv": getattr(spconv, "__version__", "?"), "threads": torch.get_num_threads(),
           "machine": platform.machine(), "processor": platform.processor()}
    if comm is not None:
        from mpi4py import MPI

        env["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        env["world_size"] = comm.Get_size()
    return env


def write_json(path: Optional[str], result: dict[str, Any]) -> None:
    if path:
        try:
            Path(path).write_text(json.dumps(result, indent=2) + "\n")
        except OSError as e:  # a user error (a missing folder), not a traceback
            print(f"error: --json {path}: cannot write it ({e.strerror}); the figures are "
                  f"printed above", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"wrote {path}")
