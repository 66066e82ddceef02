"""Pipeline schedules without MPI: generator properties, golden grids, timelines, broken schedules."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsepipe_hpc.pipeline import (KINDS, Action, Op, Schedule, ScheduleError, bubble_fraction,
                                     format_schedule, make_schedule, peak_activations, simulate,
                                     theoretical_bubble, to_chrome_trace, validate)

F, B, SA, RA, SG, RG, STEP = (Op.FORWARD, Op.BACKWARD, Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD,
                              Op.RECV_GRAD, Op.STEP)


@st.composite
def schedules(draw, kinds=KINDS, max_stages=6, max_micro=12):
    """(kind, S, m, skips, schedule) with skips drawn from every pair (a, b), b > a + 1."""
    kind = draw(st.sampled_from(kinds))
    S = draw(st.integers(1, max_stages))
    m = draw(st.integers(1, max_micro))
    pairs = [(a, b) for a in range(S) for b in range(a + 2, S)]
    skips = draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    return kind, S, m, skips, make_schedule(kind, S, m, skips)


def with_program(sched: Schedule, stage: int, program) -> Schedule:
    actions = list(sched.actions)
    actions[stage] = tuple(program)
    return dataclasses.replace(sched, actions=tuple(actions))


def parse(text: str) -> tuple[Action, ...]:
    """'F0 SA0>1 RG0<1 B0 STEP' -> actions (the inverse of str(Action))."""
    out = []
    for tok in text.split():
        if tok == "STEP":
            out.append(Action(STEP))
            continue
        peer = None
        for sep in "<>":
            if sep in tok:
                tok, p = tok.split(sep)
                peer = int(p)
        code = tok.rstrip("0123456789")
        out.append(Action(Op(code), int(tok[len(code):]), peer))
    return tuple(out)


# --- generator properties -------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(schedules())
def test_generated_schedules_validate_and_have_the_right_counts(case):
    kind, S, m, skips, sched = case
    validate(sched)
    edges = {(s, s + 1) for s in range(S - 1)} | set(skips)
    assert set(sched.edges) == edges and len(sched.actions) == S
    for s, program in enumerate(sched.actions):
        c = Counter((a.op, a.peer) for a in program)
        assert c[(F, None)] == c[(B, None)] == m and c[(STEP, None)] == 1
        assert program[-1] == Action(STEP)
        for p in sched.producers(s):
            assert c[(RA, p)] == c[(SG, p)] == m
        for d in sched.consumers(s):
            assert c[(SA, d)] == c[(RG, d)] == m
        # nothing else: a skip's message goes straight from its source to its target stage
        assert sum(c.values()) == 2 * m + 1 + 2 * m * (len(sched.producers(s))
                                                        + len(sched.consumers(s)))
        peers = {a.peer for a in program if a.peer is not None}
        assert peers == set(sched.producers(s)) | set(sched.consumers(s))
    sends = sum(a.op is SA for p in sched.actions for a in p)
    assert sends == m * len(edges)


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_peak_activations_gpipe_m_and_1f1b_at_most_stages_left(case):
    kind, S, m, _, sched = case
    peaks = peak_activations(sched)
    if kind == "gpipe":
        assert peaks == (m,) * S
    else:
        assert peaks == tuple(min(S - s, m) for s in range(S))
        assert all(p <= S - s for s, p in enumerate(peaks))


@settings(max_examples=200, deadline=None)
@given(schedules(), st.floats(0.25, 4.0), st.floats(0.25, 4.0))
def test_bubble_of_equal_stages_is_the_textbook_value(case, fwd, bwd):
    # (S-1)/(m+S-1) for both schedules, with any forward/backward ratio, as long as all stages
    # take the same time; skips never add waiting (their data also travels the chain's path).
    kind, S, m, _, sched = case
    tl = simulate(sched, fwd, bwd)
    assert bubble_fraction(tl) == pytest.approx(theoretical_bubble(S, m), abs=1e-12)
    assert tl.makespan == pytest.approx((m + S - 1) * (fwd + bwd))


def test_unit_time_bubble_of_gpipe_for_all_sizes():
    for S in range(1, 7):
        for m in range(1, 13):
            tl = simulate(make_schedule("gpipe", S, m), 1.0, 1.0)
            assert bubble_fraction(tl) == pytest.approx((S - 1) / (m + S - 1), abs=1e-12)
            assert tl.makespan == 2 * (m + S - 1)


@settings(max_examples=100, deadline=None)
@given(schedules())
def test_send_semantics_gpipe_survives_rendezvous_1f1b_needs_nonblocking_sends(case):
    kind, S, m, _, sched = case
    if kind == "gpipe" or S == 1 or m == 1:
        validate(sched, sends="blocking")
    else:
        with pytest.raises(ScheduleError, match="deadlock under rendezvous sends") as err:
            validate(sched, sends="blocking")
        assert err.value.rule == "deadlock"


@settings(max_examples=200, deadline=None)
@given(schedules(max_stages=3, max_micro=3), st.data())
def test_shuffled_programs_fail_only_with_schedule_error(case, data):
    # Any reordering of one stage's program is either valid (and then simulates) or rejected with
    # a ScheduleError, never an unexplained exception or a hang.
    _, S, m, _, sched = case
    s = data.draw(st.integers(0, S - 1))
    program = data.draw(st.permutations(sched.actions[s]))
    broken = with_program(sched, s, program)
    try:
        validate(broken)
    except ScheduleError as e:
        assert e.rule in {"order", "step", "deadlock", "complete"} and str(e)
    else:
        assert simulate(broken).makespan > 0


# --- golden schedules -----------------------------------------------------------------------------

def test_golden_grids_two_stages_four_micro_batches():
    assert format_schedule(make_schedule("gpipe", 2, 4)) == (
        "gpipe: 2 stages x 4 micro-batches, unit-time bubble 0.20\n"
        "stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3\n"
        "stage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 ..")
    assert format_schedule(make_schedule("1f1b", 2, 4)) == (
        "1f1b: 2 stages x 4 micro-batches, unit-time bubble 0.20\n"
        "stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3\n"
        "stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 ..")


def test_golden_grid_with_a_skip_and_wide_cells():
    assert format_schedule(make_schedule("1f1b", 3, 11, skips=[(0, 2)])).splitlines()[:2] == [
        "1f1b: 3 stages x 11 micro-batches, skips [(0, 2)], unit-time bubble 0.15",
        "stage 0 | F0  F1  F2  ... ... B0  F3  B1  F4  B2  F5  B3  F6  B4  F7  B5  F8  B6  F9  "
        "B7  F10 B8  ... B9  ... B10"]


def test_golden_action_lists_with_a_skip():
    # Communication order: receives before the compute, sends after it; backward mirrors forward.
    assert str(make_schedule("1f1b", 3, 2, skips=[(0, 2)])) == (
        "stage 0: F0 SA0>1 SA0>2 F1 SA1>1 SA1>2 RG0<2 RG0<1 B0 RG1<2 RG1<1 B1 STEP\n"
        "stage 1: RA0<0 F0 SA0>2 RA1<0 F1 SA1>2 RG0<2 B0 SG0>0 RG1<2 B1 SG1>0 STEP\n"
        "stage 2: RA0<0 RA0<1 F0 B0 SG0>1 SG0>0 RA1<0 RA1<1 F1 B1 SG1>1 SG1>0 STEP")
    assert parse(str(make_schedule("gpipe", 2, 2)).splitlines()[1][len("stage 1: "):]) == \
        make_schedule("gpipe", 2, 2).actions[1]


# --- timelines and traces ---------------------------------------------------------------------------

def test_unequal_stages_by_hand():
    # stage 0: F0 [0,1] F1 [1,2]            B0 [7,8]    B1 [9,10]
    # stage 1:      F0 [1,3] F1 [3,5] B0 [5,7] B1 [7,9]
    tl = simulate(make_schedule("gpipe", 2, 2), fwd_time=[1, 2], bwd_time=[1, 2])
    got = {(e.stage, str(e.action)): (e.start, e.end) for evs in tl.events for e in evs
           if e.action.op.is_compute}
    assert got == {(0, "F0"): (0, 1), (0, "F1"): (1, 2), (0, "B0"): (7, 8), (0, "B1"): (9, 10),
                   (1, "F0"): (1, 3), (1, "F1"): (3, 5), (1, "B0"): (5, 7), (1, "B1"): (7, 9)}
    assert tl.makespan == 10 and bubble_fraction(tl) == pytest.approx(1 - 12 / 20)


def test_comm_time_delays_the_receiver():
    tl = simulate(make_schedule("gpipe", 2, 1), 1.0, 1.0, comm_time=0.5)
    recv = tl.events[1][0]
    assert str(recv.action) == "RA0<0" and (recv.ready, recv.start) == (0.0, 1.5)
    assert tl.makespan == 5.0   # F 0-1, arrive 1.5, F 1.5-2.5, B 2.5-3.5, arrive 4, B 4-5


@pytest.mark.parametrize("kwargs, msg", [
    (dict(fwd_time=[1, 1, 1]), "fwd_time has 3 value\\(s\\) but the schedule has 2 stage"),
    (dict(bwd_time=-1.0), "bwd_time\\[0\\] must be a finite number >= 0; got -1.0"),
    (dict(comm_time=float("nan")), "comm_time must be a finite number >= 0; got nan"),
])
def test_simulate_refuses_bad_times(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        simulate(make_schedule("gpipe", 2, 2), **kwargs)


def test_chrome_trace_has_one_row_per_stage_and_no_overlap():
    sched = make_schedule("1f1b", 3, 4, skips=[(0, 2)])
    trace = to_chrome_trace(simulate(sched, 1.0, 2.0, comm_time=0.1), time_unit_us=1000.0)
    json.dumps(trace)   # serializable as is
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    compute = [e for e in events if e.get("cat") in ("forward", "backward")]
    assert len(compute) == 2 * 4 * 3 and all(e["ph"] == "X" for e in compute)
    assert {round(e["dur"], 6) for e in compute} == {1000.0, 2000.0}
    assert any(e["cat"] == "idle" and e["name"] == "wait" for e in events if "cat" in e)
    for s in range(3):
        slices = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                        if e.get("ph") == "X" and e["tid"] == s)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(slices, slices[1:]))
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(
        bubble_fraction(simulate(sched, 1.0, 2.0, comm_time=0.1)))


# --- bad requests and broken schedules -------------------------------------------------------------

@pytest.mark.parametrize("args, msg", [
    (("zb", 2, 2), "schedule kind must be one of gpipe, 1f1b; got 'zb'"),
    (("gpipe", 0, 2), "stages must be a positive integer; got 0"),
    (("1f1b", 2, True), "micro_batches must be a positive integer; got True"),
    (("1f1b", 3, 2, [(2, 1)]), "skip \\(2, 1\\) must go forward"),
    (("1f1b", 3, 2, [(0, 3)]), "skip \\(0, 3\\) names a stage outside 0..2"),
    (("1f1b", 3, 2, [(0,)]), "skip \\(0,\\) must be a pair"),
])
def test_make_schedule_refuses_bad_requests(args, msg):
    with pytest.raises(ScheduleError, match=msg):
        make_schedule(*args)


def test_skip_onto_the_next_stage_and_repeats_are_one_edge():
    assert make_schedule("gpipe", 3, 2, [(0, 1), (0, 2), (0, 2)]).edges == ((0, 1), (0, 2), (1, 2))


def broken(kind, S, m, stage, text):
    return with_program(make_schedule(kind, S, m), stage, parse(text))


@pytest.mark.parametrize("sched, stage, index, rule, msg", [
    # missing receive: stage 1 never receives micro-batch 1's activation
    (broken("gpipe", 2, 2, 1, "RA0<0 F0 F1 B0 SG0>0 B1 SG1>0 STEP"), 0, 3,
     "match", "SA1>1 is never received: stage 1 has no RECV_ACT of micro-batch 1 from stage 0"),
    # missing send and receive of one micro-batch: the forward lacks its input
    (dataclasses.replace(
        make_schedule("gpipe", 2, 2), actions=(parse("F0 SA0>1 F1 RG0<1 B0 RG1<1 B1 STEP"),
                 parse("RA0<0 F0 F1 B0 SG0>0 B1 SG1>0 STEP"))), 0, 2,
     "complete", "F1 needs SEND_ACT of micro-batch 1 to stage 1 after it, but stage 0 has none; "
                 "edge \\(0, 1\\) carries"),
    # a micro-batch that never runs backward
    (broken("gpipe", 1, 2, 0, "F0 F1 B0 STEP"), 0, None,
     "complete", "stage 0: micro-batch 1 has no BACKWARD; every micro-batch runs forward and "
                 "backward once on every stage"),
    # backward before forward
    (broken("gpipe", 2, 1, 1, "RA0<0 B0 F0 SG0>0 STEP"), 1, 2,
     "order", "F0 \\(action 2\\) must come before B0 \\(action 1\\): a micro-batch's forward"),
    # forward before its input arrived
    (broken("gpipe", 2, 1, 1, "F0 RA0<0 B0 SG0>0 STEP"), 1, 1,
     "order", "RA0<0 \\(action 1\\) must come before F0 \\(action 0\\): a forward needs its input"),
    # crossing receives: each stage waits for a message the other sends only afterwards
    (broken("gpipe", 2, 2, 0, "F0 SA0>1 F1 RG0<1 SA1>1 B0 RG1<1 B1 STEP"), 0, 3,
     "deadlock", "deadlock under non-blocking sends, every unfinished stage waits: stage 0 at "
                 "action 3 \\(RG0<1\\), stage 1 at action 2 \\(RA1<0\\)"),
    (broken("gpipe", 2, 2, 1, "RA0<0 F0 F0 RA1<0 F1 B0 SG0>0 B1 SG1>0 STEP"), 1, 2,
     "once", "F0 appears twice \\(first at action 1\\)"),
    (broken("gpipe", 2, 1, 0, "F0 SA0>1 RG0<1 B0"), 0, None,
     "step", "stage 0: has 0 STEP action\\(s\\)"),
    (broken("gpipe", 2, 1, 0, "F0 SA0>1 STEP RG0<1 B0"), 0, 2,
     "step", "STEP comes before B0 \\(action 4\\)"),
    (broken("gpipe", 2, 1, 0, "F0 SA0>1 RG0<1 B0 B5 STEP"), 0, 4,
     "action", "B5: micro-batch 5 is outside 0..0"),
    (broken("gpipe", 3, 1, 0, "F0 SA0>1 SA0>2 RG0<1 B0 STEP"), 0, 2,
     "action", "SEND_ACT names peer 2, but the stages that consume stage 0's activations are "
               "\\[1\\]"),
    (dataclasses.replace(make_schedule("gpipe", 2, 1), stages=3), None, None,
     "shape", "the schedule has 3 stage\\(s\\) but 2 program\\(s\\)"),
    (dataclasses.replace(make_schedule("gpipe", 3, 1), edges=((0, 1),)), None, None,
     "shape", "edges lack the chain edge\\(s\\) \\[\\(1, 2\\)\\]"),
])
def test_broken_schedules_are_rejected_naming_stage_action_and_rule(sched, stage, index, rule, msg):
    with pytest.raises(ScheduleError, match=msg) as err:
        validate(sched)
    assert (err.value.stage, err.value.index, err.value.rule) == (stage, index, rule)
    where = "" if stage is None else (f"stage {stage}: " if index is None
                                      else f"stage {stage}, action {index}: ")
    assert str(err.value).startswith(where)
    with pytest.raises(ScheduleError):
        simulate(sched)   # timelines are only made of valid schedules


def test_crossing_rendezvous_sends_deadlock_but_nonblocking_ones_do_not():
    # Each stage sends first, then receives: fine when sends do not wait, a deadlock when they do.
    sched = dataclasses.replace(make_schedule("gpipe", 2, 1), actions=(
        parse("F0 SA0>1 RG0<1 B0 STEP"), parse("RA0<0 F0 B0 SG0>0 STEP")))
    validate(sched)
    crossing = dataclasses.replace(make_schedule("1f1b", 2, 2), actions=(
        parse("F0 SA0>1 F1 SA1>1 RG0<1 B0 RG1<1 B1 STEP"),
        parse("RA0<0 F0 B0 SG0>0 RA1<0 F1 B1 SG1>0 STEP")))
    validate(crossing)
    with pytest.raises(ScheduleError, match="deadlock under rendezvous sends, every unfinished "
                                            "stage waits: stage 0 at action 3 \\(SA1>1\\), "
                                            "stage 1 at action 3 \\(SG0>0\\)"):
        validate(crossing, sends="blocking")
    with pytest.raises(ValueError, match="sends must be one of"):
        validate(crossing, sends="eager")
