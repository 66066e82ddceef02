"""Measured wall-clock spans of what each rank does, gathered into one Chrome/Perfetto trace.

    rec = Recorder.start(comm)                      # collective: a barrier, then time zero
    with recording(rec):                            # instrumented code now records
        with span("F0", "forward", micro_batch=0):
            ...
    trace = gather_chrome_trace(rec, comm, label=f"rank {comm.rank}")   # collective
    if trace is not None:                           # rank 0
        json.dump(trace, open("trace.json", "w"))

Instrumented places (the pipeline executor's actions, the spatial halo-exchange wait, the
trainer's all-reduce) call :func:`span`, which costs one global lookup and a check of torch's
profiler while nothing records, so the hooks stay in the code. Under torch's profiler a span is
also a ``record_function`` range, as is each :func:`profiled` block (the parts of a distributed
convolution): a profile then puts a kernel or a blocking CUDA call down to the part that made
it, also in backward, whose Python frames the profiler does not see (``bench gpu``'s
``sync_sites``). Spans may nest (a halo wait inside a forward); those that follow one another on
a rank never overlap, since a rank runs one thing at a time. Gaps between top-level spans are
idle time. Times are seconds since a barrier every rank left together (Recorder.start), so rows
line up to within the barrier's skew. The trace is the Trace Event Format that chrome://tracing
and ui.perfetto.dev open: one row (tid) per rank, one complete event ("X") per
span, its category (forward, backward, send, recv, step, allreduce, halo, ...) as ``cat``.
(sparsepipe_hpc.pipeline.render draws the *simulated* timeline of a schedule the same way.)
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.profiler import record_function

__all__ = ["Span", "Recorder", "recording", "span", "profiled", "profiling", "to_chrome_trace",
           "gather_chrome_trace"]


@dataclass(frozen=True)
class Span:
    """One measured interval: ``start``/``end`` in seconds since the recorder's zero."""

    name: str
    cat: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Collects this rank's spans; ``clock`` returns seconds (default time.perf_counter)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.zero = clock()
        self.spans: list[Span] = []

    @classmethod
    def start(cls, comm: Any = None, device: Any = None) -> "Recorder":
        """A recorder whose zero is the end of a barrier over ``comm`` (collective), so every
        rank's times share an origin; ``comm=None``: now. On a CUDA ``device`` (a torch.device)
        each clock reading first waits for the work queued so far on the current (compute)
        stream, so a span holds the kernels it launched rather than only their launch; tracing
        then stops the host from running ahead of the GPU, and a traced step is slower. The
        communication streams are not waited for: their transfers stay overlapped."""
        clock: Callable[[], float] = time.perf_counter
        if device is not None and device.type == "cuda":
            def clock() -> float:
                torch.cuda.current_stream(device).synchronize()
                return time.perf_counter()
            clock()  # drained before the barrier, so every rank's zero is the barrier's end
        if comm is not None:
            comm.Barrier()
        return cls(clock)

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the enclosed block as one span (also when it raises); yields the span's args,
        to which the block may add what it learns (bytes sent, ...)."""
        t = self.clock()
        try:
            yield args
        finally:
            self.spans.append(Span(name, cat, t - self.zero, self.clock() - self.zero, args))


_active: Optional[Recorder] = None


@contextlib.contextmanager
def recording(recorder: Optional[Recorder]) -> Iterator[Optional[Recorder]]:
    """Make ``recorder`` the one :func:`span` records into for the enclosed block (None: record
    nothing); the previous one is restored after."""
    global _active
    previous, _active = _active, recorder
    try:
        yield recorder
    finally:
        _active = previous


def span(name: str, cat: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A span in the active recorder, or nothing when none is active (see :func:`recording`).

    ``with span(...) as info:`` gives the span's args dict either way (then thrown away), so
    the block may add to it without asking whether anything records.
    """
    rec = _active
    cm = rec.span(name, cat, **args) if rec is not None else contextlib.nullcontext(args)
    return _profiled_too(cm, name) if profiling() else cm


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler.record_function(name)`` range while torch's profiler runs, else
    nothing (one check, no op dispatched): label the parts of a step a profile should tell
    apart."""
    # No import in here: an import statement inside a profile with Python stacks is one way to
    # meet torch's bug with freed frame names (launches.step_launches).
    return record_function(name) if profiling() else contextlib.nullcontext()


def profiling() -> bool:
    """Whether torch's profiler is running (what :func:`profiled` asks)."""
    return torch.autograd._profiler_enabled()


@contextlib.contextmanager
def _profiled_too(cm: contextlib.AbstractContextManager[dict[str, Any]], name: str
                  ) -> Iterator[dict[str, Any]]:
    with cm as args, record_function(name):
        yield args


def to_chrome_trace(rows: Sequence[Sequence[Span]], labels: Optional[Sequence[str]] = None,
                    process_name: str = "sparsepipe_hpc") -> dict[str, Any]:
    """Trace Event Format dict (``json.dump`` it): row ``r`` (tid r) holds ``rows[r]``'s spans,
    named ``labels[r]`` (default ``rank r``); times in microseconds."""
    if labels is not None and len(labels) != len(rows):
        raise ValueError(f"labels has {len(labels)} entries but there are {len(rows)} rows")
    out: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "name": "process_name",
                                  "args": {"name": process_name}}]
    for r, spans in enumerate(rows):
        out.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_name",
                    "args": {"name": labels[r] if labels is not None else f"rank {r}"}})
        out.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index",
                    "args": {"sort_index": r}})
        # Chrome nests same-row slices by order: start ascending, the longer (outer) one first.
        for s in sorted(spans, key=lambda s: (s.start, -s.end)):
            out.append({"ph": "X", "pid": 0, "tid": r, "name": s.name, "cat": s.cat,
                        "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                        "args": dict(s.args)})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def gather_chrome_trace(recorder: Recorder, comm: Any, label: Optional[str] = None,
                        process_name: str = "sparsepipe_hpc") -> Optional[dict[str, Any]]:
    """Gather every rank's spans to rank 0 of ``comm`` (collective) and return the trace there,
    one row per rank in rank order (``label``: this rank's row name); None on other ranks."""
    got = comm.gather((recorder.spans, label if label is not None else f"rank {comm.rank}"),
                      root=0)
    if comm.rank != 0:
        return None
    return to_chrome_trace([s for s, _ in got], [lab for _, lab in got], process_name)
