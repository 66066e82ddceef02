"""Input scaling benchmark: peak memory per rank and input time per step at 1, 2, 4 spatial ranks.

    python -m sparsepipe_hpc.bench scale --json scale.json            # starts mpirun itself
    python -m sparsepipe_hpc.bench scale --points 8000000 --ranks 1 2 4 --step

One large synthetic scene (a floor of furnished rooms, :func:`sparsepipe_hpc.data.floor.write_floor`,
``--points`` in all) is written to a temporary HDF5 file, in the chunked layout
(``--chunk-size`` metres, default 0.5; 0: the plain point-range layout); then, for every rank
count ``n`` and both input paths, ``mpirun -n n`` runs a worker on an ``n x 1 x 1`` spatial grid:

  whole        what the trainer does today: every rank reads, augments and voxelizes the whole
               sample (``collate``), then keeps its box (``ctx.distribute``)
  distributed  :func:`sparsepipe_hpc.parallel.input.read_distributed`: each rank reads the
               chunks near its box (chunked layout) or its hyperslab (point ranges; voxels
               then move to their owners); ``points_read`` per rank says how many rows

Per rank: peak resident memory (``ru_maxrss``, MiB) at the end, before the first input (imports,
MPI) and right after it (its difference to the one before: the input's own peak), and the median
input time per step (read + augment + voxelize + distribute), wall-clock and CPU (the process's
own: on a machine with fewer cores than ranks it shows the work per rank, which wall-clock time
cannot); with
``--step`` also a U-Net forward+backward on the rank's voxels. Every rank runs one compute thread;
on a machine with fewer cores than ranks the time figures measure the machine, not the method.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from sparsepipe_hpc.data.floor import write_floor
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "write_floor"]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.input import read_distributed
    from sparsepipe_hpc.parallel.layout import RankLayout

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    n = world.Get_size()
    ctx = ParallelContext(world, RankLayout(1, 1, (n, 1, 1)), force_spatial=True)
    ds = SceneDataset(args.worker, check="structure")  # bounds come from the attributes
    align = 2 ** args.depth
    origin, shape = grid_for(ds, args.voxel_size, multiple=align)
    batches = ShardedBatches(1, 1, seed=0)
    net = SparseUNet(ds.in_channels, ds.num_classes, width=args.width, depth=args.depth) \
        if args.step else None
    before = _peak_mib()
    input_s, input_cpu_s, step_s, voxels, after_input, points_read = [], [], [], 0, 0.0, 0
    for r in range(args.repeats):
        gens = batches.sample_generators([0], r) if args.augment else None
        world.Barrier()
        t = time.perf_counter()
        cpu = time.process_time()
        if args.mode == "whole":
            batch = collate([ds[0]], args.voxel_size, origin, shape, augment=args.augment,
                            generator=gens)
            x, y = ctx.distribute(batch.x, batch.labels, align=align)
            labels = cast(torch.Tensor, y)  # distribute types every output as a SparseTensor
            del batch
        else:
            b = read_distributed(ctx, ds, [0], args.voxel_size, origin, shape, generators=gens,
                                 align=align)
            x, labels, points_read = b.x, b.labels, b.points_read
            del b
        input_s.append(time.perf_counter() - t)
        input_cpu_s.append(time.process_time() - cpu)
        if r == 0:  # ru_maxrss only grows: read the input's peak before any step raises it
            after_input = _peak_mib()
        voxels = x.num_voxels
        if net is not None:
            t = time.perf_counter()
            out = net(x)
            share = torch.nn.functional.cross_entropy(out.feats, labels, reduction="sum") / \
                ctx.global_count(len(labels))
            share.backward()
            ctx.allreduce_gradients(net)
            step_s.append(time.perf_counter() - t)
            del out, share
        del x, labels
    mine = {"rank": world.Get_rank(), "peak_rss_mib": _peak_mib(), "rss_before_input_mib": before,
            "peak_rss_after_input_mib": after_input,
            "input_s": statistics.median(input_s), "voxels": voxels,
            "input_cpu_s": statistics.median(input_cpu_s),
            "points_read": points_read if args.mode == "distributed" else int(ds.sizes[0]),
            "step_s": statistics.median(step_s) if step_s else None}
    every = world.gather(mine)
    if world.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"ranks": n, "mode": args.mode, "per_rank": every,
                                              "grid": {"origin_m": list(origin),
                                                       "spatial_shape": list(shape)}}))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_pml", "ob1")
    env.setdefault("OMPI_MCA_btl", "self,sm")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(n: int, scene: Path, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{mode}_{n}.json"
    cmd = ["mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "sparsepipe_hpc.bench", "scale", "--worker", str(scene),
            "--mode", mode, "--out", str(out), "--repeats", str(args.repeats),
            "--voxel-size", str(args.voxel_size), "--width", str(args.width),
            "--depth", str(args.depth)] + (["--step"] if args.step else []) + \
        ([] if args.augment else ["--no-augment"])
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"scale: {' '.join(cmd[:3])} ({mode}) exited {proc.returncode}\n"
                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _summary(runs: dict[str, dict[int, dict]]) -> dict[str, Any]:
    """Per mode and rank count the largest rank's figures, and ratios between the fewest and the
    most ranks each mode ran at."""
    out: dict[str, Any] = {}
    for mode, by_n in runs.items():
        if not by_n:
            continue
        rows = {}
        for n, run in sorted(by_n.items()):
            pr = run["per_rank"]
            rows[n] = {"max_peak_rss_mib": max(r["peak_rss_mib"] for r in pr),
                       "max_input_rss_mib": max(r["peak_rss_after_input_mib"]
                                                - r["rss_before_input_mib"] for r in pr),
                       "max_input_s": max(r["input_s"] for r in pr),
                       "max_input_cpu_s": max(r["input_cpu_s"] for r in pr),
                       "max_step_s": max((r["step_s"] or 0.0) for r in pr) or None,
                       "voxels_per_rank": [r["voxels"] for r in pr],
                       "points_read_per_rank": [r.get("points_read") for r in pr]}
        lo, hi = min(rows), max(rows)
        rows_any: dict[str, Any] = {str(k): v for k, v in rows.items()}
        rows_any["peak_ratio_%d_over_%d" % (hi, lo)] = (rows[hi]["max_peak_rss_mib"]
                                                        / rows[lo]["max_peak_rss_mib"])
        base = rows[lo]["max_input_rss_mib"]  # a difference of peaks: may be 0, no ratio then
        rows_any["input_rss_ratio_%d_over_%d" % (hi, lo)] = (
            rows[hi]["max_input_rss_mib"] / base if base > 0 else None)
        rows_any["input_speedup_%d_over_%d" % (lo, hi)] = (rows[lo]["max_input_s"]
                                                           / rows[hi]["max_input_s"])
        rows_any["input_cpu_speedup_%d_over_%d" % (lo, hi)] = (rows[lo]["max_input_cpu_s"]
                                                               / rows[hi]["max_input_cpu_s"])
        out[mode] = rows_any
    if runs.get("distributed"):
        lo, hi = min(runs["distributed"]), max(runs["distributed"])
        d = out["distributed"]
        # Issue 14's targets, for the distributed path between the fewest and the most ranks.
        out["targets"] = {"peak_ratio_max": 0.35, "input_speedup_min": 3.0,
                          "peak_ratio": d["peak_ratio_%d_over_%d" % (hi, lo)],
                          "input_speedup": d["input_speedup_%d_over_%d" % (lo, hi)],
                          "input_cpu_speedup": d["input_cpu_speedup_%d_over_%d" % (lo, hi)]}
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench scale")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--points", type=positive_int, default=4_000_000, help="points in the scene")
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--voxel-size", type=float, default=0.02)
    p.add_argument("--chunk-size", type=float, default=0.5,
                   help="metres per chunk of the scene's chunked layout; 0: point-range layout")
    p.add_argument("--rooms", type=positive_int, nargs=2, default=(2, 2), metavar=("X", "Y"),
                   help="rooms of the floor along x and y")
    p.add_argument("--modes", nargs="+", choices=["whole", "distributed"],
                   default=["whole", "distributed"], help="input paths to measure")
    p.add_argument("--whole-max-ranks", type=positive_int, default=1 << 30,
                   help="run the whole-sample path only up to this many ranks (it needs the "
                        "whole sample's memory on every rank)")
    p.add_argument("--step", action="store_true", help="also time a U-Net forward+backward")
    p.add_argument("--no-augment", dest="augment", action="store_false",
                   help="no flips or jitter (each rank draws the jitter of only the "
                        "65536-row blocks it reads)")
    p.add_argument("--width", type=positive_int, default=8)
    p.add_argument("--depth", type=positive_int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["whole", "distributed"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        sys.exit("scale: run this without mpirun; it starts mpirun at each rank count itself")
    with tempfile.TemporaryDirectory(prefix="sparsepipe-scale-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        scene = write_floor(tmp / "floor.h5", args.points, rooms_x=args.rooms[0],
                            rooms_y=args.rooms[1], chunk_size=args.chunk_size or None)
        layout = f"chunks of {args.chunk_size} m" if args.chunk_size else "point ranges"
        print(f"scene: {args.points} points ({layout}), "
              f"{scene.stat().st_size / 2**20:.0f} MiB on disk "
              f"({time.perf_counter() - t:.1f} s to write)")
        runs: dict[str, dict[int, dict]] = {m: {} for m in args.modes}
        for n in args.ranks:
            for mode in runs:
                if mode == "whole" and n > args.whole_max_ranks:
                    continue
                runs[mode][n] = _run(n, scene, mode, args, tmp)
                r = runs[mode][n]["per_rank"]
                print(f"{mode:>11} n={n}: max peak RSS {max(x['peak_rss_mib'] for x in r):7.0f} "
                      f"MiB (input part {max(x['peak_rss_after_input_mib'] - x['rss_before_input_mib'] for x in r):6.0f}"
                      f" MiB), input {max(x['input_s'] for x in r):6.2f} s/step "
                      f"(CPU {max(x['input_cpu_s'] for x in r):6.2f} s)"
                      + (f", step {max(x['step_s'] for x in r):6.2f} s" if args.step else "")
                      + f", points read per rank {[x['points_read'] for x in r]}")
        from sparsepipe_hpc.bench.common import write_json

        result = {"points": args.points, "voxel_size_m": args.voxel_size, "ranks": args.ranks,
                  "chunk_size_m": args.chunk_size or None, "rooms": list(args.rooms),
                  "augment": args.augment,
                  "cpus": os.cpu_count(), "runs": {m: {str(n): v for n, v in by.items()}
                                                   for m, by in runs.items()},
                  "summary": _summary(runs)}
        print(json.dumps(result["summary"], indent=1))
        write_json(args.json, result)
