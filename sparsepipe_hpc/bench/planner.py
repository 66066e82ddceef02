"""Planner validation: predicted versus measured step time, and a slowed rank's balanced partition.

    python -m sparsepipe_hpc.bench planner --json planner.json       # starts mpirun itself
    python -m sparsepipe_hpc.bench planner --steps 4 --slow-factor 2

1. The model of the trainer's default run (seg U-Net, width 16, depth 3, global batch 4) is
   profiled in this process, one thread, on the first training samples of the default data
   (:func:`~sparsepipe_hpc.plan.profile.profile_model`, batches of 1, 2 and 4 samples), and the
   links are measured by
   ``mpirun -n 2 python -m sparsepipe_hpc.plan --measure-machine``.
2. For every plan in :data:`PLANS` (1-4 ranks: data, spatial, pipeline, micro-batches and mixes)
   ``mpirun -n N`` runs the trainer's own step (:meth:`Trainer.train_step`) on a fixed batch
   (voxelized once, outside the timing: the planner does not model input; its kernel maps dropped
   before every step, so each step builds them as a real one does), ``--warmup`` + ``--steps``
   times between barriers; the measured step is the median. The prediction is
   :func:`~sparsepipe_hpc.plan.search.evaluate` of the same layout, told what the batch holds
   (from its coordinates, nothing timed; :func:`_inputs`): voxels per sample of the fullest
   replica (replicas wait for each other), and the box imbalance of the trainer's balanced cuts
   on the plan's grid for the worst micro-batch (:func:`~sparsepipe_hpc.plan.split.box_imbalance`).
   ``predicted_mean_s`` is the same prediction from the batch's mean voxels per sample and
   perfectly balanced boxes, as a user who knows only the mean would get.
   The machine model knows this machine's cores (``cores_per_node``): CPU ranks beyond them share
   them, and ranks idle in a pipeline bubble leave theirs to the busy ones
   (:meth:`~sparsepipe_hpc.plan.machine.Machine.core_share`).
3. Heterogeneous devices: 2 ranks, 2 stages, 4 micro-batches, rank 1 slowed by ``--slow-factor``
   (every forward and backward of its stage sleeps ``(f - 1)`` times its own duration: a device
   ``f`` times slower). The planner's partition for speeds ``(1, 1/f)`` against the even one,
   measured and predicted.
4. Stage order: rank 0 slowed by ``--order-slow-factor`` (default 3), so the launch's order puts
   the first, high-resolution blocks on the slow device. The planner's plan (its stage order and
   partition: :func:`~sparsepipe_hpc.plan.search.stage_orders`) against the best partition in
   the launch's order, measured (the trainer's ``--stage-order``) and predicted.

Reported: per plan predicted and measured seconds and the error; median absolute error; whether
the measured-fastest plan is predicted first, and how much slower the predicted-first plan
measured (``pick_vs_fastest``); even / balanced speed-up measured and predicted. Each plan is one
``mpirun`` after another (a median of its steps), not alternated with the others: figures measure
this machine, and on 2 shared cores they are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from sparsepipe_hpc.bench._args import nonneg_int, positive_int, sections as parse_sections

__all__ = ["main", "PLANS"]

#: (replicas, stages, grid, micro-batches): ranks 1-4, every kind of parallelism.
PLANS: list[tuple[int, int, tuple[int, int, int], int]] = [
    (1, 1, (1, 1, 1), 1), (1, 1, (1, 1, 1), 2),
    (2, 1, (1, 1, 1), 1), (1, 1, (2, 1, 1), 1), (1, 2, (1, 1, 1), 2), (1, 2, (1, 1, 1), 4),
    (4, 1, (1, 1, 1), 1), (2, 1, (2, 1, 1), 1), (2, 2, (1, 1, 1), 2), (1, 1, (2, 2, 1), 1),
]
BATCH = 4


def _child_env() -> dict[str, str]:
    from launch.env import prefer_shared_memory
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prefer_shared_memory(env)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _mpirun(n: int, args: list[str], timeout: float = 280) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    proc = subprocess.run(cmd + [sys.executable, *args], env=_child_env(), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return proc


def _slow_down(trainer: Any, factor: float) -> None:
    """Make this rank's stage ``factor`` times slower: sleep after each block forward and after
    each stage backward for ``(factor - 1)`` times what it took."""
    import types

    def slowed(fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            time.sleep((factor - 1) * (time.perf_counter() - t0))
            return out
        return run

    for blk in trainer.model.blocks:
        blk.forward = slowed(blk.forward)
    ex = trainer.pipe.executor
    ex._backward = types.MethodType(slowed(type(ex)._backward), ex)


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    from sparsepipe_hpc.train.config import parse_config
    from sparsepipe_hpc.train.loop import Trainer

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    argv = ["--steps", "1000", "--no-progress", "--checkpoint-every", "0", "--out", args.out,
            "--batch-size", str(BATCH), "--replicas", str(args.replicas), "--grid", args.grid,
            "--stages", str(args.stages), "--micro-batches", str(args.micro_batches)]
    if args.balance:
        argv += ["--balance", args.balance]
    if args.stage_order:
        argv += ["--stage-order", args.stage_order]
    trainer = Trainer(parse_config(argv), comm, log=None)
    if args.slow_factor > 1 and comm.Get_rank() == args.slow_rank:  # a process (a device)
        _slow_down(trainer, args.slow_factor)
    indices = trainer.batches.shard(list(range(BATCH)))
    batch = trainer._batch(trainer.train_set, indices, None)   # once, outside the timing
    # Every step gets the batch with no kernel maps, as a new batch would: a cached map would
    # leave out the map building that every real step does.
    trainer._batch = lambda *a, **k: dataclasses.replace(  # type: ignore[method-assign]
        batch, x=batch.x.replace(kmaps={}))
    times = []
    for _ in range(args.warmup + args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.train_step(indices, 0)
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    trainer.close()
    if comm.Get_rank() == 0:
        Path(args.result).write_text(json.dumps({"times": times[args.warmup:],
                                                 "median": statistics.median(times[args.warmup:])}))


def _measure(n: int, plan: tuple[int, int, tuple[int, int, int], int], balance: Optional[str],
             args: argparse.Namespace, tmp: Path, slow: float = 1.0, slow_rank: int = 1,
             order: Optional[str] = None) -> dict[str, Any]:
    R, S, g, m = plan
    out = tmp / (f"r{R}s{S}g{''.join(map(str, g))}m{m}{balance or ''}{slow}-{slow_rank}"
                 f"{order or ''}.json")
    cmd = ["-m", "sparsepipe_hpc.bench.planner", "--worker", "--replicas", str(R), "--stages",
           str(S), "--grid", ",".join(map(str, g)), "--micro-batches", str(m), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--result", str(out), "--out",
           str(tmp / "run"), "--slow-factor", str(slow), "--slow-rank", str(slow_rank)]
    if balance:
        cmd += ["--balance", balance]
    if order:
        cmd += ["--stage-order", order]
    _mpirun(n, cmd)
    return json.loads(out.read_text())


def _inputs(coords: Any, shape: Any, plan: tuple[int, int, tuple[int, int, int], int],
            align: int) -> tuple[float, float]:
    """(voxels per sample, imbalance) the plan's busiest rank sees in the fixed batch.

    Replica ``r`` takes its shard of each of the ``m`` global micro-batches, as the trainer's
    ``ShardedBatches(micro_batches=m)`` deals them (:func:`replica_micro_bounds`); each
    micro-batch is cut into boxes on its own.
    """
    from sparsepipe_hpc.data.sharding import replica_micro_bounds
    from sparsepipe_hpc.plan.split import box_imbalance

    R, _, g, m = plan
    b = coords[:, 0]
    vps, imb = 0.0, 1.0
    for ranges in replica_micro_bounds(BATCH, R, m):
        parts = [(b >= lo) & (b < hi) for lo, hi in ranges]
        samples = sum(hi - lo for lo, hi in ranges)
        vps = max(vps, sum(int(p.sum()) for p in parts) / samples)
        if any(x > 1 for x in g):
            imb = max([imb] + [box_imbalance(coords[p], shape, g, align) for p in parts])
    return vps, imb


def _profile(repeats: int) -> tuple[Any, Any, float, Any]:
    import torch

    from sparsepipe_hpc.data import SceneDataset, collate, default_data, grid_for
    from sparsepipe_hpc.nn import build_model
    from sparsepipe_hpc.plan.profile import profile_model

    torch.set_num_threads(1)
    data_dir = default_data("seg")
    train, val = SceneDataset(data_dir, "train"), SceneDataset(data_dir, "val")
    torch.manual_seed(0)
    model = build_model("unet", train.in_channels, train.num_classes, width=16, depth=3)
    origin, shape = grid_for([train, val], 0.05, multiple=model.total_stride)
    # Batches of 1, 2 and 4 of the samples the trainer runs: the sizes its micro-batches have.
    batches = [collate([train[i] for i in range(k)], 0.05, origin, shape).x for k in (1, 2, 4)]
    vps = batches[-1].num_voxels / BATCH
    prof = profile_model(model, batches, repeats=repeats, name="unet")
    return prof, shape, vps, batches[-1].coords


def _stage_order_part(prof: Any, machine: Any, args: argparse.Namespace, tmp: Path,
                      vps: float, shape: Any) -> dict[str, Any]:
    """Part 4 of the module: the planner's stage order against the launch's, rank 0 slowed."""
    from sparsepipe_hpc.plan.search import evaluate, search

    f = args.order_slow_factor
    het = machine(2, [1.0 / f, 1.0])
    best = search(prof, het, BATCH, fixed={"stages": 2, "micro_batches": 4, "replicas": 1},
                  voxels_per_sample=vps, extent=shape).plans[0]
    launch = evaluate(prof, het, 1, 2, (1, 1, 1), 4, BATCH, voxels_per_sample=vps,
                      extent=shape, stage_order=(0, 1))
    row: dict[str, Any] = {"slow_factor": f, "slow_rank": 0,
                           "planned_order": list(best.stage_order),
                           "planned_balance": list(best.balance),
                           "launch_balance": list(launch.balance),
                           "predicted_launch_s": launch.step_time,
                           "predicted_planned_s": best.step_time}
    if not best.moves_stages:
        print(f"slow rank 0 x{f}: the planner keeps the launch's stage order (nothing to measure)")
        return row
    order = ",".join(map(str, best.stage_order))
    runs: dict[str, list[float]] = {"launch": [], "planned": []}
    for _ in range(2):  # alternated: this machine drifts between runs
        runs["launch"].append(_measure(2, PIPELINE, ",".join(map(str, launch.balance)), args,
                                       tmp, slow=f, slow_rank=0)["median"])
        runs["planned"].append(_measure(2, PIPELINE, ",".join(map(str, best.balance)), args,
                                        tmp, slow=f, slow_rank=0, order=order)["median"])
    row.update(measured_launch_s=statistics.median(runs["launch"]),
               measured_planned_s=statistics.median(runs["planned"]), measured_all_s=runs)
    row.update(measured_speedup=row["measured_launch_s"] / row["measured_planned_s"],
               predicted_speedup=launch.step_time / best.step_time)
    print(f"slow rank 0 x{f}: stage order {order} balance "
          f"{','.join(map(str, best.balance))} vs the launch's order balance "
          f"{','.join(map(str, launch.balance))}: measured {row['measured_launch_s']:.3f} -> "
          f"{row['measured_planned_s']:.3f} s (x{row['measured_speedup']:.2f}), predicted "
          f"x{row['predicted_speedup']:.2f}", flush=True)
    return row


def _plans_part(prof: Any, machine: Any, args: argparse.Namespace, tmp: Path, vps: float,
                shape: Any, coords: Any) -> dict[str, Any]:
    """Part 2 of the module: every plan of :data:`PLANS`, predicted and measured."""
    from sparsepipe_hpc.plan.search import evaluate

    rows = []
    for plan in PLANS:
        R, S, g, m = plan
        n = R * S * g[0] * g[1] * g[2]
        rank_vps, imb = _inputs(coords, shape, plan, prof.total_stride)
        pred = evaluate(prof, machine(n), R, S, g, m, BATCH, voxels_per_sample=rank_vps,
                        extent=shape, imbalance=imb)
        mean = evaluate(prof, machine(n), R, S, g, m, BATCH, voxels_per_sample=vps,
                        extent=shape, balance=pred.balance if S > 1 else None)
        bal = ",".join(map(str, pred.balance)) if S > 1 else None
        got = _measure(n, plan, bal, args, tmp)
        rows.append({"ranks": n, "replicas": R, "stages": S, "grid": list(g),
                     "micro_batches": m, "balance": list(pred.balance),
                     "voxels_per_sample": rank_vps, "imbalance": imb,
                     "predicted_split_s": max(pred.split, default=0.0),
                     "predicted_mean_s": mean.step_time,
                     "error_mean": mean.step_time / got["median"] - 1,
                     "core_share": pred.core_share,
                     "predicted_s": pred.step_time, "measured_s": got["median"],
                     "measured_all_s": got["times"],
                     "error": pred.step_time / got["median"] - 1})
        print(f"{n} ranks R{R} S{S} grid {g} m{m} balance {bal}: predicted "
              f"{pred.step_time:.3f} s (mean input {mean.step_time:.3f} s), measured "
              f"{got['median']:.3f} s ({rows[-1]['error']:+.0%}, mean input "
              f"{rows[-1]['error_mean']:+.0%})", flush=True)
    ranking: dict[int, Any] = {}
    ranking_mean: dict[int, Any] = {}
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        fastest = min(mine, key=lambda r: r["measured_s"])
        for out, key in ((ranking, "predicted_s"), (ranking_mean, "predicted_mean_s")):
            pick = min(mine, key=lambda r: r[key])
            out[n] = {"measured_fastest": fastest, "predicted_first": pick,
                      "same": fastest is pick,
                      "pick_vs_fastest": pick["measured_s"] / fastest["measured_s"] - 1}
    result = {"plans": rows,
              "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
              "median_abs_error_mean_input": statistics.median(abs(r["error_mean"])
                                                               for r in rows),
              "ranking": ranking, "ranking_mean_input": ranking_mean}
    verdicts = [f"{n} ranks " + ("ok" if v["same"] else f"pick +{v['pick_vs_fastest']:.0%}")
                + ("" if w["same"] else f" (mean input: pick +{w['pick_vs_fastest']:.0%})")
                for (n, v), w in zip(ranking.items(), ranking_mean.values())]
    print(f"median |error| {result['median_abs_error']:.1%} over {len(rows)} plans (mean input "
          f"{result['median_abs_error_mean_input']:.1%}); measured-"
          f"fastest predicted first: {', '.join(verdicts)}", flush=True)
    return result


def _balance_part(prof: Any, machine: Any, args: argparse.Namespace, tmp: Path, vps: float,
                  shape: Any) -> dict[str, Any]:
    """Part 3 of the module: rank 1 ``--slow-factor`` times slower, balanced against even."""
    from sparsepipe_hpc.plan.search import evaluate, search

    f = args.slow_factor
    het = machine(2, [1.0, 1.0 / f])
    best = search(prof, het, BATCH, fixed={"stages": 2, "micro_batches": 4, "replicas": 1},
                  voxels_per_sample=vps, extent=shape).plans[0]
    even_bal = "4,4"
    even_pred = evaluate(prof, het, 1, 2, (1, 1, 1), 4, BATCH, voxels_per_sample=vps,
                         extent=shape, balance=(4, 4), stage_order=(0, 1))
    bal = ",".join(map(str, best.balance))
    order = ",".join(map(str, best.stage_order)) if best.moves_stages else None
    m_even = _measure(2, PIPELINE, even_bal, args, tmp, slow=f)["median"]
    m_bal = m_even if bal == even_bal and order is None else \
        _measure(2, PIPELINE, bal, args, tmp, slow=f, order=order)["median"]
    hetero = {"slow_factor": f, "slow_rank": 1, "balanced": list(best.balance),
              "stage_order": list(best.stage_order),
              "even": [4, 4], "predicted_even_s": even_pred.step_time,
              "predicted_balanced_s": best.step_time, "measured_even_s": m_even,
              "measured_balanced_s": m_bal,
              "predicted_speedup": even_pred.step_time / best.step_time,
              "measured_speedup": m_even / m_bal}
    print(f"slow rank x{f}: balance {bal}{f' stage order {order}' if order else ''} vs even 4,4: "
          f"measured {m_even:.3f} -> {m_bal:.3f} s (x{hetero['measured_speedup']:.2f}), "
          f"predicted x{hetero['predicted_speedup']:.2f}", flush=True)
    return hetero


SECTIONS = ("plans", "balance", "order")
#: The pipeline of parts 3 and 4: one replica, 2 stages, 4 micro-batches.
PIPELINE = (1, 2, (1, 1, 1), 4)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench planner")
    a = p.add_argument
    a("--json", metavar="FILE")
    a("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}: "
      "the plans predicted and measured, a slow rank's balanced partition, the stage order "
      "with a slow first rank (default all)")
    a("--steps", type=positive_int, default=5)
    a("--warmup", type=nonneg_int, default=2)
    a("--repeats", type=positive_int, default=5, help="profile timing repeats")
    a("--slow-factor", type=float, default=2.0)
    a("--order-slow-factor", type=float, default=3.0, help="rank 0's slow-down in the stage "
      "order part (default 3)")
    a("--slow-rank", type=nonneg_int, default=1, help=argparse.SUPPRESS)  # the workers': rank 1
    a("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--replicas", "--stages", "--micro-batches"):
        a(name, type=int, default=1, help=argparse.SUPPRESS)
    a("--grid", default="1,1,1", help=argparse.SUPPRESS)
    a("--balance", help=argparse.SUPPRESS)
    a("--stage-order", help=argparse.SUPPRESS)
    a("--result", help=argparse.SUPPRESS)
    a("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    sections = parse_sections(p, args.sections, SECTIONS)

    from sparsepipe_hpc.bench.common import environment, write_json
    from sparsepipe_hpc.plan.machine import Machine, load_machine

    prof, shape, vps, coords = _profile(args.repeats)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    result: dict[str, Any] = {"benchmark": "planner", "environment": environment(),
                              "cores": cores, "voxels_per_sample": vps}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "m.toml").write_text(_mpirun(2, ["-m", "sparsepipe_hpc.plan",
                                                "--measure-machine"]).stdout)
        links = load_machine(tmp / "m.toml")
        result["links"] = links.to_dict()["links"]

        def machine(n: int, speeds: Optional[list[float]] = None) -> Machine:
            return Machine.build(speeds or [1.0] * n, [float("inf")] * n, n, links.intra,
                                 links.inter, measured=True, cores_per_node=cores)

        if "plans" in sections:
            result.update(_plans_part(prof, machine, args, tmp, vps, shape, coords))
        if "balance" in sections:
            result["heterogeneous"] = _balance_part(prof, machine, args, tmp, vps, shape)
        if "order" in sections:
            result["stage_order"] = _stage_order_part(prof, machine, args, tmp, vps, shape)
    result["notes"] = ("predicted = cost model from a one-process profile; measured = median "
                       "trainer step (input excluded) under mpirun on this machine")
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])
