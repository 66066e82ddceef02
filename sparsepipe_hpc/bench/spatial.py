"""Spatial-parallelism benchmark: overhead, strong scaling, overlap, halo volume, dense vs sparse.

    mpirun -n 2 python -m sparsepipe_hpc.bench spatial --json spatial.json

All on one synthetic room (~160k voxels of 3 cm), U-Net width 16 depth 4, forward+backward
including kernel-map and halo-plan building (a training step builds them for every batch), one
thread per rank. Each comparison is a ratio of two figures measured in this run:

  overhead      rank 0 alone: distributed U-Net on a 1x1x1 grid (split maps, empty exchanges)
                over the plain serial U-Net.
  scaling       the serial U-Net on rank 0 alone (the others asleep, not spinning in a barrier)
                over the distributed one on all ranks (grid n x 1 x 1), in alternated rounds:
                the strong-scaling speed-up, the median of the rounds' ratios.
  overlap       time blocked waiting for halo exchanges ("exposed"), with and without overlap,
                on the real transport and with an injected per-message delay.
  halo volume   halo voxels / owned voxels per box, uniform versus balanced cuts, for several
                grids (the boxes' geometry on rank 0; the plans' halos equal it, see tests).
  dense         rank 0: sparse versus dense U-Net at 64^3, 96^3, 128^3 (see bench.dense).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from sparsepipe_hpc.bench.common import (environment, paired_ratios, rotated, synthetic_room,
                                         time_alternating, write_json)
from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.bench._args import positive_int


def step_fn(net, x, ctx=None, align=16):
    """One forward+backward from the full batch, kernel maps and cuts included."""

    def step() -> None:
        net.zero_grad()
        xi = x.replace(kmaps={})
        if ctx is not None:
            xi, = ctx.distribute(xi, align=align)
        y = net(xi)
        (y.feats.square().sum() / max(1, len(x.coords))).backward()
    return step


def delayed_halos(seconds: float):
    """A spatial group's transport (from its communicator) that holds each halo exchange back
    ``seconds`` from its start; plan builds, which block, are not delayed."""
    from halo.exchange import EXCHANGE_TAG
    from halo.transport.delay import DelayedTransport
    from halo.transport.mpi import MPITransport

    return lambda comm: DelayedTransport(MPITransport(comm), seconds,
                                         tags=(EXCHANGE_TAG, EXCHANGE_TAG + 1))


HALO_GRIDS = [(2, 1, 1), (4, 1, 1), (8, 1, 1), (2, 2, 1), (2, 2, 2), (4, 2, 2)]


def halo_volume(x, dims, mode: str, align: int, radius: int = 1) -> dict:
    """Owned and halo voxels (within ``radius`` of the box, not in it) of every box of ``dims``."""
    import itertools

    from halo.cuts import balanced_cuts, uniform_cuts

    extent = list(x.spatial_shape)
    xyz = x.coords[:, 1:].long()
    cuts = (balanced_cuts(MPI.COMM_SELF, xyz, extent, dims, align=align) if mode == "balanced"
            else uniform_cuts(extent, dims, align=align))
    owned, halo = [], []
    for g in itertools.product(*(range(d) for d in dims)):
        lo, hi = (torch.as_tensor(v, dtype=torch.int64) for v in cuts.box(g))
        inside = ((xyz >= lo) & (xyz < hi)).all(1)
        near = ((xyz >= lo - radius) & (xyz < hi + radius)).all(1)
        owned.append(int(inside.sum()))
        halo.append(int((near & ~inside).sum()))
    ratios = [h / max(o, 1) for o, h in zip(owned, halo)]
    return {"owned": owned, "halo": halo, "max_halo_over_owned": max(ratios),
            "total_halo_over_owned": sum(halo) / sum(owned),
            "owned_max_over_mean": max(owned) / (sum(owned) / len(owned))}


def quiet_barrier(comm) -> None:
    """A barrier whose waiting ranks sleep between polls: MPI's own spins a core, which on a
    shared node slows the rank that is being timed alone (rank 0's serial step ran 2x slower
    beside a rank spinning in ``Barrier`` on this project's 2-core machine)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench spatial")
    p.add_argument("--json")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--depth", type=positive_int, default=4)
    p.add_argument("--delay-ms", type=float, default=20.0, help="injected per-exchange delay")
    p.add_argument("--dense-sizes", type=positive_int, nargs="*", default=[64, 96, 128])
    p.add_argument("--dense-limit", type=float, default=300.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    x = synthetic_room()
    align = 2 ** args.depth
    say(f"room: {x.num_voxels} voxels, grid {x.spatial_shape}; {n} rank(s), U-Net width "
        f"{args.width} depth {args.depth}")
    result: dict = {"voxels": x.num_voxels, "ranks": n, "env": environment(world),
                    "width": args.width, "depth": args.depth}

    def unet():
        torch.manual_seed(0)
        return SparseUNet(x.num_channels, 8, width=args.width, depth=args.depth)

    # 1. serial and 1-rank distributed, on rank 0 alone
    if rank == 0:
        ctx1 = ParallelContext(MPI.COMM_SELF, RankLayout(1, 1, (1, 1, 1)), force_spatial=True)
        t = time_alternating({"serial": step_fn(unet(), x),
                              "distributed": step_fn(unet(), x, ctx1, align)},
                             torch.device("cpu"), args.repeats)
        serial, dist1 = t["serial"], t["distributed"]
        result["overhead_1rank"] = {"serial_s": serial["median_s"],
                                    "distributed_s": dist1["median_s"],
                                    "ratio": paired_ratios(t, "distributed", "serial")}
        say(f"overhead at 1 rank: serial {serial['median_s']:.2f} s, distributed "
            f"{dist1['median_s']:.2f} s, ratio {result['overhead_1rank']['ratio']['median']:.3f}")
        ctx1.close()
    quiet_barrier(world)

    # 2. strong scaling and 3. overlap, all ranks on an n x 1 x 1 grid
    if n > 1:
        result.update(scaling_and_overlap(world, unet, x, align, args, say))
    quiet_barrier(world)

    # 4. halo volume for several grids (geometry only: what each box's plan would receive)
    if rank == 0:
        result["halo_volume"] = {}
        for dims in HALO_GRIDS:
            row = {mode: halo_volume(x, dims, mode, align) for mode in ("uniform", "balanced")}
            result["halo_volume"]["x".join(map(str, dims))] = row
            say(f"grid {'x'.join(map(str, dims)):6s} halo/owned max "
                + ", ".join(f"{m} {r['max_halo_over_owned']:.3f}" for m, r in row.items())
                + "; owned max/mean "
                + ", ".join(f"{m} {r['owned_max_over_mean']:.2f}" for m, r in row.items()))

    # 5. sparse versus dense, rank 0 (child processes)
    if rank == 0 and args.dense_sizes:
        from sparsepipe_hpc.bench import dense

        say("sparse versus dense U-Net (one thread, forward+backward):")
        result["dense_vs_sparse"] = dense.run(args.dense_sizes, args.width, args.dense_limit)
    quiet_barrier(world)
    if rank == 0:
        write_json(args.json, result)


def scaling_and_overlap(world, unet, x, align: int, args, say) -> dict:
    """Sections 2 and 3, in alternated rounds (the order rotating): the serial step on rank 0
    alone (the other ranks sleeping in :func:`quiet_barrier`) and the n-rank step with and
    without overlap, with and without the injected delay. Every step time is the slowest rank's;
    the exposed wait is the slowest rank's own per step; figures are medians over the rounds,
    the speed-up the median of the rounds' serial / n-rank ratios."""
    n = world.Get_size()
    serial = step_fn(unet(), x)
    contexts, steps = [], {}
    for overlap in (True, False):
        for delay in (0.0, args.delay_ms / 1e3):
            transport = delayed_halos(delay) if delay else None
            ctx = ParallelContext(world, RankLayout(1, 1, (n, 1, 1)), overlap=overlap,
                                  transport=transport)
            contexts.append(ctx)
            key = f"{'overlap' if overlap else 'no_overlap'}_delay{delay * 1e3:g}ms"
            steps[key] = (ctx, step_fn(unet(), x, ctx, align))
    names = ["serial", *steps]
    times: dict[str, list[float]] = {k: [] for k in names}
    waits: dict[str, list[float]] = {k: [] for k in steps}

    def run(name: str) -> tuple[float, float]:
        if name == "serial":
            t = 0.0
            if world.Get_rank() == 0:
                t0 = time.perf_counter()
                serial()
                t = time.perf_counter() - t0
            quiet_barrier(world)
            return t, 0.0
        ctx, fn = steps[name]
        world.Barrier()
        waited = ctx.group.exposed_wait_s
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        mine = ctx.group.exposed_wait_s - waited
        return world.allreduce(t, op=MPI.MAX), world.allreduce(mine, op=MPI.MAX)

    for name in names:  # warm-up
        run(name)
    for r in range(args.repeats):
        for name in rotated(names, r):
            t, waited = run(name)
            times[name].append(t)
            if name in waits:
                waits[name].append(waited)
    out: dict = {"overlap": {}}
    ov = out["overlap"]
    for key in steps:
        ov[key] = {"step_s": statistics.median(times[key]), "all_s": times[key],
                   "exposed_wait_s": statistics.median(waits[key])}
        say(f"grid {n}x1x1 {key:24s} step {ov[key]['step_s']:.2f} s, exposed wait "
            f"{ov[key]['exposed_wait_s'] * 1e3:8.1f} ms")
    for d in ("0", f"{args.delay_ms:g}"):
        on, off = ov[f"overlap_delay{d}ms"], ov[f"no_overlap_delay{d}ms"]
        hidden = 1 - on["exposed_wait_s"] / off["exposed_wait_s"] \
            if off["exposed_wait_s"] > 0 else None  # nothing waited: nothing to hide
        ov[f"hidden_fraction_delay{d}ms"] = hidden
        say(f"overlap hides {'n/a' if hidden is None else f'{100 * hidden:.0f}%'} of the exposed "
            f"exchange time (delay {d} ms)")
    if world.Get_rank() == 0:
        t1, tn = statistics.median(times["serial"]), statistics.median(times["overlap_delay0ms"])
        up = paired_ratios({k: {"all_s": v} for k, v in times.items()}, "serial",
                           "overlap_delay0ms")
        out["scaling"] = {"serial_1rank_s": t1, f"distributed_{n}ranks_s": tn,
                          "speedup": up["median"], "speedup_min": up["min"],
                          "speedup_max": up["max"]}
        say(f"strong scaling: 1 rank {t1:.2f} s, {n} ranks {tn:.2f} s, speed-up "
            f"{up['median']:.2f} (paired by round: {up['min']:.2f}-{up['max']:.2f})")
    for ctx in contexts:
        ctx.close()
    return out
