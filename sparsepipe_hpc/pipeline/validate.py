"""Check a pipeline schedule without MPI: structure, matching, order, and freedom from deadlock.

    from sparsepipe_hpc.pipeline import make_schedule, validate
    validate(make_schedule("1f1b", 4, 8))                  # returns None or raises ScheduleError
    validate(sched, sends="blocking")                      # also safe with rendezvous sends?

Rules, checked in this order; the first broken one raises ``ScheduleError`` naming the stage, the
action index and the rule (``err.stage``, ``err.index``, ``err.rule``):

1. ``shape``: one program per stage, edges (src < dst) inside the stages and containing the chain.
2. ``action``: micro-batch indices in 0..m-1; compute has no peer; a send or receive names a peer
   joined to its stage by an edge in the right direction.
3. ``once``: no action twice on a stage (every micro-batch runs forward and backward once).
4. ``match``: every send has exactly one receive of the same (micro-batch, edge, kind) on its peer
   and every receive has its send.
5. ``complete`` / ``order`` per stage and micro-batch: the activation from every producing stage
   received before the forward; activations sent to every consuming stage after the forward; the
   forward before the backward; the gradient from every consuming stage received before the
   backward; gradients sent to every producing stage after it.
6. ``step``: exactly one STEP, after every backward of its stage.
7. ``deadlock``: replaying all stages together (non-blocking sends and blocking receives, the
   executor's semantics; or rendezvous sends with ``sends="blocking"``) finishes every program.
"""

from __future__ import annotations

from sparsepipe_hpc.pipeline.replay import replay
from sparsepipe_hpc.pipeline.schedule import Action, Op, Schedule, ScheduleError

__all__ = ["validate", "SEND_SEMANTICS"]

SEND_SEMANTICS = ("nonblocking", "blocking")


def _check_shape(sched: Schedule) -> None:
    S, m = sched.stages, sched.micro_batches
    if not (isinstance(S, int) and S >= 1 and isinstance(m, int) and m >= 1):
        raise ScheduleError(f"stages and micro_batches must be positive integers; got {S!r} and "
                            f"{m!r}", rule="shape")
    if len(sched.actions) != S:
        raise ScheduleError(f"the schedule has {S} stage(s) but {len(sched.actions)} program(s); "
                            f"give one action list per stage", rule="shape")
    for a, b in sched.edges:
        if not (0 <= a < b < S):
            raise ScheduleError(f"edge ({a}, {b}) must join two stages in 0..{S - 1} with "
                                f"src < dst", rule="shape")
    missing = [(s, s + 1) for s in range(S - 1) if (s, s + 1) not in sched.edges]
    if missing:
        raise ScheduleError(f"edges lack the chain edge(s) {missing}; every stage feeds the next",
                            rule="shape")


def _check_action(sched: Schedule, s: int, k: int, a: Action) -> None:
    def bad(msg: str) -> ScheduleError:
        return ScheduleError(f"{a!s}: {msg}", stage=s, index=k, rule="action")

    if not isinstance(a, Action) or not isinstance(a.op, Op):
        raise ScheduleError(f"{a!r} is not an Action", stage=s, index=k, rule="action")
    if a.op is Op.STEP:
        if a.micro_batch is not None or a.peer is not None:
            raise bad("STEP takes no micro-batch and no peer")
        return
    i = a.micro_batch
    if not isinstance(i, int) or not 0 <= i < sched.micro_batches:
        raise bad(f"micro-batch {i!r} is outside 0..{sched.micro_batches - 1}")
    if a.op.is_compute:
        if a.peer is not None:
            raise bad(f"{a.op.name} takes no peer; got peer {a.peer}")
        return
    p = a.peer
    allowed = {Op.SEND_ACT: sched.consumers(s), Op.RECV_GRAD: sched.consumers(s),
               Op.RECV_ACT: sched.producers(s), Op.SEND_GRAD: sched.producers(s)}[a.op]
    if p not in allowed:
        role = "consume" if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else "produce"
        raise bad(f"{a.op.name} names peer {p!r}, but the stages that {role} stage {s}'s "
                  f"activations are {list(allowed)} (edges {list(sched.edges)})")


def _positions(sched: Schedule) -> list[dict[Action, int]]:
    """Per stage: action -> its index, refusing repeats."""
    out = []
    for s, program in enumerate(sched.actions):
        seen: dict[Action, int] = {}
        for k, a in enumerate(program):
            _check_action(sched, s, k, a)
            if a in seen:
                raise ScheduleError(f"{a} appears twice (first at action {seen[a]}); each action "
                                    f"runs once per stage", stage=s, index=k, rule="once")
            seen[a] = k
        out.append(seen)
    return out


