"""Replay a schedule's per-stage programs under send/receive semantics, without MPI.

    events = replay(sched, duration=lambda stage, action: 1.0)   # events[s]: stage s's Events

The one interpreter behind ``validate`` (deadlock check) and ``simulate`` (timelines). Each stage
runs its actions in order; compute takes ``duration(stage, action)``. Two semantics:

* non-blocking sends (what the executor does): a send completes at once, taking its duration; a
  receive waits until its message was sent and ``comm_time`` has passed since the send ended.
* rendezvous (``blocking_sends=True``, MPI_Ssend-like): a send and its receive happen together,
  once both stages have reached them, and both take ``comm_time``.

The outcome does not depend on the order the stages are visited in: each stage's program is fixed
and every time is the latest of its stage's clock and its message's arrival. If no stage can go on
while some are unfinished, the schedule deadlocks: ``ScheduleError`` names where each one waits.
The caller checks the structure first (``validate``): here every message must have its match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

from sparsepipe_hpc.pipeline.schedule import Action, Op, Schedule, ScheduleError

__all__ = ["Event", "message_key", "replay"]


@dataclass(frozen=True)
class Event:
    """Action ``index`` of ``stage``: reached at ``ready``, started at ``start``, done at ``end``.

    ``start - ready`` is time spent waiting for a message (receives, rendezvous sends).
    """

    stage: int
    index: int
    action: Action
    ready: float
    start: float
    end: float


def message_key(stage: int, action: Action) -> Hashable:
    """(kind, activation edge, micro-batch) of a send or receive; equal exactly when they match."""
    op, p, i = action.op, action.peer, action.micro_batch
    if op is Op.SEND_ACT:
        return ("act", (stage, p), i)
    if op is Op.RECV_ACT:
        return ("act", (p, stage), i)
    if op is Op.SEND_GRAD:
        return ("grad", (p, stage), i)
    if op is Op.RECV_GRAD:
        return ("grad", (stage, p), i)
    raise ValueError(f"{action} is not a send or receive")


def replay(schedule: Schedule, duration: Callable[[int, Action], float],
           comm_time: float = 0.0, blocking_sends: bool = False) -> list[list[Event]]:
    """Run every stage's program; return each stage's events in program order."""
    programs = schedule.actions
    n = len(programs)
    pc = [0] * n
    clock = [0.0] * n
    events: list[list[Event]] = [[] for _ in range(n)]
    sent: dict[Hashable, float] = {}  # message -> time its send ended (non-blocking sends)

    def record(s: int, ready: float, start: float, end: float) -> None:
        events[s].append(Event(s, pc[s], programs[s][pc[s]], ready, start, end))
        clock[s] = end
        pc[s] += 1

    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pc[s] < len(programs[s]):
                action = programs[s][pc[s]]
                op = action.op
                if not (op.is_send or op.is_recv):
                    record(s, clock[s], clock[s], clock[s] + duration(s, action))
                elif blocking_sends:
                    p = action.peer
                    assert p is not None  # checked by validate before any replay
                    if pc[p] >= len(programs[p]):
                        break
                    other = programs[p][pc[p]]
                    if not ((other.op.is_send or other.op.is_recv)
                            and other.op.is_send != op.is_send and other.peer == s
                            and message_key(p, other) == message_key(s, action)):
                        break
                    start = max(clock[s], clock[p])
                    ready_s, ready_p = clock[s], clock[p]
                    record(s, ready_s, start, start + comm_time)
                    record(p, ready_p, start, start + comm_time)
                elif op.is_send:
                    start = clock[s]
                    end = start + duration(s, action)
                    sent[message_key(s, action)] = end
                    record(s, start, start, end)
                else:
                    key = message_key(s, action)
                    if key not in sent:
                        break
                    start = max(clock[s], sent[key] + comm_time)
                    record(s, clock[s], start, start)
                progress = True
    stuck = [s for s in range(n) if pc[s] < len(programs[s])]
    if stuck:
        s0 = stuck[0]
        waits = ", ".join(f"stage {s} at action {pc[s]} ({programs[s][pc[s]]})" for s in stuck)
        mode = "rendezvous" if blocking_sends else "non-blocking"
        raise ScheduleError(f"deadlock under {mode} sends, every unfinished stage waits: {waits}; "
                            f"reorder so that every message is sent before its receiver waits "
                            f"for it", stage=s0, index=pc[s0], rule="deadlock")
    return events
