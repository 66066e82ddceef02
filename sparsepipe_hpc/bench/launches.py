"""What one step asks of the device and the host: kernels, CUDA runtime calls, synchronizations.

    counts = step_launches(step, torch.device("cuda"))   # one profiled call of step()
    counts["kernels"], counts["runtime_calls"]["cudaFree"], counts["torch_host_syncs"]

Issue 10 found the project's U-Net step 3x slower than the plain spconv one on an H100 and traced
it, with torch's profiler, to what the step asks besides arithmetic: ~9,900 kernel launches, 577
``cudaFree`` calls and 752 stream synchronizations per step. ``bench gpu`` counts the same things
for every network it times, so one device call shows both the ratio and where it comes from:

  kernels           device kernels (and memcpy/memset) the step ran, and their summed GPU time
  runtime_calls     CUDA runtime and driver calls the host made, by name (``cudaLaunchKernel``,
                    ``cudaFree``, ``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ...)
  syncs             the calls among those that block the host (``*Synchronize``, ``cudaMemcpy``;
                    ``cudaFree`` waits for the device too, and is counted on its own)
  torch_host_syncs  torch ops that synchronized (``torch.cuda.set_sync_debug_mode``: ``.item()``,
                    ``.cpu()``, ``nonzero``, ...); spconv's C++ syncs are only in ``syncs``
  aten_ops          torch ops dispatched, nested ones included (on a CPU the only count there is)
  top_kernels       the kernels with the most GPU time, each with the ops and source lines that
                    launched it (``from``: ``aten::index at halo/kmap.py:200``), the top three
  gpu_busy_s        time some kernel of this process ran (their intervals' union: streams that
  gpu_idle_s        overlap count once), and the time between its first kernel and its last
                    that none ran: on a GPU of its own, the device waiting for the host (syncs,
                    launches), which a step time shows and kernel times do not; where ranks
                    share the GPU, also the time it ran the others' kernels
  kernel_times      every kernel by name: GPU time, launches and ``from``; :func:`kernel_gap`
                    of two networks' steps lists the kernels that make one slower than the other
  sync_sites        where they come from: each blocking call, ``cudaMalloc`` and ``cudaFree`` by
                    the op it ran in, the project's source line around it and the innermost
                    labelled range (``cudaStreamSynchronize in aten::nonzero at
                    halo/plan.py:145 within dist_conv halo start``; ranges are
                    ``sparsepipe_hpc.tracing`` spans and ``profiled`` blocks, which also name
                    what runs in backward, where the profile has no Python frames), and each
                    torch sync by the Python line that asked for it (``halo/kmap.py:217``); the
                    most frequent ones

One call of a warmed-up step (spconv tunes its kernels on first use); a profiled step runs slower
than a timed one, so these are counts, not times.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["step_launches", "summarize", "kernel_gap", "describe_gap", "is_sync_warning"]

_BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpy")  # cudaMemcpy (not Async) waits too
_END = "bench: end of the profiled step"  # the range of the profile's own last synchronize


def is_sync_warning(message: str) -> bool:
    """Whether a warning of ``torch.cuda.set_sync_debug_mode("warn")`` reports a wait for the
    device, not the mode itself: torch 2.11 warns, on setting it, that "Synchronization debug mode
    is a prototype feature", which two GPU sessions counted as a sync in every profiled step."""
    return "synchroniz" in message and "prototype feature" not in message


def _blocks(name: str) -> bool:
    return any(b in name for b in _BLOCKING) and "Async" not in name


def step_launches(fn: Callable[[], Any], device: torch.device, top: int = 8,
                  comm: Any = None) -> dict[str, Any]:
    """Counts of one ``fn()`` on ``device``, as the module says; call it warmed up (``bench gpu``
    does, after its timed rounds). ``top``: how many kernels to list by GPU time.

    torch's profiler may read a Python frame's name after its code object is gone
    (pytorch/pytorch#130622: a UnicodeDecodeError while it reads the events; seen here a few
    times in a hundred profiles, on CPU); ``fn`` is then profiled again, the third time without
    Python stacks (no source lines; ``stacks`` in the result says which). ``comm``: the ranks
    that profile a collective ``fn`` together, and so must retry, or raise, together (collective
    then: an error on one rank is raised on every rank).
    """
    for stacks in (True, True, False):
        out: Optional[dict[str, Any]] = None
        error: Optional[Exception] = None
        try:
            events, warned = _profile(fn, device, stacks)
            if events is not None:
                out = {**summarize(events, warned, top), "stacks": stacks}
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error = e
        states = [(error is not None, out is None)]
        if comm is not None:
            states = comm.allgather(states[0])
        if error is not None:
            raise error
        failed = [r for r, (err, _) in enumerate(states) if err]
        if failed:
            raise RuntimeError(f"step_launches: the profiled step failed on rank(s) {failed}")
        if out is not None and not any(unread for _, unread in states):
            return out
    raise RuntimeError("step_launches: torch's profiler could not read its events, even "
                       "without Python stacks")


