"""sparsepipe_hpc.tracing without MPI: spans, the active recorder, the Chrome trace rows."""

from __future__ import annotations

import json

import pytest

from sparsepipe_hpc.tracing import Recorder, Span, recording, span, to_chrome_trace


def fake_clock():
    t = iter(range(100))
    return lambda: float(next(t))


def test_spans_nest_and_record_only_while_active():
    rec = Recorder(clock=fake_clock())          # zero = 0
    with span("lost", "forward"):               # nothing active: not recorded
        pass
    with recording(rec):
        with span("F0", "forward", micro_batch=0):   # 1 .. 4
            with span("halo wait", "halo"):          # 2 .. 3
                pass
        with pytest.raises(RuntimeError):
            with span("B0", "backward"):             # 5 .. 6, recorded although it raised
                raise RuntimeError("boom")
        with recording(None):
            with span("lost", "forward"):
                pass
        with span("STEP", "step"):                   # 7 .. 8: the outer recorder is back
            pass
    assert [(s.name, s.start, s.end) for s in rec.spans] == [
        ("halo wait", 2.0, 3.0), ("F0", 1.0, 4.0), ("B0", 5.0, 6.0), ("STEP", 7.0, 8.0)]
    assert rec.spans[1].args == {"micro_batch": 0}


def test_a_cuda_recorder_waits_for_the_compute_stream_at_every_clock_reading(monkeypatch):
    """On CUDA a span must end after the kernels it launched ran, not when they were queued; the
    queue is drained before the barrier, so a rank's backlog does not shift its zero."""
    import time

    import torch

    now = [0.0]
    waited = []

    class Stream:
        def synchronize(self):  # the queued kernels take 5 s, then the stream is idle
            now[0] += 5.0 if not waited else 0.0
            waited.append(now[0])

    class Comm:
        def Barrier(self):
            assert waited, "the stream must be drained before the barrier"
            now[0] += 1.0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    rec = Recorder.start(Comm(), device=torch.device("cuda", 1))
    assert rec.zero == 6.0                       # the barrier's end, after the 5 s drained
    with recording(rec), span("F0", "forward"):
        now[0] += 2.0
    assert len(waited) == 4 and rec.spans[0].end == 2.0
    Recorder.start(device=torch.device("cpu")).clock()
    assert len(waited) == 4                     # a CPU recorder never asks CUDA


def test_chrome_trace_has_a_row_per_rank_and_outer_spans_first():
    rows = [[Span("halo wait", "halo", 2.0, 3.0), Span("F0", "forward", 2.0, 4.0)],
            [Span("RA0<0", "recv", 0.0, 1.5)]]
    trace = json.loads(json.dumps(to_chrome_trace(rows, ["stage 0", "stage 1"])))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    xs = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs == [(0, "F0", 2e6, 2e6), (0, "halo wait", 2e6, 1e6), (1, "RA0<0", 0.0, 1.5e6)]
    with pytest.raises(ValueError, match="labels has 1 entries but there are 2 rows"):
        to_chrome_trace(rows, ["x"])


def test_spans_and_profiled_blocks_are_ranges_in_a_torch_profile_only():
    """Under torch's profiler a span and a profiled block are ``record_function`` ranges (also
    while no recorder is active); outside one, a profiled block is a bare context."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparsepipe_hpc.tracing import profiled

    assert isinstance(profiled("x"), contextlib.nullcontext)
    rec = Recorder(clock=iter(range(10)).__next__)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with span("idle span", "idle") as info:
            info["bytes"] = 1
            with recording(rec), span("recorded", "halo"), profiled("part"):
                torch.ones(2).sum()
    ranges = {e.name for e in prof.events() if getattr(e, "is_user_annotation", False)}
    assert ranges == {"idle span", "recorded", "part"}
    assert [(s.name, s.cat) for s in rec.spans] == [("recorded", "halo")]
