"""Pipeline benchmark: measured bubble, 1F1B versus GPipe, pipeline versus data and spatial.

    mpirun -n 2 python -m sparsepipe_hpc.bench pipeline --json pipeline.json

Two ranks, one global batch of ``--batch`` synthetic rooms (U-Net width 16 depth 3 by default),
float32, one thread per rank, a full training step each time (input split, forward, backward,
gradient all-reduce, SGD step). Variants, run alternately (the order rotates every repeat, so
drifts in the machine's load hit them alike), medians over ``--repeats``:

  pipe-{gpipe,1f1b}-m{1,2,4,8}   2 stages (``--balance``, default: of every two-stage split, the
                                 one whose stages' measured forward+backward times are most
                                 equal), m whole-sample micro-batches
  data                           2 replicas of the whole model, half the batch each
  spatial                        one replica on a 2 x 1 x 1 grid (halo exchange)

Figures, per variant: step time (slowest rank) and samples/s; per rank, the peak bytes of
activations saved for backward (:class:`~sparsepipe_hpc.bench._activations.SavedTensorMeter`:
exact and free of allocator noise; RSS and tracemalloc cannot measure this, see there). Pipelines
also: the **measured bubble** from the executor's own trace spans (sparsepipe_hpc.tracing, what
``--trace`` writes): 1 - (time in forward or backward or rebuilding received kernel maps, summed
over ranks) / (ranks x window), the window running from the first pipeline action on any rank to the last backward on any rank (the
optimizer step after it is not pipeline time); beside it the theory (S-1)/(m+S-1), which assumes
equal stages and free communication, and the simulated bubble of the same schedule with the
measured mean forward/backward times of each stage (:func:`sparsepipe_hpc.pipeline.simulate`),
which accounts for unequal stages but not for communication (stage forward time there includes
the kernel maps a stage rebuilds from the coordinates it receives; ``bubble_model_only`` counts
that rebuilding as idle instead). On a machine with fewer cores than ranks, or shared with other
work, the time figures measure the machine as much as the method.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sparsepipe_hpc.bench._activations import SavedTensorMeter
from sparsepipe_hpc.bench.common import environment, rotated, write_json
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.tracing import Recorder, Span, recording
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "make_batch", "bubble_from_spans"]

PIPE_CATS = ("forward", "backward", "send", "recv")  # the executor's action spans (not step)


def make_batch(samples: int, voxel_size: float = 0.05, points: int = 40_000,
               room: float = 3.5, seed: int = 0, multiple: int = 16) -> SparseTensor:
    """``samples`` furnished rooms of about ``room`` x ``room`` x 2.5 m, ``points`` points each,
    voxelized against one origin and grid (a side of ``multiple`` voxels' multiples)."""
    from sparsepipe_hpc.data.synth import make_room
    from sparsepipe_hpc.voxelize import voxelize

    side = int(np.ceil((room * 1.1 + 1.0) / voxel_size / multiple) * multiple)
    origin, shape = [-0.5, -0.5, -0.5], (side, side, side)
    vox = []
    for k in range(samples):
        xyz, rgb, _ = make_room(np.random.default_rng(seed + k), size=(room, room, 2.5),
                                points=(points, points))
        vox.append(voxelize(xyz, rgb.astype(np.float32) / 255.0, voxel_size, origin, shape))
    return SparseTensor.from_voxels(vox, shape)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def bubble_from_spans(rows: Sequence[Sequence[Span]]) -> dict[str, Any]:
    """Measured bubble of one pipelined step from every rank's spans (``rows[r]``: rank r's).

    Busy = time inside forward or backward spans or rebuilding a received carry's kernel maps
    (``kmap`` spans: the next stage's share of the forward's work), their union so nested spans
    count once; window = first pipeline action (forward, backward, send, recv) on any rank to the
    last forward/backward end on any rank; bubble = 1 - sum(busy) / (ranks x window): time spent
    waiting for messages, sending, or between actions (``bubble_model_only`` counts the rebuilds
    as idle too). Also, per rank, the mean forward and backward span (for
    :func:`~sparsepipe_hpc.pipeline.simulate`) and the seconds in receive actions (waiting and
    rebuilding), send actions and kernel-map rebuilding.
    """
    starts = [s.start for row in rows for s in row if s.cat in PIPE_CATS]
    ends = [s.end for row in rows for s in row if s.cat in ("forward", "backward")]
    if not starts or not ends:
        raise ValueError("no forward/backward spans: was the step recorded?")
    window = max(ends) - min(starts)
    busy = [_union([(s.start, s.end) for s in row if s.cat in ("forward", "backward", "kmap")])
            for row in rows]

    def mean(row: Sequence[Span], cat: str) -> float:
        d = [s.end - s.start for s in row if s.cat == cat]
        return sum(d) / len(d) if d else 0.0

    model = [_union([(s.start, s.end) for s in row if s.cat in ("forward", "backward")])
             for row in rows]
    return {"window_s": window, "busy_s": busy,
            "bubble": 1.0 - sum(busy) / (len(rows) * window) if window > 0 else 0.0,
            "bubble_model_only": 1.0 - sum(model) / (len(rows) * window) if window > 0 else 0.0,
            "fwd_mean_s": [mean(r, "forward") for r in rows],
            "bwd_mean_s": [mean(r, "backward") for r in rows],
            **{f"{cat}_s": [_union([(s.start, s.end) for s in r if s.cat == cat]) for r in rows]
               for cat in ("recv", "send", "kmap")}}


def _loss(out: Any, total: int) -> torch.Tensor:
    feats = out.feats if isinstance(out, SparseTensor) else out
    return feats.square().sum() / total


class _Variant:
    """One configuration on this rank: a model, its step and what it measures."""

    def __init__(self, name: str, params: list[torch.nn.Parameter],
                 step: Callable[[], None], pipe: Any = None):
        self.name, self.step, self.pipe = name, step, pipe
        self.meter = SavedTensorMeter(exclude=params)
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.bubbles: list[dict[str, Any]] = []


def _build(args: argparse.Namespace, x: SparseTensor, balance: tuple[int, int]) -> list[_Variant]:
    """Every variant on this rank (collective: contexts and pipelines are built on all ranks)."""
    from mpi4py import MPI

    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout
    from sparsepipe_hpc.pipeline.executor import split_batch
    from sparsepipe_hpc.pipeline.runner import Pipeline

    world = MPI.COMM_WORLD
    total, align = x.num_voxels, 2 ** args.depth

    def model() -> Any:
        torch.manual_seed(0)
        return SparseUNet(x.num_channels, 8, width=args.width, depth=args.depth)

    out: list[_Variant] = []
    for kind in args.schedules:
        for m in args.micro_batches:
            net = model()
            ctx = ParallelContext(world, RankLayout(1, 2, (1, 1, 1)))
            pipe = Pipeline(net, ctx, balance, kind, m)
            params = list(pipe.parameters())
            opt = torch.optim.SGD(params, lr=1e-4)

            def step(pipe=pipe, ctx=ctx, opt=opt, params=params, m=m) -> None:
                local = [ctx.distribute(p[0], align=align)[0] for p in split_batch(x, m)]
                opt.zero_grad(set_to_none=True)
                pipe.run(local, [t.context for t in local], lambda i, o: _loss(o, total),
                         step=lambda: (ctx.allreduce_gradients(params), opt.step()))
            out.append(_Variant(f"pipe-{kind}-m{m}", list(net.parameters()), step, pipe))
    if "data" in args.compare:
        net = model()
        ctx = ParallelContext(world, RankLayout(2, 1, (1, 1, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        mine = split_batch(x, 2)[world.rank][0]

        def data_step(net=net, ctx=ctx, opt=opt, mine=mine) -> None:
            (xl,) = ctx.distribute(mine.replace(kmaps={}), align=align)  # maps built, as above
            opt.zero_grad(set_to_none=True)
            _loss(net(xl), total).backward()
            ctx.allreduce_gradients(net)
            opt.step()
        out.append(_Variant("data", list(net.parameters()), data_step))
    if "spatial" in args.compare:
        net = model()
        ctx = ParallelContext(world, RankLayout(1, 1, (2, 1, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def spatial_step(net=net, ctx=ctx, opt=opt) -> None:
            (xl,) = ctx.distribute(x.replace(kmaps={}), align=align)
            opt.zero_grad(set_to_none=True)
            _loss(net(xl), total).backward()
            ctx.allreduce_gradients(net)
            opt.step()
        out.append(_Variant("spatial", list(net.parameters()), spatial_step))
    return out


def _measure_balances(x: SparseTensor, args: argparse.Namespace,
                      repeats: int = 2) -> dict[tuple[int, int], list[float]]:
    """Per two-stage balance, each stage's forward+backward seconds in a GPipe step at the
    largest m (the fastest of ``repeats`` steps; from the executor's spans). Collective."""
    from mpi4py import MPI

    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout
    from sparsepipe_hpc.pipeline.executor import split_batch
    from sparsepipe_hpc.pipeline.runner import Pipeline

    world, m = MPI.COMM_WORLD, max(args.micro_batches)
    torch.manual_seed(0)
    net = SparseUNet(x.num_channels, 8, width=args.width, depth=args.depth)
    ctx = ParallelContext(world, RankLayout(1, 2, (1, 1, 1)))
    out = {}
    for k in range(1, len(net.blocks)):
        pipe = Pipeline(net, ctx, (k, len(net.blocks) - k), "gpipe", m)
        best: list[float] = []
        for _ in range(repeats):
            local = [ctx.distribute(p[0], align=2 ** args.depth)[0] for p in split_batch(x, m)]
            rec = Recorder.start(world)
            with recording(rec):
                pipe.run(local, [t.context for t in local], lambda i, o: _loss(o, x.num_voxels))
            busy = bubble_from_spans(world.allgather(rec.spans))["busy_s"]
            best = busy if not best else [min(a, b) for a, b in zip(best, busy)]
        out[(k, len(net.blocks) - k)] = best
    return out


def _summary(v: _Variant, batch: int, world_size: int) -> dict[str, Any]:
    from sparsepipe_hpc.pipeline import bubble_fraction, simulate, theoretical_bubble

    t = statistics.median(v.times)
    row: dict[str, Any] = {"step_s": t, "step_s_all": v.times, "samples_per_s": batch / t,
                           "peak_saved_bytes_per_rank": v.peaks}
    if v.pipe is not None:
        sched = v.pipe.schedule
        measured = [b["bubble"] for b in v.bubbles]
        # A stage's forward work per micro-batch includes rebuilding the kernel maps it received.
        fwd = [statistics.median(b["fwd_mean_s"][r] + b["kmap_s"][r] / sched.micro_batches
                                 for b in v.bubbles) for r in range(world_size)]
        bwd = [statistics.median(b["bwd_mean_s"][r] for b in v.bubbles) for r in range(world_size)]
        theory = theoretical_bubble(sched.stages, sched.micro_batches)
        bubble = statistics.median(measured)
        row.update({"schedule": sched.kind, "micro_batches": sched.micro_batches,
                    "bubble_measured": bubble, "bubble_measured_all": measured,
                    "bubble_model_only": statistics.median(b["bubble_model_only"]
                                                           for b in v.bubbles),
                    "bubble_theory": theory, "bubble_over_theory": bubble / theory,
                    "bubble_simulated": bubble_fraction(simulate(sched, fwd, bwd)),
                    "stage_fwd_s": fwd, "stage_bwd_s": bwd,
                    **{f"stage_{c}_s": [statistics.median(b[f"{c}_s"][r] for b in v.bubbles)
                                        for r in range(world_size)]
                       for c in ("recv", "send", "kmap")}})
    return row


def main(argv: list[str]) -> None:
    from mpi4py import MPI

    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench pipeline")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--batch", type=positive_int, default=8, help="global batch (samples)")
    p.add_argument("--points", type=positive_int, default=40_000, help="points per room")
    p.add_argument("--room", type=float, default=3.5, help="room side (m)")
    p.add_argument("--voxel-size", type=float, default=0.05)
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--depth", type=positive_int, default=3)
    p.add_argument("--balance", help="blocks per stage, e.g. 4,4 (default: the split whose "
                   "stages' measured forward+backward times are most equal)")
    p.add_argument("--micro-batches", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["gpipe", "1f1b"])
    p.add_argument("--compare", nargs="*", choices=["data", "spatial"], default=["data", "spatial"])
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit(f"pipeline benchmark: runs on exactly 2 ranks (2 stages, 2 replicas, a "
                         f"2x1x1 grid); got {world.size}: use mpirun -n 2")
    if max(args.micro_batches) > args.batch:
        raise SystemExit(f"--micro-batches {max(args.micro_batches)} needs --batch >= that "
                         f"(micro-batches are whole samples); got --batch {args.batch}")
    torch.set_num_threads(1)
    say = print if world.rank == 0 else (lambda *a, **k: None)
    t_start = time.perf_counter()
    x = make_batch(args.batch, args.voxel_size, args.points, args.room)
    say(f"batch {args.batch} rooms, {x.num_voxels} voxels ({x.spatial_shape}); U-Net width "
        f"{args.width} depth {args.depth}")
    tried: dict[tuple[int, int], list[float]] = {}
    if args.balance:
        try:
            a, b = (int(n) for n in args.balance.split(","))
        except ValueError:
            p.error(f"--balance {args.balance}: give two block counts, e.g. 4,4")
        balance = (a, b)
    else:
        tried = _measure_balances(x, args)
        balance = min(tried, key=lambda b: max(tried[b]))
        say("stage busy s per balance (GPipe, m=%d): " % max(args.micro_batches)
            + "; ".join(f"{b[0]},{b[1]}: {t[0]:.3f}/{t[1]:.3f}" for b, t in tried.items())
            + f" -> balance {balance[0]},{balance[1]}")
    variants = _build(args, x, balance)
    for r in range(args.repeats + 1):  # repeat 0 warms up (first kernel maps, allocator)
        for v in rotated(variants, r):
            world.Barrier()
            rec = Recorder.start(world)
            v.meter.reset_peak()
            t = time.perf_counter()
            with recording(rec), v.meter:
                v.step()
            dt = world.allreduce(time.perf_counter() - t, op=MPI.MAX)
            peaks = world.allgather(v.meter.peak_bytes)
            rows = world.allgather(rec.spans) if v.pipe is not None else None
            if r == 0:
                continue
            v.times.append(dt)
            # Per rank, the largest peak over the repeats (the same every repeat: same data).
            v.peaks = peaks if not v.peaks else [max(a, b) for a, b in zip(v.peaks, peaks)]
            if rows is not None:
                v.bubbles.append(bubble_from_spans(rows))
    result: dict[str, Any] = {
        "benchmark": "pipeline", "ranks": world.size, "batch": args.batch,
        "voxels": x.num_voxels, "spatial_shape": list(x.spatial_shape), "width": args.width,
        "depth": args.depth, "balance": list(balance),
        "balance_busy_s": {f"{b[0]},{b[1]}": t for b, t in tried.items()},
        "repeats": args.repeats, "env": environment(world),
        "variants": {v.name: _summary(v, args.batch, world.size) for v in variants}}
    result["targets"] = _targets(result["variants"])
    result["wall_s"] = time.perf_counter() - t_start
    _print(result, say)
    if world.rank == 0:
        write_json(args.json, result)


def _targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, where this run measured what they need."""
    out: dict[str, Any] = {}
    for kind in ("gpipe", "1f1b"):
        row = rows.get(f"pipe-{kind}-m8")
        if row is not None:
            out[f"bubble_within_15pct_of_theory_m8_{kind}"] = \
                abs(row["bubble_over_theory"] - 1.0) <= 0.15
    peaks: dict[str, Optional[bool]] = {}
    for name, row in rows.items():
        if name.startswith("pipe-1f1b-m"):
            m = row["micro_batches"]
            g = rows.get(f"pipe-gpipe-m{m}")
            if m >= 4 and g is not None:
                peaks[f"m{m}"] = all(a < b for a, b in zip(row["peak_saved_bytes_per_rank"],
                                                           g["peak_saved_bytes_per_rank"]))
    if peaks:
        out["1f1b_peak_below_gpipe_every_stage"] = peaks
    return out


def _print(result: dict[str, Any], say: Callable[..., None]) -> None:
    mib = 2.0 ** 20
    say(f"{'variant':16s} {'step s':>7s} {'samples/s':>9s}  peak saved MiB per rank   bubble "
        f"measured / theory / simulated (measured/theory; kmap rebuilds as idle)")
    for name, row in result["variants"].items():
        peaks = ", ".join(f"{b / mib:6.1f}" for b in row["peak_saved_bytes_per_rank"])
        line = f"{name:16s} {row['step_s']:7.3f} {row['samples_per_s']:9.2f}  [{peaks}]"
        if "bubble_measured" in row:
            line += (f"      {row['bubble_measured']:.3f} / {row['bubble_theory']:.3f} / "
                     f"{row['bubble_simulated']:.3f} (x{row['bubble_over_theory']:.2f}; "
                     f"{row['bubble_model_only']:.3f})")
        say(line)
    say(f"targets: {result['targets']}")
