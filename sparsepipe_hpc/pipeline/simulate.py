"""Timelines of a schedule from modelled stage times: bubble fraction and peak activations.

    sched = make_schedule("gpipe", 2, 4)
    tl = simulate(sched, fwd_time=1.0, bwd_time=2.0)
    bubble_fraction(tl)        # 0.2 == (S-1)/(m+S-1) for equal stages
    peak_activations(sched)    # (4, 4): micro-batches whose activations a stage holds at once

``simulate`` replays the schedule with non-blocking sends and blocking receives (the executor's
semantics, see ``replay``): forward and backward of stage s take ``fwd_time[s]`` and
``bwd_time[s]`` (a number for all stages, or one per stage to model unequal stages), a message
arrives ``comm_time`` after its send, sends take ``send_time`` and the optimizer step
``step_time``. Times are in whatever unit the caller uses; ``to_chrome_trace`` scales them.

With equal stages, both schedules have bubble fraction (S-1)/(m+S-1) for any forward/backward
ratio (Huang et al. 2019; Narayanan et al., SC 2021): the bubble is S-1 forward times
plus S-1 backward times out of m+S-1 of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from sparsepipe_hpc.pipeline.replay import Event, replay
from sparsepipe_hpc.pipeline.schedule import Action, Op, Schedule
from sparsepipe_hpc.pipeline.validate import validate

__all__ = ["Timeline", "Event", "simulate", "bubble_fraction", "peak_activations",
           "theoretical_bubble"]

Times = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Timeline:
    """Every action of every stage with its times; ``events[s]`` is stage s's, in program order."""

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]

    @property
    def makespan(self) -> float:
        """When the last stage finishes (all stages start at 0)."""
        return max((e.end for evs in self.events for e in evs), default=0.0)

    def busy(self, stage: int) -> float:
        """Time stage ``stage`` spends in forward and backward."""
        return sum(e.end - e.start for e in self.events[stage] if e.action.op.is_compute)


def _time(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
    return float(v)


def _per_stage(name: str, value: Times, stages: int) -> list[float]:
    values = [value] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} value(s) but the schedule has {stages} "
                         f"stage(s); give one number or one per stage")
    return [_time(f"{name}[{s}]", v) for s, v in enumerate(values)]


def simulate(schedule: Schedule, fwd_time: Times = 1.0, bwd_time: Times = 1.0, *,
             comm_time: float = 0.0, send_time: float = 0.0, step_time: float = 0.0,
             check: bool = True) -> Timeline:
    """Validate ``schedule`` (``check=False``: validated already, as a caller simulating one
    schedule many times does) and return its timeline under the modelled times."""
    if check:
        validate(schedule)
    S = schedule.stages
    fwd, bwd = _per_stage("fwd_time", fwd_time, S), _per_stage("bwd_time", bwd_time, S)
    comm, send = _time("comm_time", comm_time), _time("send_time", send_time)
    step = _time("step_time", step_time)

    def duration(s: int, a: Action) -> float:
        if a.op is Op.FORWARD:
            return fwd[s]
        if a.op is Op.BACKWARD:
            return bwd[s]
        return step if a.op is Op.STEP else send

    events = replay(schedule, duration, comm_time=comm)
    return Timeline(schedule, tuple(tuple(e) for e in events))


def bubble_fraction(timeline: Timeline) -> float:
    """Idle share of the stages' time: 1 - (forward + backward time) / (stages x makespan).

    Sends, receives and the step count as idle: they are not the model's work.
    """
    span = timeline.makespan
    if span <= 0:
        return 0.0
    busy = sum(timeline.busy(s) for s in range(timeline.schedule.stages))
    return 1.0 - busy / (timeline.schedule.stages * span)


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    """(S-1)/(m+S-1): the bubble fraction of GPipe and 1F1B with equal stages."""
    return (stages - 1) / (micro_batches + stages - 1)


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward is done and backward not yet.

    The activations a stage keeps for backward scale with this (inputs it received and stashed
    skips included): m for GPipe, min(S-s, m) for 1F1B.
    """
    peaks = []
    for program in schedule.actions:
        live = peak = 0
        for a in program:
            if a.op is Op.FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.op is Op.BACKWARD:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)