def _profile(fn: Callable[[], Any], device: torch.device, stacks: bool
             ) -> tuple[Optional[list[Any]], list[tuple[str, str]]]:
    """(the profile's events, or None where torch could not read them; warnings raised, as
    (message, "file:line")) of one ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings(record=True) as caught, \
            profile(activities=activities, with_stack=stacks) as prof:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)
                with torch.profiler.record_function(_END):  # not the step's: not counted
                    torch.cuda.synchronize(device)  # every kernel inside the profile
    warned = [(str(w.message), f"{_short(w.filename)}:{w.lineno}") for w in caught]
    try:
        return list(prof.events()), warned
    except UnicodeDecodeError:
        return None, warned


def _short(path: str) -> str:
    """A source path from the package or repository folder on (``halo/kmap.py``)."""
    parts = path.replace("\\", "/").split("/")
    for i, p in enumerate(parts):
        if p in ("sparsepipe_hpc", "halo", "spconv", "torch", "cumm"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


def _is_call(name: str) -> bool:
    """A CUDA runtime or driver call (not a Python frame such as ``cumm/x.py(1): f``)."""
    return name.startswith("cu") and "(" not in name


def _frame(name: str) -> Optional[tuple[str, str]]:
    """(short path, "line): function") of a Python frame event (``path(line): function`` in a
    profile with stacks); None for an op or a runtime call."""
    path, paren, rest = name.partition("(")
    return (_short(path), rest) if paren else None


def _parents(e: Any) -> Iterator[Any]:
    p = getattr(e, "cpu_parent", None)
    while p is not None:
        yield p
        p = getattr(p, "cpu_parent", None)


def _name(event: Any) -> str:
    """An event's name, a Python frame's shortened (``halo/kmap.py(212): kernel_map``) and a
    C function's without its address (``built-in method implicit_gemm``: the profile's
    ``<built-in method implicit_gemm of pybind11_... object at 0x7f...>``)."""
    name = event.name
    if name.startswith("<built-in "):
        return " ".join(name.strip("<>").split(" of ")[0].split()[:3])
    frame = _frame(name)
    return f"{frame[0]}({frame[1]}" if frame else name


def _caller(e: Any) -> str:
    """The innermost op, range or Python frame around a runtime call event (its
    ``cpu_parent`` chain), or '?'."""
    return next((_name(p) for p in _parents(e) if not _is_call(p.name)), "?")


def _project_line(e: Any) -> Optional[str]:
    """``path:line`` of the innermost Python frame around ``e`` (events named ``path(line):
    function`` in a profile with stacks) that lies in ``halo`` or ``sparsepipe_hpc``."""
    for p in _parents(e):
        frame = _frame(p.name)
        if frame and frame[0].startswith(("halo/", "sparsepipe_hpc/")):
            return f"{frame[0]}:{frame[1].partition(')')[0]}"
    return None


def _launch_site(e: Any) -> str:
    """The op that launched a kernel and the project's source line it was called from, e.g.
    ``aten::index at sparsepipe_hpc/engine/spconv_engine.py:231``."""
    line = _project_line(e)
    return f"{e.name} at {line}" if line else e.name


def _sync_site(e: Any) -> str:
    """Where a runtime call ran: ``{call} in {caller}``, then `` at {project line}`` and
    `` within {range}`` (the innermost labelled range, :mod:`sparsepipe_hpc.tracing`) where
    the profile has them and the caller does not already say them."""
    caller = _caller(e)
    site = f"{e.name} in {caller}"
    line = _project_line(e)
    if line and not caller.startswith(line.partition(":")[0] + "("):
        site += f" at {line}"
    label = next((p.name for p in _parents(e) if getattr(p, "is_user_annotation", False)), None)
    if label and label != caller:
        site += f" within {label}"
    return site


def summarize(events: Any, warned: list[tuple[str, str]], top: int = 8) -> dict[str, Any]:
    """The counts of :func:`step_launches` from profiler ``events`` (each with ``name``,
    ``device_type``, ``device_time_total`` in us and ``cpu_parent``; host ops with the
    ``kernels`` they launched and their ``stack``) and the warnings raised meanwhile, as
    (message, "file:line") pairs."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]  # GPU-side ranges are not work
    host = [e for e in events if e.device_type == DeviceType.CPU]
    calls = [e for e in host if _is_call(e.name)
             and not any(p.name == _END for p in _parents(e))]
    runtime = Counter(e.name for e in calls)
    by_kernel: Counter[str] = Counter()
    for e in kernels:
        by_kernel[e.name] += e.device_time_total
    launched: dict[str, Counter[str]] = {}  # kernel -> where it was launched from, us
    for e in host:
        for k in getattr(e, "kernels", None) or ():
            launched.setdefault(k.name, Counter())[_launch_site(e)] += k.duration
    synced = [site for msg, site in warned if is_sync_warning(msg)]
    sites = Counter(_sync_site(e) for e in calls
                    if _blocks(e.name) or e.name in ("cudaMalloc", "cudaFree"))
    sites.update(f"torch sync at {site}" for site in synced)
    launches = Counter(e.name for e in kernels)
    every = {name: {"time_s": us / 1e6, "launches": launches[name],
                    "from": {site: t / 1e6 for site, t in
                             launched.get(name, Counter()).most_common(3)}}
             for name, us in by_kernel.most_common()}
    busy, span = _busy(kernels)
    return {
        "kernels": len(kernels),
        "kernel_time_s": sum(by_kernel.values()) / 1e6,
        "gpu_busy_s": busy,
        "gpu_idle_s": span - busy,
        "top_kernels": [{"name": name[:120], "time_s": k["time_s"], "from": k["from"]}
                        for name, k in list(every.items())[:top]],
        # Every kernel by name: what kernel_gap compares between two networks' steps.
        "kernel_times": every,
        "runtime_calls": dict(runtime.most_common()),
        "syncs": sum(n for name, n in runtime.items() if _blocks(name)),
        "torch_host_syncs": len(synced),
        "aten_ops": sum(1 for e in host if e.name.startswith("aten::")),
        "sync_sites": dict(sites.most_common(3 * top)),
    }