def _check_matching(sched: Schedule, pos: list[dict[Action, int]]) -> None:
    mirror = {Op.SEND_ACT: Op.RECV_ACT, Op.RECV_ACT: Op.SEND_ACT,
              Op.SEND_GRAD: Op.RECV_GRAD, Op.RECV_GRAD: Op.SEND_GRAD}
    for s, program in enumerate(sched.actions):
        for k, a in enumerate(program):
            if a.op in mirror:
                assert a.peer is not None  # _check_action ran
                twin = Action(mirror[a.op], a.micro_batch, s)
                if twin not in pos[a.peer]:
                    what = "is never received" if a.op.is_send else "is never sent"
                    raise ScheduleError(
                        f"{a} {what}: stage {a.peer} has no {twin.op.name} of micro-batch "
                        f"{a.micro_batch} {'from' if twin.op.is_recv else 'to'} stage {s}; every "
                        f"send needs exactly one matching receive", stage=s, index=k, rule="match")


def _check_order(sched: Schedule, s: int, pos: dict[Action, int]) -> None:
    def need(a: Action, where: str, anchor: Action, why: str) -> None:
        ka, k = pos[anchor], pos.get(a)
        if k is None:
            assert a.peer is not None  # F and B were found above
            edge = (s, a.peer) if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else (a.peer, s)
            raise ScheduleError(f"{anchor} needs {a.op.name} of micro-batch {a.micro_batch} "
                                f"{'to' if a.op.is_send else 'from'} stage {a.peer} {where} it, "
                                f"but stage {s} has none; edge {edge} carries every "
                                f"micro-batch's activation forward and its gradient back",
                                stage=s, index=ka, rule="complete")
        if (k > ka) != (where == "after"):
            raise ScheduleError(f"{a} (action {k}) must come {where} {anchor} (action {ka}): "
                                f"{why}", stage=s, index=k, rule="order")

    for i in range(sched.micro_batches):
        f, b = Action(Op.FORWARD, i), Action(Op.BACKWARD, i)
        for anchor in (f, b):
            if anchor not in pos:
                raise ScheduleError(f"micro-batch {i} has no {anchor.op.name}; every micro-batch "
                                    f"runs forward and backward once on every stage",
                                    stage=s, rule="complete")
        need(f, "before", b, "a micro-batch's forward comes before its backward")
        for p in sched.producers(s):
            need(Action(Op.RECV_ACT, i, p), "before", f, "a forward needs its input")
            need(Action(Op.SEND_GRAD, i, p), "after", b,
                 "an input's gradient exists once the backward ran")
        for d in sched.consumers(s):
            need(Action(Op.SEND_ACT, i, d), "after", f, "an activation exists once the forward ran")
            need(Action(Op.RECV_GRAD, i, d), "before", b, "a backward needs its output's gradient")


def _check_step(sched: Schedule, s: int, program: tuple[Action, ...]) -> None:
    steps = [k for k, a in enumerate(program) if a.op is Op.STEP]
    if len(steps) != 1:
        raise ScheduleError(f"has {len(steps)} STEP action(s); a stage steps exactly once per "
                            f"mini-batch", stage=s, index=steps[1] if steps else None, rule="step")
    last_b = max(k for k, a in enumerate(program) if a.op is Op.BACKWARD)
    if steps[0] < last_b:
        raise ScheduleError(f"STEP comes before {program[last_b]} (action {last_b}); the "
                            f"optimizer steps after every backward of its stage",
                            stage=s, index=steps[0], rule="step")


def validate(schedule: Schedule, sends: str = "nonblocking") -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is complete, ordered and deadlock-free.

    ``sends``: "nonblocking" (the executor's semantics: sends never wait, receives block) or
    "blocking" (rendezvous: a send waits for its receive).
    """
    if sends not in SEND_SEMANTICS:
        raise ValueError(f"sends must be one of {SEND_SEMANTICS}; got {sends!r}")
    _check_shape(schedule)
    pos = _positions(schedule)
    _check_matching(schedule, pos)
    for s, program in enumerate(schedule.actions):
        _check_order(schedule, s, pos[s])
        _check_step(schedule, s, program)
    replay(schedule, lambda s, a: 1.0 if a.op.is_compute else 0.0,
           blocking_sends=sends == "blocking")

