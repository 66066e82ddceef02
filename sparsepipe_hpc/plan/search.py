"""Search over replicas x stages x grid x stage partition x micro-batches: plans ranked by time.

    from sparsepipe_hpc.plan.machine import Machine
    from sparsepipe_hpc.plan.search import search
    result = search(profile, Machine.uniform(8, ranks_per_node=4), batch_size=8)
    best = result.plans[0]                 # fastest first; result.rejected: why others failed
    best.replicas, best.stages, best.grid, best.balance, best.micro_batches, best.step_time

Rank layout (as :class:`sparsepipe_hpc.parallel.layout.RankLayout`): rank
``r * S * G + s * G + i`` is spatial rank ``i`` of stage ``s`` of replica ``r``. A stage runs at
the speed of its slowest rank and within its smallest memory (all its ranks move in lock step),
and rank ``i`` of stage ``s`` sends to rank ``i`` of stage ``s + 1``.

Predicted step time of a candidate (every term in seconds; formulas in
:mod:`sparsepipe_hpc.plan.cost`, the partition in :mod:`sparsepipe_hpc.plan.partition`)::

    local batch     n = batch_size / R samples per replica, in m micro-batches of
                    ceil(n / m) samples: V = ceil(n / m) * voxels_per_sample input voxels
    busiest box     v = V * largest_share(grid, imbalance)
    block b         time_b = fwd_b(v) + bwd_b(v)
                    + [G > 1] split_b(v, surface_voxels(V, E, grid))   (halo plans, maps and
                    halo pairs; :mod:`sparsepipe_hpc.plan.split`), at the device's speed;
                    comm_b = halo_time(halo_bytes(h_b, V, E, grid)) on the slowest spatial
                    group's link for it (inter-node where a group crosses nodes), on any device
    stage [i, j)    + the kernel maps made before block i that it uses, rebuilt once per
                    micro-batch (ModelProfile.rebuild_costs at v voxels; pipelines only)
                    out_bytes_b(V) * share, act_bytes_b(v), param_bytes_b * optimizer_factor
    CPU cores       machines with ``cores_per_node`` run every device at
                    core_share(busy) = min(1, cores / busy) of its speed, busy = the plan's
                    ranks on the most crowded node * (1 - bubble_fraction(S, m)): ranks that
                    wait in the pipeline bubble yield their core (Machine.core_share)
    partition       the split with the least step time below (partition_stages, exact, its
                    all-reduce and update as tails) over the S stage devices with the stage
                    links (each cut's message at its slowest rank pair's pace) and the
                    schedule's in-flight micro-batches
    step            pipeline + max_s ring_allreduce(params_s, R * G ranks)
                    + max_s update_s / speed_s    (the optimizer step, once per step), the
                    pipeline being sum_s t_s + (m - 1) max_s t_s for the split's search
                    (partition_stages) and, for the plan's figure, the schedule's simulated
                    time of those stage times, forward and backward apart
                    (simulated_pipeline; the formula is exact only in special cases:
                    sparsepipe_hpc.plan.cost)

Candidates: every ``R * S * G == ranks`` with ``S <= blocks``, every grid of ``G`` whose boxes
hold one stride block each (``g_a <= E_a / total_stride``), every ``m`` in
1, 2, 4, ... and ``n`` up to ``n`` (or ``max_micro_batches``); ``batch_size % R == 0``. Plans that
fit no partition in memory are left out (counted in :attr:`SearchResult.rejected`). The first plan
is the fastest; ties go to fewer stages, then fewer micro-batches, then more replicas.

Stage order (BaPipe's devices of unequal speed or memory): where the stages' rank groups differ,
each candidate is predicted for every distinct order of the groups (:func:`stage_orders`; stage
``s`` on the group launched as stage ``order[s]``) and keeps the fastest, the launch's order on
ties. Order matters through memory (under 1F1B the first stages hold the most micro-batches),
speeds against the blocks' granularity, and links. The plan's ``stage_order`` is the trainer's
``--stage-order``, which renumbers the ranks so that each stage runs where the plan put it.
Measured (``bench planner --sections order``: 2 CPU ranks, the default U-Net of 8 blocks, rank 0
slowed 3x, 4 micro-batches; medians of 2 alternated runs, 2026-11-28): stage order 1,0 with
blocks 6,2 stepped 1.98 s against 2.05 s for the launch's order at its best split 1,7 (x1.03;
predicted x1.10).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from sparsepipe_hpc.plan.cost import (OPTIMIZER_FACTOR, Link, bubble_fraction, halo_bytes,
                                      halo_time, largest_share, ring_allreduce_time,
                                      surface_voxels)
from sparsepipe_hpc.plan.machine import Machine
from sparsepipe_hpc.parallel.layout import LayoutError, parse_stage_order
from sparsepipe_hpc.plan.partition import (STEP_RTOL, Block, Device, Partition, PartitionError,
                                           distinct_orders, inflight_1f1b, inflight_gpipe,
                                           order_count, partition_stages, segment_sums)
from sparsepipe_hpc.plan.profile import ModelProfile

#: More distinct stage orders than this: only the launch's is predicted (one DP each).
MAX_STAGE_ORDERS = 5040
#: The pipeline schedules, by the trainer's --pipeline-schedule name: micro-batches in flight.
SCHEDULES = {"1f1b": inflight_1f1b, "gpipe": inflight_gpipe}

__all__ = ["Plan", "SearchResult", "SearchError", "search", "evaluate", "stage_orders", "grids",
           "divisors", "simulated_pipeline", "MAX_STAGE_ORDERS"]


class SearchError(ValueError):
    """No plan fits, or the search's inputs break a rule."""


