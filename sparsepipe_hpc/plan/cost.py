"""Step-time formulas used to rank plans: pipeline fill/drain, stage links, gradient all-reduce.

    from sparsepipe_hpc.plan.cost import Link, pipeline_step_time, ring_allreduce_time
    link = Link(alpha=5e-6, beta=1 / 10e9)                # 5 us latency, 10 GB/s
    t = pipeline_step_time([0.020, 0.025, 0.022], microbatches=8)     # 0.242 s
    t += ring_allreduce_time(nbytes=40e6, replicas=4, link=link)     # + 0.006 s

Units everywhere: seconds and bytes. Every function is pure and checks its inputs
(``ValueError`` naming the input, the rule and the value).

Which formula when. With ``S`` stages, ``m`` micro-batches and per-stage times ``t_s`` (one
micro-batch's forward + backward on stage ``s``, transfers included; bottleneck ``T = max t_s``):

* ``uniform_pipeline_step_time``: ``(m + S - 1) * T``. The GPipe / 1F1B figure for equal stages:
  ``m`` slots of the bottleneck plus ``S - 1`` slots of fill and drain (the "bubble", a fraction
  ``(S - 1) / (m + S - 1)`` of the step; Huang et al., GPipe, 2019; Narayanan et al., PipeDream,
  2019). With unequal stages it over-charges the bubble, which is paid at each stage's own speed.
* ``pipeline_step_time``: ``sum_s t_s + (m - 1) * T``. The makespan of ``m`` identical jobs through
  an ``S``-machine flow shop: the first micro-batch crosses every stage once (``sum_s t_s``), and
  each further one leaves the bottleneck ``T`` after the previous one. Exact for a flow shop (one
  pass per job, a stage works on one job at a time, unbounded buffers, fixed per-job times); for a
  forward + backward pipeline it is the standard approximation: exact for GPipe when every
  stage's backward takes the same multiple of its forward, and for 1F1B when the stages are
  equal or the bottleneck is the last stage. Where an earlier stage is the bottleneck, 1F1B
  hides later stages' fill and drain behind its own work and the formula over-charges it (by
  22% for stage times 9, 3, 3, a third forward, and 3 micro-batches: 33 s against the
  schedule's simulated 27 s, :func:`sparsepipe_hpc.pipeline.simulate`). Where stages differ in
  the share of their time spent forward, either schedule may also take longer than the formula
  (10.5 s against 10 for 1F1B over forward 0.75, 2.25, 0.25 and backward 2.25, 0.75, 0.75 s, 2
  micro-batches). So a split found by it may be slower than the best (seen up to ~15% on random
  3-5-block cases; balanced splits are close to exact). The search reports the simulated time
  of the split it found (:func:`sparsepipe_hpc.plan.search.simulated_pipeline`). The formula equals
  the uniform one when all ``t_s = T`` and is never larger, so it is the tighter of the two.
* ``ring_allreduce_time``: ``2 (r - 1) / r * bytes * beta + 2 (r - 1) * alpha`` for ``r`` replicas
  (a reduce-scatter and an all-gather of ``r - 1`` steps each, every step moving ``bytes / r``;
  Thakur, Rabenseifner & Gropp, 2005). Zero for one replica.

Spatial parallelism (Dryden et al., IPDPS 2019), for a grid ``g = (gx, gy, gz)`` of ``G`` ranks
over a micro-batch of ``V`` input voxels on an extent ``E`` (voxels per axis):

* ``largest_share``: the busiest box holds ``min(1, imbalance / G)`` of the voxels (``imbalance``
  = largest box / mean box: 1 for perfectly balanced cuts). A block's compute on the grid is its
  profiled time at ``V * largest_share`` voxels (the fixed part ``a`` of ``a + b v`` does not
  shrink, which is why small boxes stop scaling).
* ``halo_bytes``: per submanifold convolution a rank receives, across each split axis ``a``, a
  layer ``r`` voxels deep on each of its ``min(2, g_a - 1)`` inner faces; a face covers
  ``g_a / G`` of the cross-section, which holds ``V / E_a`` voxels per layer. With the profiled
  coefficient ``h_a = sum_l r_l C_l itemsize (V_l / E_l[a]) / (V / E[a])`` (bytes per input voxel
  layer, summed over the block's convolutions)::

      halo_bytes = sum_a [g_a > 1] * min(2, g_a - 1) * (g_a / G) * (V / E_a) * h_a

  Edges and corners (diagonal neighbours) are ignored: they add a fraction ``~ r / box side``.
* ``surface_voxels``: the same count for a one-voxel layer of the input, ``h_a = 1``:
  ``s = sum_a [g_a > 1] * min(2, g_a - 1) * (g_a / G) * (V / E_a)``: the busiest box's surface
  in input voxels, what the cost of building its halo plans and halo kernel maps scales with
  (:mod:`sparsepipe_hpc.plan.split`). 0 for a grid of one box.
* ``halo_time``: ``2 * (exchanges * neighbours * alpha + beta * halo_bytes)``, forward and the
  adjoint backward, ``neighbours = prod_a (1 + min(2, g_a - 1)) - 1``: the busiest (innermost)
  box's face, edge and corner neighbours (26 inside a 3-D split, 1 on a 2x1x1 grid), receives in
  parallel over a full-duplex link.
* ``stage_transfer_bytes``: a cut carrying ``B`` bytes for the micro-batch sends ``B / G`` per
  rank (rank ``i`` of stage ``s`` to rank ``i`` of stage ``s + 1``: same box; worst box
  ``B * largest_share``).
* ``memory_bytes``: ``param_bytes * optimizer_factor + inflight * act_bytes`` (weights, gradients
  and optimizer moments: AdamW keeps 2, so ``optimizer_factor = 4``; SGD with momentum 3).

Assumptions shared by all: stage times do not vary between micro-batches, transfers and the
all-reduce do not overlap compute (the step adds them; overlap would only make the step shorter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Link", "pipeline_step_time", "uniform_pipeline_step_time", "bubble_fraction",
           "ring_allreduce_time", "step_time", "largest_share", "halo_bytes", "halo_time",
           "surface_voxels", "memory_bytes", "OPTIMIZER_FACTOR"]

#: Bytes of state per byte of weights: the weight, its gradient and the optimizer's moments.
OPTIMIZER_FACTOR = {"adamw": 4.0, "sgd": 3.0}


def _nonneg(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} is {value!r}; it must be a finite number >= 0")
    return v


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise ValueError(f"{name} is {value!r}; it must be a whole number >= 1")
    return int(value)


def _times(name: str, times: Sequence[float]) -> list[float]:
    ts = [_nonneg(f"{name}[{i}]", t) for i, t in enumerate(times)]
    if not ts:
        raise ValueError(f"{name} is empty; it needs one time per stage")
    return ts


@dataclass(frozen=True)
class Link:
    """A point-to-point link: sending ``b`` bytes takes ``alpha + beta * b`` seconds.

    alpha: latency in seconds; beta: inverse bandwidth in seconds per byte (1 / bytes-per-second).
    """

    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        _nonneg("Link.alpha", self.alpha)
        _nonneg("Link.beta", self.beta)

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes once: ``alpha + beta * nbytes``."""
        return self.alpha + self.beta * _nonneg("nbytes", nbytes)


