"""Benchmark: gradient all-reduce after backward (flat) versus in buckets started during backward.

    mpirun -n 2 python -m sparsepipe_hpc.bench allreduce --json allreduce.json

Data parallelism over every rank (one synthetic room per rank), the U-Net's full step: forward,
backward, gradient sum, no optimizer. Per mode, interleaved (flat, bucketed, flat, ...) so load
drifts hit all alike: the step time (slowest rank) and the time left in the reduction call after
backward returned (what overlap did not hide). On a CPU without an MPI progress thread a started
all-reduce moves only inside MPI calls (the reducer pokes it from each gradient hook), so expect
little hidden here; on GPUs with NCCL the buckets run on their own stream.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from mpi4py import MPI

from sparsepipe_hpc.bench.common import environment, synthetic_room, write_json
from sparsepipe_hpc.nn.models import SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main"]


def _step(net: torch.nn.Module, x: Any, reduce_start: Callable[[], None],
          reduce_end: Callable[[], None]) -> tuple[float, float]:
    """(step seconds, seconds in the reduction after backward)."""
    t0 = time.perf_counter()
    net.zero_grad(set_to_none=True)
    out = net(x.replace(kmaps={}))  # maps built every step, as in training
    reduce_start()
    out.feats.square().mean().backward()
    t1 = time.perf_counter()
    reduce_end()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench allreduce",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--width", type=positive_int, default=32)
    ap.add_argument("--depth", type=positive_int, default=4)
    ap.add_argument("--voxel-size", type=float, default=0.08)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=positive_int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one compute thread per rank (spconv's CPU build needs it)
    comm = MPI.COMM_WORLD
    ctx = ParallelContext(comm, RankLayout.from_world(comm.Get_size()))
    torch.manual_seed(0)
    net = SparseUNet(3, 8, width=args.width, depth=args.depth)
    x = synthetic_room(voxel_size=args.voxel_size, seed=comm.Get_rank(), points=300_000)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    modes: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "flat": (lambda: None, lambda: ctx.allreduce_gradients(net))}
    reducers = []
    for mb in args.bucket_mb:
        r = ctx.gradient_reducer(net, max(1, int(mb * 2**20)))
        reducers.append(r)
        modes[f"bucketed {mb:g} MiB ({len(r.buckets)} buckets)"] = (r.arm, r.finish)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, (start, end) in modes.items():
            comm.Barrier()
            step_s, tail_s = _step(net, x, start, end)
            worst = comm.allreduce(step_s, op=MPI.MAX), comm.allreduce(tail_s, op=MPI.MAX)
            if rep:
                times[name].append(worst)
    rows: list[dict[str, Any]] = [{"mode": m, "step_s": statistics.median(s for s, _ in ts),
             "reduce_after_backward_s": statistics.median(t for _, t in ts)}
            for m, ts in times.items()]
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, {grad_bytes / 2**20:.2f} MiB of gradients, "
              f"{x.num_voxels} voxels per rank, median of {args.repeats}")
        for row in rows:
            step_ms, tail_ms = 1e3 * float(row["step_s"]), 1e3 * float(row["reduce_after_backward_s"])
            print(f"  {row['mode']:<34} step {step_ms:8.1f} ms   reduction left after backward "
                  f"{tail_ms:7.2f} ms")
        if args.json:
            write_json(args.json, {"benchmark": "allreduce", "ranks": comm.Get_size(),
                                   "gradient_bytes": grad_bytes, "voxels_per_rank": x.num_voxels,
                                   "rows": rows, "environment": environment(comm)})
    for r in reducers:
        r.close()