@dataclass(frozen=True)
class Plan:
    """One candidate and its prediction (seconds, bytes)."""

    replicas: int
    stages: int
    grid: tuple[int, int, int]
    micro_batches: int
    balance: tuple[int, ...]
    pipeline_schedule: str
    step_time: float
    stage_times: tuple[float, ...]
    compute: tuple[float, ...]
    transfer: tuple[float, ...]
    halo: tuple[float, ...]
    allreduce: tuple[float, ...]
    update: tuple[float, ...]
    memory: tuple[float, ...]
    voxels_per_rank: float
    split: tuple[float, ...] = ()
    core_share: float = 1.0
    stage_order: tuple[int, ...] = ()  # stage s on the ranks launched as stage stage_order[s]

    @property
    def ranks(self) -> int:
        return self.replicas * self.stages * math.prod(self.grid)

    @property
    def moves_stages(self) -> bool:
        """Whether the plan's stage order is not the launch's (the trainer needs
        ``--stage-order``)."""
        return bool(self.stage_order) and self.stage_order != tuple(range(self.stages))

    def trainer_args(self) -> list[str]:
        """The trainer options this plan sets."""
        args = ["--replicas", str(self.replicas), "--grid", ",".join(map(str, self.grid))]
        if self.stages > 1 or self.micro_batches > 1:
            args += ["--stages", str(self.stages), "--micro-batches", str(self.micro_batches),
                     "--pipeline-schedule", self.pipeline_schedule]
        if self.stages > 1:
            args += ["--balance", ",".join(map(str, self.balance))]
        if self.moves_stages:
            args += ["--stage-order", ",".join(map(str, self.stage_order))]
        return args

    def to_dict(self, machine: Optional[Machine] = None) -> dict[str, Any]:
        d = asdict(self)
        d["grid"] = list(self.grid)
        d["stage_order"] = list(self.stage_order or range(self.stages))
        d["ranks"] = self.ranks
        per = 0 if machine is None else min(machine.ranks_per_node, self.ranks)
        if per and self.ranks % per == 0:  # what `python -m launch job --plan` needs: a job
            d.update(nodes=self.ranks // per, gpus_per_node=per)  # puts as many on every node
        return d


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[Plan, ...]
    rejected: dict[str, int] = field(default_factory=dict)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grids(ranks: int, extent: Sequence[int] = (0, 0, 0), stride: int = 1
          ) -> Iterator[tuple[int, int, int]]:
    """Every ``(gx, gy, gz)`` with product ``ranks`` and (for a known extent) boxes at least one
    stride block wide: ``g_a <= extent_a // stride``."""
    for gx in divisors(ranks):
        for gy in divisors(ranks // gx):
            g = (gx, gy, ranks // gx // gy)
            if all(e <= 0 or ga <= max(1, e // stride) for ga, e in zip(g, extent)):
                yield g


def _micro_counts(local: int, limit: Optional[int]) -> list[int]:
    top = min(local, limit or local)
    ms = {1, top}
    k = 2
    while k < top:
        ms.add(k)
        k *= 2
    return sorted(ms)


def evaluate(profile: ModelProfile, machine: Machine, replicas: int, stages: int,
             grid: Sequence[int], micro_batches: int, batch_size: int,
             schedule: str = "1f1b", imbalance: float = 1.0, optimizer: str = "adamw",
             voxels_per_sample: Optional[float] = None,
             extent: Optional[Sequence[int]] = None,
             balance: Optional[Sequence[int]] = None,
             stage_order: Optional[Sequence[int]] = None) -> Plan:
    """Predict one candidate (see the module); raises PartitionError when nothing fits memory.

    balance: a fixed partition (blocks per stage) instead of the exact search's. stage_order:
    stage ``s`` on the ranks the layout places at stage ``stage_order[s]`` (the trainer's
    ``--stage-order``); None: the best of :func:`stage_orders` (the launch's order on ties).
    """
    g = (int(grid[0]), int(grid[1]), int(grid[2]))
    ranks = replicas * stages * math.prod(g)
    if ranks > machine.ranks:
        raise SearchError(f"the plan uses {ranks} ranks but the machine has {machine.ranks}")
    args = (profile, machine, replicas, stages, g, micro_batches, batch_size, schedule,
            imbalance, optimizer, voxels_per_sample, extent, balance)
    if stage_order is not None:
        try:
            order = parse_stage_order(stage_order, stages)
        except LayoutError as e:
            raise SearchError(str(e)) from None
        return _evaluate(*args, order)
    best: Optional[Plan] = None
    failed: Optional[PartitionError] = None
    for order in stage_orders(machine, replicas, stages, g):
        try:
            p = _evaluate(*args, order)
        except PartitionError as e:
            failed = failed or e
            continue
        if best is None or p.step_time < best.step_time * (1 - STEP_RTOL):
            best = p
    if best is None:
        assert failed is not None
        raise failed
    return best


def stage_orders(machine: Machine, replicas: int, stages: int, grid: Sequence[int],
                 max_orders: int = MAX_STAGE_ORDERS) -> list[tuple[int, ...]]:
    """The stage orders worth predicting, the launch's first: every distinct order of the
    stages' rank groups where the groups' devices differ in speed or memory (groups whose ranks
    have equal devices, nodes included, are interchangeable); the launch's order alone where
    they do not, or where there are more than ``max_orders`` distinct orders."""
    G = math.prod(grid)
    identity = tuple(range(stages))
    groups = [tuple(machine.devices[(r * stages + s) * G + i] for r in range(replicas)
                    for i in range(G)) for s in range(stages)]
    if len({tuple((d.speed, d.memory) for d in grp) for grp in groups}) == 1:
        return [identity]
    if order_count(groups) > max_orders:
        return [identity]
    orders = list(distinct_orders(groups))
    orders.sort(key=lambda o: o != identity)  # the launch's first: it wins ties
    return orders


def _evaluate(profile: ModelProfile, machine: Machine, replicas: int, stages: int,
              g: tuple[int, int, int], micro_batches: int, batch_size: int, schedule: str,
              imbalance: float, optimizer: str, voxels_per_sample: Optional[float],
              extent: Optional[Sequence[int]], balance: Optional[Sequence[int]],
              order: tuple[int, ...]) -> Plan:
    """:func:`evaluate` of one stage order."""
    G = math.prod(g)
    ranks = replicas * stages * G
    if batch_size % replicas:
        raise SearchError(f"batch_size {batch_size} does not split over {replicas} replicas")
    local = batch_size // replicas
    if not 1 <= micro_batches <= local:
        raise SearchError(f"micro_batches {micro_batches} must be in 1..{local} (samples per "
                          f"replica)")
    vps = voxels_per_sample or profile.voxels_per_sample
    ext = tuple(extent or profile.extent)
    V = -(-local // micro_batches) * vps
    share = largest_share(g, imbalance)
    v = V * share

    def rank(r: int, s: int, i: int) -> int:  # rank i of stage s of replica r, as ordered
        return r * stages * G + order[s] * G + i

    per_node: dict[int, int] = {}
    for d in machine.devices[:ranks]:
        per_node[d.node] = per_node.get(d.node, 0) + 1
    core = machine.core_share(max(per_node.values()) * (1 - bubble_fraction(stages,
                                                                             micro_batches)))
    devs, links = [], []
    for s in range(stages):
        members = [machine.devices[rank(r, s, i)] for r in range(replicas) for i in range(G)]
        devs.append(Device(speed=core * min(d.speed for d in members),
                           memory=min(d.memory for d in members), node=members[0].node,
                           name=f"stage {s}"))
        if s + 1 < stages:
            # Every rank pair of the cut moves at once: each message at the slowest pair's pace
            # for its size (a link with less latency may have less bandwidth).
            links.append(tuple(dict.fromkeys(
                machine.link(machine.devices[rank(r, s, i)], machine.devices[rank(r, s + 1, i)])
                for r in range(replicas) for i in range(G))))
    group_links = []
    for s in range(stages):
        group_links.append(machine.group_link([rank(r, s, i) for r in range(replicas)
                                               for i in range(G)]))
    spatial_links = set(machine.group_link([rank(r, s, i) for i in range(G)])
                        for r in range(replicas) for s in range(stages))
    factor = OPTIMIZER_FACTOR[optimizer]
    halos = [max(halo_time(halo_bytes(b.halo, V, ext, g), b.exchanges, g, ln)
                 for ln in spatial_links) for b in profile.blocks]
    surface = surface_voxels(V, ext, g)
    splits = [b.split(v, surface) if G > 1 else 0.0 for b in profile.blocks]
    blocks = [Block(time=b.time(v) + x, out_bytes=b.out_bytes(V) * share,
                    param_bytes=b.param_bytes * factor, act_bytes=b.act_bytes(v), name=b.name,
                    comm=h)
              for b, h, x in zip(profile.blocks, halos, splits)]
    if schedule not in SCHEDULES:
        raise SearchError(f"schedule {schedule!r} must be one of {list(SCHEDULES)}")
    inflight = SCHEDULES[schedule]
    # The once-per-step tails of a stage s on blocks [i, j): its all-reduce and its update.
    params = segment_sums([b.param_bytes for b in profile.blocks])
    updates = segment_sums([b.update_for(optimizer) for b in profile.blocks])
    tails = [np.stack([_ring_allreduce_times(params, replicas * G, ln) for ln in group_links]),
             np.stack([updates / d.speed for d in devs])]
    rebuild = profile.rebuild_costs(v) if stages > 1 else None
    if balance is not None:
        if len(balance) != stages or sum(balance) != len(blocks) or min(balance) < 1:
            raise SearchError(f"balance {tuple(balance)} must give {stages} positive block "
                              f"counts summing to the model's {len(blocks)} blocks")
        bounds = [0]
        for n in balance:
            bounds.append(bounds[-1] + int(n))
        # A fixed partition: the DP over exactly these boundaries (one choice per stage).
        p = partition_stages([Block(time=sum(bl.time for bl in blocks[a:b]),
                                    out_bytes=blocks[b - 1].out_bytes,
                                    param_bytes=sum(bl.param_bytes for bl in blocks[a:b]),
                                    act_bytes=sum(bl.act_bytes for bl in blocks[a:b]),
                                    comm=sum(bl.comm for bl in blocks[a:b]))
                              for a, b in zip(bounds[:-1], bounds[1:])],
                             devs, links or Link(), micro_batches, inflight,
                             None if rebuild is None else rebuild[np.ix_(bounds, bounds)])
        bal = tuple(int(n) for n in balance)
        halo_s = [sum(halos[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        split_s = [sum(splits[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        p = partition_stages(blocks, devs, links or Link(), micro_batches, inflight, rebuild,
                             tails=tails if stages > 1 else ())
        bal = tuple(b - a for a, b in zip(p.bounds[:-1], p.bounds[1:]))
        halo_s = [sum(halos[a:b]) for a, b in zip(p.bounds[:-1], p.bounds[1:])]
        split_s = [sum(splits[a:b]) for a, b in zip(p.bounds[:-1], p.bounds[1:])]
        bounds = list(p.bounds)
    ar, upd = (tuple(float(t[s, a, c]) for s, (a, c) in enumerate(zip(bounds, bounds[1:])))
               for t in tails)
    pipeline = p.step_time()
    if stages > 1:
        fwd = [sum(b.forward(v) for b in profile.blocks[a:c]) for a, c in zip(bounds, bounds[1:])]
        both = [sum(b.time(v) for b in profile.blocks[a:c]) for a, c in zip(bounds, bounds[1:])]
        pipeline = simulated_pipeline(p, [f / t if t > 0 else 0.5 for f, t in zip(fwd, both)],
                                      schedule)
    return Plan(replicas=replicas, stages=stages, grid=g, micro_batches=micro_batches,
                balance=bal, pipeline_schedule=schedule,
                step_time=pipeline + max(ar) + max(upd), stage_times=p.times,
                compute=tuple(c - h - x / d.speed
                              for c, h, x, d in zip(p.compute, halo_s, split_s, devs)),
                transfer=p.transfer, halo=tuple(halo_s),
                allreduce=ar, update=upd, memory=p.memory, voxels_per_rank=v,
                split=tuple(x / d.speed for x, d in zip(split_s, devs)), core_share=core,
                stage_order=order)


def simulated_pipeline(p: Partition, forward_share: Sequence[float], schedule: str) -> float:
    """Seconds of the pipeline part of a step: ``schedule``'s timeline of ``p``'s micro-batches
    (:func:`sparsepipe_hpc.pipeline.simulate`), stage ``s`` taking ``forward_share[s]`` of its
    compute forward and the rest backward, each half of its transfers. The formula the split
    is found by (``p.step_time()``) is exact only in special cases
    (:mod:`sparsepipe_hpc.plan.cost`); this is the schedule's own time for that split."""
    from sparsepipe_hpc.pipeline import simulate

    fwd = [r * c + x / 2 for r, c, x in zip(forward_share, p.compute, p.transfer)]
    bwd = [(1 - r) * c + x / 2 for r, c, x in zip(forward_share, p.compute, p.transfer)]
    return simulate(_schedule(schedule, len(p.times), p.microbatches), fwd, bwd,
                    check=False).makespan


@functools.lru_cache(maxsize=512)
def _schedule(kind: str, stages: int, micro_batches: int) -> Any:
    """``make_schedule``'s schedule, validated once (a search simulates each many times)."""
    from sparsepipe_hpc.pipeline import make_schedule, validate

    sched = make_schedule(kind, stages, micro_batches)
    validate(sched)
    return sched


def _ring_allreduce_times(nbytes: np.ndarray, replicas: int, link: Link) -> np.ndarray:
    """:func:`ring_allreduce_time` of every entry of ``nbytes`` (it is affine in the bytes)."""
    at0 = ring_allreduce_time(0.0, replicas, link)
    return at0 + (ring_allreduce_time(1.0, replicas, link) - at0) * nbytes


def search(profile: ModelProfile, machine: Machine, batch_size: int,
           ranks: Optional[int] = None, schedule: str = "1f1b", imbalance: float = 1.0,
           optimizer: str = "adamw", max_micro_batches: Optional[int] = None,
           voxels_per_sample: Optional[float] = None, extent: Optional[Sequence[int]] = None,
           fixed: Optional[dict[str, Any]] = None, max_batch: int = 256) -> SearchResult:
    """Every candidate of the module docstring on ``ranks`` (default: the machine's), fastest
    first. fixed: layout values to keep (``replicas``, ``stages``, ``grid``, ``micro_batches``,
    ``balance`` and ``stage_order``, which also fix ``stages``), e.g. the options a user set. Raises
    :class:`SearchError` when none fits."""
    n = ranks or machine.ranks
    if n < 1 or n > machine.ranks:
        raise SearchError(f"ranks is {n}; it must be in 1..{machine.ranks} (the machine's ranks)")
    if batch_size < 1:
        raise SearchError(f"batch_size is {batch_size}; it must be >= 1")
    if optimizer not in OPTIMIZER_FACTOR:
        raise SearchError(f"optimizer {optimizer!r} must be one of {sorted(OPTIMIZER_FACTOR)}")
    fixed = dict(fixed or {})
    for key in ("balance", "stage_order"):  # a fixed partition or order fixes the stage count
        if fixed.get(key) is not None:
            nb = len(fixed[key])
            if fixed.setdefault("stages", nb) != nb:
                raise SearchError(f"{key} {tuple(fixed[key])} names {nb} stage(s) but stages "
                                  f"is {fixed['stages']}; give one entry per stage")
    ext = tuple(extent or profile.extent)
    plans: list[Plan] = []
    rejected: dict[str, int] = {}
    nblocks = len(profile.blocks)
    for R in divisors(n):
        if batch_size % R or batch_size // R > max_batch or fixed.get("replicas", R) != R:
            continue
        local = batch_size // R
        for S in divisors(n // R):
            if S > nblocks or fixed.get("stages", S) != S:
                continue
            for g in grids(n // R // S, ext, profile.total_stride):
                if tuple(fixed.get("grid", g)) != g:
                    continue
                ms = [fixed["micro_batches"]] if "micro_batches" in fixed else \
                    _micro_counts(local, max_micro_batches)
                for m in ms:
                    if m > local:
                        continue
                    try:
                        plans.append(evaluate(profile, machine, R, S, g, m, batch_size, schedule,
                                              imbalance, optimizer, voxels_per_sample, ext,
                                              fixed.get("balance") if S > 1 else None,
                                              fixed.get("stage_order")))
                    except PartitionError as e:
                        key = str(e).split("; ")[0]  # the reason, without the remedy
                        rejected[key] = rejected.get(key, 0) + 1
    if not plans:
        if rejected:
            top = max(rejected, key=lambda k: rejected[k])  # the commonest reason, in full
            others = len(rejected) - 1
            why = (f"{top} (the reason for {rejected[top]} of the {sum(rejected.values())} "
                   f"layouts tried" + (f"; {others} other reason(s) for the rest" if others
                                       else "") + ")")
        else:
            why = (f"no layout of {n} ranks fits batch_size {batch_size}, {nblocks} blocks and "
                   f"the fixed values {fixed}")
        raise SearchError(f"no plan fits {n} ranks: {why}; add ranks or memory, or lower "
                          f"--batch-size")
    plans.sort(key=lambda p: (p.step_time, p.stages, p.micro_batches, -p.replicas,
                              p.grid[::-1]))
    return SearchResult(tuple(plans), rejected)
