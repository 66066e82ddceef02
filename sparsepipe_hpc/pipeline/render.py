"""Draw a schedule: an ASCII grid of its unit-time run, and a Chrome/Perfetto trace of a timeline.

    print(format_schedule(make_schedule("gpipe", 2, 4)))
    # gpipe: 2 stages x 4 micro-batches, unit-time bubble 0.20
    # stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3
    # stage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 ..
    json.dump(to_chrome_trace(simulate(sched, 1.0, 2.0)), open("trace.json", "w"))

The grid's columns are the time steps of ``simulate(schedule, 1, 1)`` (forward = backward = one
step, messages free); a cell shows the forward (``F3``) or backward (``B3``) running then, ``..``
an idle step. Sends, receives and the step take no time there and are not drawn (``str(schedule)``
lists every action). The trace is the Trace Event Format that chrome://tracing and
ui.perfetto.dev open: one row (tid) per stage, a slice per action, waits for messages as ``wait``.
"""

from __future__ import annotations

from typing import Any

from sparsepipe_hpc.pipeline.schedule import Op, Schedule
from sparsepipe_hpc.pipeline.simulate import Timeline, bubble_fraction, simulate

__all__ = ["format_schedule", "to_chrome_trace"]

_CATEGORY = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.SEND_ACT: "send",
             Op.SEND_GRAD: "send", Op.RECV_ACT: "recv", Op.RECV_GRAD: "recv", Op.STEP: "step"}


def format_schedule(schedule: Schedule) -> str:
    """The unit-time grid of ``schedule``: one row per stage, one column per time step."""
    tl = simulate(schedule, 1.0, 1.0)
    steps = round(tl.makespan)
    cells = [[""] * steps for _ in range(schedule.stages)]
    for s, evs in enumerate(tl.events):
        for e in evs:
            if e.action.op.is_compute:
                cells[s][round(e.start)] = f"{e.action.op.value}{e.action.micro_batch}"
    width = max([2] + [len(c) for row in cells for c in row])
    label = len(str(schedule.stages - 1))
    skips = [e for e in schedule.edges if e[1] > e[0] + 1]
    title = (f"{schedule.kind}: {schedule.stages} stages x {schedule.micro_batches} micro-batches"
             + (f", skips {skips}" if skips else "")
             + f", unit-time bubble {bubble_fraction(tl):.2f}")
    rows = [f"stage {s:>{label}} | " + " ".join((c or "." * width).ljust(width) for c in row)
            for s, row in enumerate(cells)]
    return "\n".join([title] + [r.rstrip() for r in rows])


def to_chrome_trace(timeline: Timeline, time_unit_us: float = 1000.0,
                    process_name: str = "pipeline") -> dict[str, Any]:
    """Trace Event Format dict of ``timeline`` (``json.dump`` it); one time unit = ``time_unit_us``.

    Rows: tid s is stage s. Forward, backward, sends, receives and the step are complete events
    ("X") in categories forward/backward/send/recv/step, with zero-length ones as instants ("i");
    time a receive spends waiting for its message is a "wait" slice in category idle.
    """
    sched = timeline.schedule
    out: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "name": "process_name",
                                  "args": {"name": process_name}}]
    for s in range(sched.stages):
        out.append({"ph": "M", "pid": 0, "tid": s, "name": "thread_name",
                    "args": {"name": f"stage {s}"}})
        out.append({"ph": "M", "pid": 0, "tid": s, "name": "thread_sort_index",
                    "args": {"sort_index": s}})
    for evs in timeline.events:
        for e in evs:
            a = e.action
            args = {"action": e.index, "micro_batch": a.micro_batch, "peer": a.peer}
            if e.start > e.ready:
                out.append({"ph": "X", "pid": 0, "tid": e.stage, "name": "wait", "cat": "idle",
                            "ts": e.ready * time_unit_us,
                            "dur": (e.start - e.ready) * time_unit_us, "args": args})
            event = {"pid": 0, "tid": e.stage, "name": str(a), "cat": _CATEGORY[a.op],
                     "ts": e.start * time_unit_us, "args": args}
            if e.end > e.start:
                event.update(ph="X", dur=(e.end - e.start) * time_unit_us)
            else:
                event.update(ph="i", s="t")
            out.append(event)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"schedule": sched.kind, "stages": sched.stages,
                          "micro_batches": sched.micro_batches,
                          "bubble_fraction": bubble_fraction(timeline)}}
