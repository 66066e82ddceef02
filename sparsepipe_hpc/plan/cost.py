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
  forward + backward pipeline it is the standard approximation, exact when every stage's backward
  takes the same multiple of its forward, and it equals the uniform formula when all ``t_s = T``.
  It is never larger than the uniform one, so it is the tighter of the two.
* ``ring_allreduce_time``: ``2 (r - 1) / r * bytes * beta + 2 (r - 1) * alpha`` for ``r`` replicas
  (a reduce-scatter and an all-gather of ``r - 1`` steps each, every step moving ``bytes / r``;
  Thakur, Rabenseifner & Gropp, 2005). Zero for one replica.

Assumptions shared by all: stage times do not vary between micro-batches, transfers and the
all-reduce do not overlap compute (the step adds them; overlap would only make the step shorter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Link", "pipeline_step_time", "uniform_pipeline_step_time", "bubble_fraction",
           "ring_allreduce_time", "step_time"]


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
