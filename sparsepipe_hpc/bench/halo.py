"""Halo benchmark: exchange versus a plain mpi4py ping-pong, plan building, load balance.

    mpirun -n 2 python -m sparsepipe_hpc.bench halo --json halo.json
    mpirun -n 4 python -m sparsepipe_hpc.bench halo --json halo.json --quick

What it measures, in one run (figures from ranks 0 and 1 of the run for the messages, from every
rank for the plan, from rank 0 alone for the load-balance table):

- ping-pong: ranks 0 and 1 bounce one host buffer with ``Send``/``Recv`` (mpi4py, buffer
  protocol); the one-way time is half the round trip. This is the floor for one message.
- exchange: a (P, 1, 1) slab grid, each box a dense 16 x 16 face two voxels thick, so a radius-1
  plan sends each x neighbour one message of 256 rows; the channel count sets the message size.
  ``HaloExchange.start(feats, out=buf).wait()`` (both directions at once; x faces are contiguous
  rows, sent as they lie) and the adjoint accumulating into a buffer; ``*_new_output``: the same
  with a new result tensor per call; ``*_packed``: a (1, P, 1) grid, whose y faces are strided
  rows packed with ``index_select``. Per call on the slowest rank, best of ``--trials`` trials,
  interleaved with the ping-pong's so that both see the same background load. ratio = time /
  ping-pong one-way at the same message size (1.0: Python, packing and the second direction free).
  ``mpi_swap``: plain mpi4py ``Irecv``/``Isend``/``Waitall`` of the same bytes both ways between
  ranks 0 and 1, the floor of a two-rank exchange (what the second direction costs by itself).
- host memory: run with ``mpirun -x THP_MEM_ALLOC_ENABLE=1`` so torch's large host tensors get
  transparent huge pages, as numpy's arrays do by default. Without it, Open MPI's single-copy
  (CMA) path moved 16 MiB from torch memory ~1.7x slower than from numpy memory here (the same
  Irecv/Isend calls), which the exchange then inherits.
- plan: ``build_plan`` (radius 1) and ``kernel_maps`` (3x3x3 submanifold) on a clustered cloud of
  ``--plan-voxels`` voxels per rank over balanced cuts; seconds per 100k owned voxels.
- load balance (no communication: the histogram is all that matters): max/mean voxels per box for
  uniform, quantile and min-max cuts on clustered and shell clouds, several grid shapes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import halo
from halo.balance import bin_widths, grid_histogram
from halo.synth import clustered_cloud, shell_cloud, with_batch
from sparsepipe_hpc.bench.common import environment, write_json
from sparsepipe_hpc.bench._args import nonneg_int, positive_int

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
    """Repetitions per trial: ~10 ms of shared-memory traffic per trial, 3 to 500 calls."""
    base = int(min(500, max(3, 1e7 / max(nbytes, 1))))
    return max(2, base // 5) if quick else base


def _trial(comm: MPI.Comm, fn: Callable[[], Any], reps: int) -> float:
    """Mean seconds per call of ``fn`` over ``reps`` calls on the slowest rank (all ranks call)."""
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return comm.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX)


def _slab_exchange(comm: MPI.Intracomm, axis: int) -> tuple[halo.HaloExchange, int]:
    """A (P, 1, 1) or (1, P, 1) grid of dense boxes two voxels thick with FACE x FACE faces.

    Rows are sorted by key (x-major), so an x face is a contiguous range of rows (sent as it lies)
    while a y face is strided (packed with index_select).
    """
    dims, extent = [1, 1, 1], [FACE, FACE, FACE]
    dims[axis], extent[axis] = comm.size, 2 * comm.size
    grid = halo.ProcessGrid(comm, dims)
    cuts = halo.uniform_cuts(extent, grid.dims)
    lo, hi = cuts.box(grid.coords)
    xyz = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(lo, hi)), indexing="ij"),
                   -1).reshape(-1, 3)
    plan = halo.build_plan(grid, cuts, with_batch(xyz), radius=1)
    return halo.HaloExchange(plan, halo.MPITransport(grid.comm)), len(xyz)


def messages(comm: MPI.Intracomm, sizes: list[int], quick: bool, trials: int) -> list[dict]:
    """Per message size: ping-pong, exchange and adjoint, their trials interleaved.

    Interleaving puts every candidate under the same background load; each figure is the best
    trial (noise on a shared machine only ever adds time).
    """
    ex_x, n_x = _slab_exchange(comm, 0)
    ex_y, n_y = _slab_exchange(comm, 1)
    rows = []
    for n in sizes:
        c = max(1, n // (FACE * FACE * 4))
        msg = FACE * FACE * c * 4
        buf = np.zeros(msg, np.uint8)

        def bounce() -> None:
            if comm.rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=1)
            elif comm.rank == 1:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=1)

        rbuf = np.zeros(msg, np.uint8)

        def swap() -> None:  # plain mpi4py, both directions at once: the exchange's own floor
            if comm.rank < 2:
                other = 1 - comm.rank
                MPI.Request.Waitall([comm.Irecv(rbuf, source=other, tag=2),
                                     comm.Isend(buf, dest=other, tag=2)])

        fx, fy = torch.randn(n_x, c), torch.randn(n_y, c)
        gx, gy = torch.randn(ex_x.plan.num_halo, c), torch.randn(ex_y.plan.num_halo, c)
        ox, oy = torch.empty_like(gx), torch.empty_like(gy)
        ax, ay = torch.zeros_like(fx), torch.zeros_like(fy)
        cands: dict[str, Callable[[], Any]] = {
            "pingpong_round_trip": bounce,
            "mpi_swap": swap,
            "exchange": lambda: ex_x.start(fx, out=ox).wait(),
            "exchange_new_output": lambda: ex_x.start(fx).wait(),
            "adjoint": lambda: ex_x.start_adjoint(gx, out=ax).wait(),
            "adjoint_new_output": lambda: ex_x.start_adjoint(gx).wait(),
            "exchange_packed": lambda: ex_y.start(fy, out=oy).wait(),
            "adjoint_packed": lambda: ex_y.start_adjoint(gy, out=ay).wait(),
        }
        reps = _reps(msg, quick)
        best = {k: float("inf") for k in cands}
        for fn in cands.values():
            fn()  # warm up: first-touch pages, staging buffers
        for _ in range(trials):
            for k, fn in cands.items():
                best[k] = min(best[k], _trial(comm, fn, reps))
        one_way = best.pop("pingpong_round_trip") / 2
        row: dict[str, Any] = {"bytes": msg, "rows": FACE * FACE, "channels": c,
                               "pingpong_one_way_s": one_way,
                               "pingpong_GBps": msg / one_way / 1e9}
        for k, t in best.items():
            row[f"{k}_s"] = t
            row[f"{k}_ratio"] = t / one_way
        row["exchange_GBps"] = msg / best["exchange"] / 1e9
        rows.append(row)
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

    plan = build()
    t_plan = min(_trial(comm, build, reps) for _ in range(1 if quick else 3))
    t_maps = min(_trial(comm, lambda: plan.kernel_maps(coords, coords, 3, padding=1), reps)
                 for _ in range(1 if quick else 3))
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
    if result["messages"]:
        print("\nper call, slowest rank, best of the interleaved trials; ratio = time / ping-pong "
              "one-way\n   message   ping-pong 1-way  GB/s | mpi swap ratio |  exchange  GB/s "
              "ratio |   adjoint ratio | packed: exchange ratio  adjoint ratio")
        for e in result["messages"]:
            print(f"{e['bytes']:>10} {e['pingpong_one_way_s'] * 1e6:12.1f} us {e['pingpong_GBps']:5.2f}"
                  f" | {e['mpi_swap_s'] * 1e6:6.1f} us {e['mpi_swap_ratio']:5.2f}"
                  f" | {e['exchange_s'] * 1e6:6.1f} us {e['exchange_GBps']:5.2f} "
                  f"{e['exchange_ratio']:5.2f} | {e['adjoint_s'] * 1e6:6.1f} us "
                  f"{e['adjoint_ratio']:5.2f} | {e['exchange_packed_s'] * 1e6:8.1f} us "
                  f"{e['exchange_packed_ratio']:5.2f} {e['adjoint_packed_s'] * 1e6:6.1f} us "
                  f"{e['adjoint_packed_ratio']:5.2f}")
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
    ap.add_argument("--min-bytes", type=nonneg_int, default=1 << 10)
    ap.add_argument("--max-bytes", type=positive_int, default=16 << 20)
    ap.add_argument("--plan-voxels", type=positive_int, default=200_000, help="voxels per rank")
    ap.add_argument("--trials", type=positive_int, default=15,
                    help="interleaved trials per message size")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from launch.run import abort_on_exception

    abort_on_exception()
    comm = MPI.COMM_WORLD
    sizes = _sizes(max(args.min_bytes, FACE * FACE * 4), args.max_bytes)
    result: dict[str, Any] = {"env": environment(comm), "messages": []}
    if comm.size >= 2:
        result["messages"] = messages(comm, sizes, args.quick, 3 if args.quick else args.trials)
    elif comm.rank == 0:
        print("one rank: no ping-pong or exchange (run under mpirun -n 2 or more)")
    result["plan"] = plan_build(comm, args.plan_voxels, args.quick)
    if comm.rank == 0:
        result["load_balance"] = load_balance(args.quick)
        _report(result)
        write_json(args.json, result)