def pipeline_step_time(stage_times: Sequence[float], microbatches: int) -> float:
    """Seconds per step of a pipeline: ``sum_s t_s + (m - 1) * max_s t_s`` (see the module).

    stage_times: ``t_s`` in seconds, forward + backward of one micro-batch on stage ``s`` (transfers
    included), in pipeline order; microbatches: ``m >= 1``.
    """
    ts = _times("stage_times", stage_times)
    m = _count("microbatches", microbatches)
    return sum(ts) + (m - 1) * max(ts)


def uniform_pipeline_step_time(stage_time: float, stages: int, microbatches: int) -> float:
    """Seconds per step of ``S`` equal stages of ``T`` seconds each: ``(m + S - 1) * T``."""
    t = _nonneg("stage_time", stage_time)
    return (_count("microbatches", microbatches) + _count("stages", stages) - 1) * t


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a step of equal stages: ``(S - 1) / (m + S - 1)`` (0 for one stage)."""
    s, m = _count("stages", stages), _count("microbatches", microbatches)
    return (s - 1) / (m + s - 1)


def ring_allreduce_time(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` bytes over ``r`` replicas.

    ``2 (r - 1) / r * nbytes * beta + 2 (r - 1) * alpha``; 0 when ``r == 1``. ``link`` is the
    slowest link of the ring (the ring moves in lock-step).
    """
    b = _nonneg("nbytes", nbytes)
    r = _count("replicas", replicas)
    return 2 * (r - 1) / r * b * link.beta + 2 * (r - 1) * link.alpha