def _busy(kernels: list[Any]) -> tuple[float, float]:
    """(seconds some kernel ran, seconds from the first kernel's start to the last one's end):
    the union of the kernels' intervals (``time_range``, us), overlapping streams counted once."""
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels
                   if getattr(k, "time_range", None) is not None)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return busy / 1e6, (end - spans[0][0]) / 1e6 if spans else 0.0


def kernel_gap(ours: dict[str, Any], base: dict[str, Any], top: int = 10) -> list[dict[str, Any]]:
    """The ``top`` kernels by which step ``ours`` takes more GPU time than step ``base`` (two
    results of :func:`step_launches`), the largest differences first: each kernel's name, the
    extra time (s), both times and launch counts, and where ``ours`` launched it. Kernels match
    by their full names: the same work done by another template instance in the other step
    counts in full on each side, as does any kernel of one step only."""
    a, b = ours.get("kernel_times", {}), base.get("kernel_times", {})
    none = {"time_s": 0.0, "launches": 0, "from": {}}
    rows = []
    for name in set(a) | set(b):
        x, y = a.get(name, none), b.get(name, none)
        rows.append({"name": name[:120], "extra_s": x["time_s"] - y["time_s"],
                     "time_s": x["time_s"], "base_time_s": y["time_s"],
                     "launches": x["launches"], "base_launches": y["launches"],
                     "from": x["from"]})
    rows.sort(key=lambda r: (-r["extra_s"], r["name"]))
    return [r for r in rows[:top] if r["extra_s"] > 0]


def describe_gap(gap: list[dict[str, Any]], base: str, top: int = 5) -> str:
    """One line of :func:`kernel_gap`'s first ``top`` rows: extra ms, kernel, launches against
    ``base``'s, and where the first of its sites launched it."""
    return "; ".join(f"{g['extra_s'] * 1e3:+.2f} ms {g['name'][:60]} x{g['launches']} "
                     f"({base} x{g['base_launches']})"
                     + (f" from {next(iter(g['from']))}" if g["from"] else "")
                     for g in gap[:top])
