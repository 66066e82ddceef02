"""Shared pieces of the benchmarks: a synthetic room as a SparseTensor, timing, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.voxelize import voxelize

__all__ = ["synthetic_room", "timeit", "timeit_pair", "write_json", "environment"]


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


def timeit(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median and min wall time of ``fn`` in seconds over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def timeit_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int = 5,
                warmup: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """Time two functions alternately (a, b, a, b, ...) so drifts in machine load hit both alike."""
    for _ in range(warmup):
        a()
        b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return tuple({"median_s": statistics.median(ts), "min_s": min(ts), "repeats": repeats}
                 for ts in times)  # type: ignore[return-value]


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
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