def step_time(stage_times: Sequence[float], microbatches: int,
              allreduce_times: Sequence[float] = ()) -> float:
    """Seconds per training step: the pipeline plus the slowest stage's gradient all-reduce.

    Every stage all-reduces its own gradients over its replicas, all stages at once, after the
    last backward: ``pipeline_step_time(t, m) + max_s allreduce_s`` (no overlap assumed).
    ``allreduce_times``: one per stage in seconds, or empty for a single replica.
    """
    ar = [_nonneg(f"allreduce_times[{i}]", a) for i, a in enumerate(allreduce_times)]
    if ar and len(ar) != len(stage_times):
        raise ValueError(f"allreduce_times has {len(ar)} entries but stage_times has "
                         f"{len(stage_times)}; pass one all-reduce time per stage or none")
    return pipeline_step_time(stage_times, microbatches) + max(ar, default=0.0)


def _grid(grid: Sequence[int]) -> tuple[int, int, int]:
    g = tuple(int(x) for x in grid)
    if len(g) != 3 or min(g) < 1:
        raise ValueError(f"grid is {tuple(grid)!r}; it must be three whole numbers >= 1")
    return g  # type: ignore[return-value]


def largest_share(grid: Sequence[int], imbalance: float = 1.0) -> float:
    """Share of the voxels in the busiest box of ``grid``: ``min(1, imbalance / G)``."""
    if not math.isfinite(imbalance) or imbalance < 1:
        raise ValueError(f"imbalance is {imbalance!r}; it must be a finite number >= 1 "
                         f"(largest box / mean box)")
    return min(1.0, imbalance / math.prod(_grid(grid)))


def halo_bytes(coef: Sequence[float], voxels: float, extent: Sequence[int],
               grid: Sequence[int]) -> float:
    """Bytes one rank receives per halo round of a block (see the module for the formula).

    coef: the block's ``h_a`` per axis (bytes per input voxel layer); voxels: ``V`` of the
    micro-batch; extent: ``E`` per axis in voxels; grid: ``g``.
    """
    g = _grid(grid)
    v = _nonneg("voxels", voxels)
    total = math.prod(g)
    out = 0.0
    for a in range(3):
        if g[a] > 1:
            e = _nonneg(f"extent[{a}]", extent[a]) or 1.0
            out += min(2, g[a] - 1) * g[a] / total * (v / e) * _nonneg(f"coef[{a}]", coef[a])
    return out


def surface_voxels(voxels: float, extent: Sequence[int], grid: Sequence[int]) -> float:
    """Input voxels one voxel deep on the busiest box's inner faces (see the module)."""
    return halo_bytes((1.0, 1.0, 1.0), voxels, extent, grid)


def halo_time(nbytes: float, exchanges: int, grid: Sequence[int], link: Link) -> float:
    """Seconds of halo traffic of a block per micro-batch, forward + backward (see the module)."""
    g = _grid(grid)
    neighbours = math.prod(1 + min(2, x - 1) for x in g) - 1
    if neighbours == 0 or exchanges == 0:
        return 0.0
    return 2 * (exchanges * neighbours * link.alpha + link.beta * _nonneg("nbytes", nbytes))


def memory_bytes(param_bytes: float, act_bytes: float, inflight: int,
                 optimizer_factor: float = OPTIMIZER_FACTOR["adamw"]) -> float:
    """Bytes a device holds: ``param_bytes * optimizer_factor + inflight * act_bytes``."""
    return (_nonneg("param_bytes", param_bytes) * _nonneg("optimizer_factor", optimizer_factor)
            + _nonneg("inflight", inflight) * _nonneg("act_bytes", act_bytes))
