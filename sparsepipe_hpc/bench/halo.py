"""Halo benchmark: exchange versus a plain mpi4py ping-pong, plan building, load balance.

    mpirun -n 2 python -m sparsepipe_hpc.bench halo --json halo.json
    mpirun -n 4 python -m sparsepipe_hpc.bench halo --json halo.json --grid 2,2,1 --quick

What it measures, in one run:

- ping-pong: ranks 0 and 1 bounce one host buffer with ``Send``/``Recv`` (mpi4py, buffer
  protocol); the one-way time is half the round trip. This is the floor for one message.
- exchange: a (P, 1, 1) slab grid, each box a dense 16 x 16 face two voxels thick, so a radius-1
  plan sends each x neighbour one message of 256 rows; the channel count sets the message size.
  Time of ``HaloExchange.start(feats).wait()`` (packing rows, both directions at once) and of the
  adjoint, slowest rank. ratio = exchange / ping-pong one-way at the same message size (1.0: the
  exchange costs one message's latency, i.e. packing and the second direction are free).
- plan: ``build_plan`` (radius 1) and ``kernel_maps`` (3x3x3 submanifold) on a clustered cloud of
  ``--plan-voxels`` voxels per rank over balanced cuts; seconds per 100k owned voxels.
- load balance (rank 0, no communication: the histogram is all that matters): max/mean voxels per
  box for uniform, quantile and min-max cuts on clustered and shell clouds, several grid shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import halo
from halo.balance import bin_widths, grid_histogram
from halo.synth import clustered_cloud, shell_cloud, with_batch
from sparsepipe_hpc.bench.common import environment, write_json

__all__ = ["main"]

FACE = 16  # the exchange's face is FACE x FACE voxels: 256 rows per message
LB_GRIDS = [(2, 1, 1), (4, 1, 1), (8, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (4, 2, 2), (4, 4, 2)]


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _reps(nbytes: int, quick: bool) -> int:
    """Enough repetitions for ~50-100 ms per size on shared memory, at least 5."""
    base = max(5, min(2000, int(2e8 / max(nbytes, 1) ** 1.0) + 5))
    return max(5, base // 10) if quick else base


def _slowest(comm: MPI.Comm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def _timed(comm: MPI.Comm, fn: Callable[[], Any], reps: int, trials: int = 3) -> float:
    """Median over trials of the slowest rank's mean time per call (all ranks call ``fn``)."""
    fn()
    out = []
    for _ in range(trials):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append(_slowest(comm, (time.perf_counter() - t) / reps))
    return statistics.median(out)


def pingpong(comm: MPI.Comm, sizes: list[int], quick: bool) -> list[dict[str, float]]:
    """One-way time and bandwidth between ranks 0 and 1; other ranks wait at the barrier."""
    rows = []
    for n in sizes:
        buf = np.zeros(n, np.uint8)
        reps = _reps(n, quick)

        def bounce() -> None:
            if comm.rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=1)
            elif comm.rank == 1:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=1)

        t = _timed(comm, bounce, reps) / 2
        rows.append({"bytes": n, "one_way_s": t, "bandwidth_GBps": n / t / 1e9})
    return rows


