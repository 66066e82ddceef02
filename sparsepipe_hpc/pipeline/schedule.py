"""Pipeline schedules as per-stage lists of actions, made by one pure function.

    sched = make_schedule("1f1b", stages=4, micro_batches=8, skips=[(0, 3)])
    for action in sched.actions[stage]:   # what the rank(s) of `stage` do, in order
        ...                               # Action(op=Op.RECV_ACT, micro_batch=0, peer=...)

Two schedules, both synchronous (one optimizer step per mini-batch, gradients accumulated over its
micro-batches, so the result equals the unpipelined step):

* ``"gpipe"`` -- fill-drain (GPipe, Huang et al., NeurIPS 2019; torchgpipe, Kim et al. 2020): every
  stage runs all m forwards, then all m backwards. Simple, but every stage holds the activations of
  all m micro-batches at the peak.
* ``"1f1b"`` -- one-forward-one-backward (PipeDream-flush, Narayanan et al., "Memory-Efficient
  Pipeline-Parallel DNN Training", ICML 2021; Megatron-LM's non-interleaved schedule, Narayanan et
  al., SC 2021): stage s runs min(S-s-1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. The same bubble as GPipe, but stage s holds at most
  min(S-s, m) micro-batches' activations instead of m.

Unit-time pictures (``format_schedule``: forward = backward = one step, S = 3, m = 4; ``..`` is
the bubble; 1F1B drains earlier and keeps fewer micro-batches in flight on the first stages)::

    gpipe: 3 stages x 4 micro-batches, unit-time bubble 0.33
    stage 0 | F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
    stage 1 | .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..
    stage 2 | .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..

    1f1b: 3 stages x 4 micro-batches, unit-time bubble 0.33
    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Communication is explicit: a forward of micro-batch i on stage s is preceded by one ``RECV_ACT``
from every stage that feeds s and followed by one ``SEND_ACT`` to every stage s feeds; a backward
is preceded by ``RECV_GRAD`` from every stage s feeds and followed by ``SEND_GRAD`` to every stage
that feeds s. The chain s -> s+1 always exists; ``skips`` add edges a -> b for b > a+1, e.g. a
U-Net encoder level on stage a whose decoder level is on stage b. A skip travels once, directly
from a to b (torchgpipe's stash/pop), never relayed through the stages between, and its gradient
goes back the same way. Several skips between the same two stages are one edge: their tensors
travel in one message per micro-batch (a skip onto the next stage rides with the chain's message).

Send/receive semantics the executor uses (and ``validate`` proves deadlock-free): sends are
non-blocking (post and go on; their completion is waited for before the step's end), a ``RECV_*``
action blocks until its message has arrived. The executor may post the matching receives as early
as it likes (all at the start of the mini-batch): the ``RECV_*`` action marks where it *waits*.
1F1B needs the non-blocking sends: with rendezvous sends the steady state deadlocks (stage s sends
an activation to s+1 while s+1 sends a gradient to s), which is why Megatron batches them.

Each stage list ends with one ``STEP``: all-reduce the stage's parameter gradients over the ranks
that hold copies (spatial and data replicas of that stage), then step its optimizer. Stages step
independently; a stage's gradients are complete after its last backward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["KINDS", "Op", "Action", "Schedule", "ScheduleError", "make_schedule", "make_edges"]

KINDS = ("gpipe", "1f1b")


class ScheduleError(ValueError):
    """A schedule (or a request for one) that breaks a rule; names the stage and action index."""

    def __init__(self, message: str, stage: Optional[int] = None, index: Optional[int] = None,
                 rule: str = ""):
        where = "" if stage is None else (f"stage {stage}" if index is None
                                          else f"stage {stage}, action {index}")
        super().__init__(f"{where}: {message}" if where else message)
        self.stage, self.index, self.rule = stage, index, rule


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    STEP = "STEP"

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACT, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of a stage's program.

    ``micro_batch`` is the micro-batch index (0..m-1; None for ``STEP``); ``peer`` is the other
    stage of a send or receive (None for compute and ``STEP``). The edge a message travels on is
    (stage, peer) for ``SEND_ACT``, (peer, stage) for ``RECV_ACT``, and for gradients the edge of
    the activation they belong to: (peer, stage) for ``SEND_GRAD``, (stage, peer) for ``RECV_GRAD``.
    ``str`` gives ``F3``, ``B3``, ``SA3>2`` (send activation of 3 to stage 2), ``RA3<0``, ``SG3>0``,
    ``RG3<2``, ``STEP``.
    """

    op: Op
    micro_batch: Optional[int] = None
    peer: Optional[int] = None

    def __str__(self) -> str:
        if self.op is Op.STEP:
            return "STEP"
        text = f"{self.op.value}{self.micro_batch}"
        if self.peer is not None:
            text += (">" if self.op.is_send else "<") + str(self.peer)
        return text


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists: ``actions[s]`` is stage s's program, run in order.

    ``edges`` are the activation edges (src, dst), src < dst: the chain (s, s+1) and the skips,
    sorted and without repeats. ``make_schedule`` builds valid ones; hand-built ones (tests, other
    schedules) are checked by ``validate``.
    """

    kind: str
    stages: int
    micro_batches: int
    edges: tuple[tuple[int, int], ...]
    actions: tuple[tuple[Action, ...], ...]

    def producers(self, stage: int) -> tuple[int, ...]:
        """Stages whose activations stage ``stage`` consumes, ascending."""
        return tuple(a for a, b in self.edges if b == stage)

    def consumers(self, stage: int) -> tuple[int, ...]:
        """Stages that consume stage ``stage``'s activations, ascending."""
        return tuple(b for a, b in self.edges if a == stage)

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: " + " ".join(map(str, acts))
                         for s, acts in enumerate(self.actions))


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be a positive integer; got {value!r}", rule="input")
    return value