def exchange(comm: MPI.Intracomm, sizes: list[int], quick: bool,
             ping: dict[int, float]) -> list[dict[str, float]]:
    p = comm.size
    grid = halo.ProcessGrid(comm, (p, 1, 1))
    cuts = halo.uniform_cuts((2 * p, FACE, FACE), grid.dims)
    lo, hi = cuts.box(grid.coords)
    xyz = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(lo, hi)), indexing="ij"),
                   -1).reshape(-1, 3)
    coords = with_batch(xyz)
    plan = halo.build_plan(grid, cuts, coords, radius=1)
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    rows = []
    for n in sizes:
        c = max(1, n // (FACE * FACE * 4))
        feats = torch.randn(len(coords), c)
        grad = torch.randn(plan.num_halo, c)
        out = torch.empty(plan.num_halo, c)
        reps = _reps(n, quick)
        t = _timed(comm, lambda: ex.start(feats, out=out).wait(), reps)
        t_new = _timed(comm, lambda: ex.start(feats).wait(), reps)
        t_adj = _timed(comm, lambda: ex.start_adjoint(grad).wait(), reps)
        msg = FACE * FACE * c * 4
        rows.append({"bytes": msg, "rows": FACE * FACE, "channels": c, "time_s": t,
                     "bandwidth_GBps": msg / t / 1e9, "time_new_output_s": t_new,
                     "adjoint_time_s": t_adj, "pingpong_one_way_s": ping[n],
                     "ratio": t / ping[n], "adjoint_ratio": t_adj / ping[n]})
    return rows


def plan_build(comm: MPI.Intracomm, voxels: int, quick: bool) -> dict[str, Any]:
    grid = halo.ProcessGrid(comm)
    extent = tuple(int(v) for v in np.array([512, 512, 256]) * max(1, round(comm.size ** (1 / 3))))
    rng = np.random.default_rng(7 + comm.rank)
    mine = clustered_cloud(rng, voxels * 12 // 10, extent, clusters=6, spread=0.05)
    cuts = halo.balanced_cuts(grid.comm, mine, extent, grid.dims, align=8)
    # Every rank generated its own cloud: move the voxels to their owners first.
    (coords,) = halo.distribute(grid, cuts, with_batch(mine, comm.rank))
    reps = 1 if quick else 3

    def build() -> halo.HaloPlan:
        return halo.build_plan(grid, cuts, coords, radius=1)

    t_plan = _timed(comm, build, reps, trials=1 if quick else 3)
    plan = build()
    t_maps = _timed(comm, lambda: plan.kernel_maps(coords, coords, 3, padding=1), reps,
                    trials=1 if quick else 3)
    n_max = comm.allreduce(len(coords), op=MPI.MAX)
    n_sum = comm.allreduce(len(coords), op=MPI.SUM)
    h_sum = comm.allreduce(plan.num_halo, op=MPI.SUM)
    return {"grid": list(grid.dims), "voxels_per_rank_max": n_max, "voxels_total": n_sum,
            "halo_total": h_sum, "build_plan_s": t_plan, "kernel_maps_s": t_maps,
            "build_plan_s_per_100k": t_plan / (n_max / 1e5),
            "kernel_maps_s_per_100k": t_maps / (n_max / 1e5)}


def load_balance(quick: bool) -> list[dict[str, Any]]:
    rows = []
    extent, align = (512, 512, 128), 8
    n = 50_000 if quick else 300_000
    clouds = {"clustered": clustered_cloud(np.random.default_rng(1), n, extent, clusters=5),
              "shells": shell_cloud(np.random.default_rng(2), n, extent, spheres=4)}
    for name, xyz in clouds.items():
        hist = halo.axis_histograms(xyz, extent, align)
        for dims in LB_GRIDS:
            w = bin_widths(extent, dims, align)
            counts = {
                "uniform": halo.uniform_cuts(extent, dims, align).count(xyz),
                "quantile": halo.cuts_from_histograms(hist, extent, dims, align).count(xyz),
                "minmax": halo.minmax_cuts(grid_histogram(xyz, extent, w), w, extent, dims,
                                           align).count(xyz)}
            row: dict[str, Any] = {"cloud": name, "voxels": len(xyz), "grid": list(dims)}
            for k, cnt in counts.items():
                row[f"{k}_max_over_mean"] = float(cnt.max() / cnt.mean())
                row[f"{k}_empty_boxes"] = int((cnt == 0).sum())
            rows.append(row)
    return rows


def _report(result: dict[str, Any]) -> None:
    print(f"halo benchmark, {result['env'].get('world_size')} rank(s); {result['env'].get('mpi')}")
    if result["exchange"]:
        print("\n   message  ping-pong 1-way      GB/s   exchange      GB/s  ratio   adjoint  ratio")
        for e in result["exchange"]:
            print(f"{e['bytes']:>10} {e['pingpong_one_way_s'] * 1e6:12.1f} us "
                  f"{e['bytes'] / e['pingpong_one_way_s'] / 1e9:9.2f} "
                  f"{e['time_s'] * 1e6:8.1f} us {e['bandwidth_GBps']:8.2f} {e['ratio']:6.2f} "
                  f"{e['adjoint_time_s'] * 1e6:7.1f} us {e['adjoint_ratio']:5.2f}")
    p = result["plan"]
    print(f"\nplan on grid {tuple(p['grid'])}: {p['voxels_per_rank_max']} voxels on the fullest "
          f"rank, {p['halo_total']} halo rows in all")
    print(f"  build_plan  {p['build_plan_s'] * 1e3:8.1f} ms  = {p['build_plan_s_per_100k'] * 1e3:6.1f}"
          f" ms per 100k voxels")
    print(f"  kernel_maps {p['kernel_maps_s'] * 1e3:8.1f} ms  = "
          f"{p['kernel_maps_s_per_100k'] * 1e3:6.1f} ms per 100k voxels")
    print("\nload balance, max/mean voxels per box (1.0 is ideal)\n"
          "     cloud        grid  uniform  quantile  minmax")
    for r in result["load_balance"]:
        print(f"{r['cloud']:>10} {str(tuple(r['grid'])):>11} {r['uniform_max_over_mean']:8.3f} "
              f"{r['quantile_max_over_mean']:9.3f} {r['minmax_max_over_mean']:7.3f}")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench halo",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--min-bytes", type=int, default=1 << 10)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--plan-voxels", type=int, default=200_000, help="voxels per rank")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from launch.run import abort_on_exception

    abort_on_exception()
    comm = MPI.COMM_WORLD
    sizes = _sizes(max(args.min_bytes, FACE * FACE * 4), args.max_bytes)
    result: dict[str, Any] = {"env": environment(comm), "pingpong": [], "exchange": []}
    if comm.size >= 2:
        result["pingpong"] = pingpong(comm, sizes, args.quick)
        ping = {r["bytes"]: r["one_way_s"] for r in result["pingpong"]}
        result["exchange"] = exchange(comm, sizes, args.quick, ping)
    elif comm.rank == 0:
        print("one rank: no ping-pong or exchange (run under mpirun -n 2 or more)")
    result["plan"] = plan_build(comm, args.plan_voxels, args.quick)
    if comm.rank == 0:
        result["load_balance"] = load_balance(args.quick)
        _report(result)
        write_json(args.json, result)