def make_edges(stages: int, skips: Iterable[Sequence[int]] = ()) -> tuple[tuple[int, int], ...]:
    """The chain (s, s+1) plus ``skips`` as (src, dst) pairs, checked, sorted, without repeats."""
    edges = {(s, s + 1) for s in range(stages - 1)}
    for pair in skips:
        try:
            a, b = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise ScheduleError(f"skip {pair!r} must be a pair (src_stage, dst_stage) of integers",
                                rule="input") from None
        if not (0 <= a < stages and 0 <= b < stages):
            raise ScheduleError(f"skip ({a}, {b}) names a stage outside 0..{stages - 1} "
                                f"({stages} stage(s))", rule="input")
        if b <= a:
            raise ScheduleError(f"skip ({a}, {b}) must go forward, from an earlier stage to a "
                                f"later one (src < dst)", rule="input")
        edges.add((a, b))
    return tuple(sorted(edges))


def compute_order(kind: str, stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The order of FORWARD and BACKWARD actions of one stage under schedule ``kind``."""
    m = micro_batches
    if kind == "gpipe":
        # Backwards in micro-batch order (like torch.distributed.pipelining); torchgpipe's autograd
        # runs them in reverse. The bubble and the peak memory are the same either way.
        return ([Action(Op.FORWARD, i) for i in range(m)]
                + [Action(Op.BACKWARD, i) for i in range(m)])
    warmup = min(stages - stage - 1, m)
    order = [Action(Op.FORWARD, i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [Action(Op.FORWARD, warmup + k), Action(Op.BACKWARD, k)]
    order += [Action(Op.BACKWARD, i) for i in range(m - warmup, m)]
    return order


def make_schedule(kind: str, stages: int, micro_batches: int,
                  skips: Iterable[Sequence[int]] = ()) -> Schedule:
    """The ``kind`` schedule ("gpipe" or "1f1b") of ``micro_batches`` over ``stages`` stages.

    ``skips``: extra activation edges (src_stage, dst_stage) besides the chain, src < dst.
    Pure: the same arguments give the same schedule on every rank.
    """
    if not isinstance(kind, str) or kind.lower() not in KINDS:
        raise ScheduleError(f"schedule kind must be one of {', '.join(KINDS)}; got {kind!r}",
                            rule="input")
    kind = kind.lower()
    stages = _positive_int("stages", stages)
    micro_batches = _positive_int("micro_batches", micro_batches)
    edges = make_edges(stages, skips)
    actions = []
    for s in range(stages):
        srcs = [a for a, b in edges if b == s]
        dsts = [b for a, b in edges if a == s]
        program: list[Action] = []
        for act in compute_order(kind, stages, micro_batches, s):
            i = act.micro_batch
            if act.op is Op.FORWARD:
                program += [Action(Op.RECV_ACT, i, p) for p in srcs]
                program.append(act)
                program += [Action(Op.SEND_ACT, i, d) for d in dsts]
            else:
                # The time-reverse of the forward's order, so that fill-drain stays deadlock-free
                # even with rendezvous sends (tests check it).
                program += [Action(Op.RECV_GRAD, i, d) for d in reversed(dsts)]
                program.append(act)
                program += [Action(Op.SEND_GRAD, i, p) for p in reversed(srcs)]
        program.append(Action(Op.STEP))
        actions.append(tuple(program))
    return Schedule(kind, stages, micro_batches, edges, tuple(actions))
