"""Step-time measurements of ``bench gpu-comm``: overlap hidden fraction, n ranks versus 1, trace.

    make = halo_factory("staged", CudaDevice(), delay_s=0.002)   # comm -> delayed transport
    make = halo_factory("staged", CudaDevice(), 0.002, delay_on="host")   # the host sleeps
    ov = overlap_section(MPI.COMM_WORLD, x, unet, device,
                         lambda d: halo_factory("staged", streams, d), [0.002], repeats=5, align=16)
    ov["delays"][0]["hidden_fraction"]      # 1 - (T_on(d) - T_on(0)) / (T_off(d) - T_off(0))

Every figure is the step time of the distributed U-Net's forward + backward (kernel maps, cuts and
halo plans included, as in training) on a grid of n x 1 x 1 ranks, the slowest rank's time,
median over ``repeats`` after a warm-up, the variants timed in turn within each repeat so that a
drift in the machine's load hits all of them alike. On CUDA each timed step is bracketed by
``torch.cuda.synchronize()``, so queued kernels count. The same code runs on CPU tensors with the
mpi4py transport (``--device cpu``), which is how the CPU suite checks it; on CUDA it ran on an
H100 (docs/gpu.md).

The injected delay (:class:`~halo.transport.delay.DelayedTransport`, halo tags only) holds each
halo exchange back ``d`` seconds from its ``start``; what the caller enqueued or computed in
between (the interior convolution, with overlap on) hides it. Over a device transport (staged,
ipc, nccl) it runs on the device by default (``delay_on="device"``), as a slow link would: a
stream of its own pauses from the compute stream's point at ``start``, and ``wait`` makes the
compute stream wait for it besides the transfer. Without overlap the compute stream then idles
through the pause; with overlap it runs the interior convolution enqueued after ``start``. Over
the mpi transport (host tensors), or with ``delay_on="host"``, ``wait`` sleeps the host instead:
on a GPU the device runs through that sleep whatever was queued before (and a shared GPU the
other ranks' work) in both modes, which an H200 showed (docs/gpu.md): the measure of what
overlap adds is then lost in the noise. A pause on the device never blocks the host, so the
host's exposed wait (``exposed_wait_s``) does not include it: the step times say what it cost
(``hidden_fraction_of_wait`` is None for such delays).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from halo.transport.base import Transport
from sparsepipe_hpc.bench.common import sync
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["halo_factory", "time_side_by_side", "hidden_fraction", "median_se",
           "overlap_section", "ranks_note", "ranks_section", "write_traces"]

Factory = Callable[[Any], Transport]


def halo_factory(name: str, streams: Any, delay_s: float, delay_on: str = "device") -> Factory:
    """comm -> transport ``name`` over comm (on ``streams``, a Device, for device transports)
    with every halo exchange held back ``delay_s`` from its start (plans' exchanges are not), on
    the device where ``delay_on`` is "device" and there is one (``streams``), else on the host."""
    from halo.exchange import EXCHANGE_TAG
    from halo.transport.delay import DelayedTransport
    from halo.transport.select import make_transport

    device = streams if delay_on == "device" else None
    return lambda comm: DelayedTransport(make_transport(name, comm, streams), delay_s,
                                         tags=(EXCHANGE_TAG, EXCHANGE_TAG + 1), device=device)


def _idle_barrier(comm: Any) -> None:
    """A barrier that sleeps instead of spinning a core (a waiting rank must not slow a lone
    rank's timed step on a shared CPU)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(5e-4)


def _timed(comm: Any, fn: Callable[[], Any], device: torch.device, solo: bool) -> float:
    """Seconds of ``fn`` on the slowest rank; ``solo``: rank 0 alone runs it, the others idle."""
    from mpi4py import MPI

    dt = 0.0
    if not solo:
        comm.Barrier()
    if not solo or comm.Get_rank() == 0:
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t
    if solo:
        _idle_barrier(comm)
    return float(comm.allreduce(dt, op=MPI.MAX))


def time_side_by_side(comm: Any, steps: dict[str, tuple[Callable[[], Any], bool]],
                      device: torch.device, repeats: int, warmup: int = 1,
                      between: Optional[Callable[[], None]] = None) -> dict[str, dict[str, Any]]:
    """Median and all step times of each ``name: (fn, solo)``, the steps run in turn in each
    repeat (collective over ``comm``). ``between``: called once after the warm-up."""
    for _ in range(warmup):
        for fn, solo in steps.values():
            _timed(comm, fn, device, solo)
    if between is not None:
        between()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (fn, solo) in steps.items():
            times[name].append(_timed(comm, fn, device, solo))
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts}
            for name, ts in times.items()}


def hidden_fraction(on0: float, on_d: float, off0: float, off_d: float) -> Optional[float]:
    """1 - (T_on(d) - T_on(0)) / (T_off(d) - T_off(0)): the share of the injected delay that
    overlap keeps out of the step time; None when the delay did not lengthen the step without
    overlap (noise larger than the delay: nothing to divide by)."""
    added_off = off_d - off0
    if added_off <= 0:
        return None
    return 1.0 - (on_d - on0) / added_off


def median_se(samples: list[list[float]]) -> float:
    """Standard error of one variant's median step time (s), from the spread of every variant's
    ``samples`` about its own median (pooled median absolute deviation, normal approximation:
    sigma = 1.4826 MAD, SE = 1.2533 sigma / sqrt(n))."""
    devs = [abs(t - statistics.median(ts)) for ts in samples for t in ts]
    n = min(len(ts) for ts in samples)
    return 1.2533 * 1.4826 * statistics.median(devs) / n ** 0.5


def _key(overlap: bool, delay_s: float) -> str:
    return f"{'overlap' if overlap else 'no_overlap'}_delay{delay_s * 1e3:g}ms"


def _wait_fraction(on: dict[str, Any], off: dict[str, Any]) -> Optional[float]:
    """1 - exposed wait with overlap / without (None when nothing waited without overlap)."""
    return 1.0 - on["exposed_wait_s"] / off["exposed_wait_s"] if off["exposed_wait_s"] > 0 else None


def overlap_section(comm: Any, x: SparseTensor, make_net: Callable[[], torch.nn.Module],
                    device: torch.device, factory: Callable[[float], Factory],
                    delays_s: list[float], repeats: int, align: int,
                    reducer: Optional[Callable[[Any], Any]] = None) -> dict[str, Any]:
    """Step times with overlap on/off, without and with each of ``delays_s`` per halo exchange,
    and the hidden fraction per delay (collective over ``comm``, which has >= 2 ranks)."""
    from mpi4py import MPI

    from sparsepipe_hpc.bench.spatial import step_fn
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    n = comm.Get_size()
    net = make_net()  # one model for all variants: they differ only in the context
    ctxs, steps = {}, {}
    for d in [0.0, *delays_s]:
        for overlap in (True, False):
            ctx = ParallelContext(comm, RankLayout(1, 1, (n, 1, 1)), overlap=overlap,
                                  transport=factory(d), reducer=reducer)
            ctxs[_key(overlap, d)] = ctx
            steps[_key(overlap, d)] = (step_fn(net, x, ctx, align), False)
    start: dict[str, int] = {}

    def reset() -> None:  # count the timed steps only
        for k, ctx in ctxs.items():
            ctx.group.exposed_wait_s = 0.0
            start[k] = ctx.group.transport.delayed

    t = time_side_by_side(comm, steps, device, repeats, between=reset)
    rows: dict[str, Any] = {}
    for k, ctx in ctxs.items():
        per_step = (ctx.group.transport.delayed - start[k]) / repeats
        rows[k] = {**t[k], "exposed_wait_s": comm.allreduce(ctx.group.exposed_wait_s / repeats,
                                                            op=MPI.MAX),
                   "halo_exchanges_per_step": comm.allreduce(per_step, op=MPI.MAX)}
    for ctx in ctxs.values():
        ctx.close()  # IPC buffers and events are not the caching allocator's: free them now
    on0, off0 = rows[_key(True, 0.0)], rows[_key(False, 0.0)]
    se = median_se([r["all_s"] for r in rows.values()])
    # A pause on the device never blocks the host: the host's exposed wait does not see it.
    on_device = any(getattr(c.group.transport, "device", None) is not None for c in ctxs.values())
    out: dict[str, Any] = {
        "grid": [n, 1, 1], "variants": rows, "target_hidden_fraction": 0.8,
        "median_step_se_s": se, "delay_on": "device" if on_device else "host",
        "without_delay": {"saved_s": off0["median_s"] - on0["median_s"],
                          "hidden_fraction_of_wait": _wait_fraction(on0, off0)},
        "delays": []}
    for d in delays_s:
        on, off = rows[_key(True, d)], rows[_key(False, d)]
        frac = hidden_fraction(on0["median_s"], on["median_s"], off0["median_s"],
                               off["median_s"])
        row = {"delay_s": d, "injected_s_per_step": off["halo_exchanges_per_step"] * d,
               "added_s_no_overlap": off["median_s"] - off0["median_s"],
               "added_s_overlap": on["median_s"] - on0["median_s"],
               "hidden_fraction": frac,
               "hidden_fraction_of_wait": None if on_device else _wait_fraction(on, off),
               # The fraction combines four medians: its error is about 2 SE over the divisor.
               "hidden_fraction_se": (2 * se / (off["median_s"] - off0["median_s"])
                                      if frac is not None else None)}
        if frac is None:
            row["note"] = ("the injected delay did not lengthen the step without overlap (noise "
                           "is larger than it): pass a larger --delay-ms or more --repeats")
        out["delays"].append(row)
    return out


def ranks_note(device_type: str, ranks: int, ranks_per_device: int, cores: int) -> tuple[bool, str]:
    """(shared, what the n-rank / 1-rank ratio means). ``ranks_per_device``: ranks on the most
    crowded GPU (cuda) or node (cpu); ``cores``: a CPU rank's usable cores."""
    caveat = "about cost, not speed-up"
    if device_type == "cuda":
        if ranks_per_device > 1:
            return True, (f"{ranks_per_device} ranks share one GPU: the {ranks}-rank / 1-rank "
                          f"step-time ratio is {caveat} (what splitting the sample over ranks "
                          f"costs when their kernels and copies compete for the same device); "
                          f"a speed-up needs one GPU per rank")
        return False, (f"each rank has a GPU of its own: 1 / ratio is the {ranks}-rank "
                       f"strong-scaling speed-up")
    shared = ranks_per_device > cores
    where = (f"{ranks_per_device} ranks share {cores} core(s)" if shared
             else f"each rank has a core of its own ({cores} usable, one thread per rank)")
    return shared, (f"CPU figures (--device cpu): {where}, so the ratio is "
                     f"{caveat if shared else 'a CPU strong-scaling cost (1 / ratio: speed-up)'}"
                     f"; on a GPU machine with the ranks sharing one GPU the ratio is {caveat}")


def ranks_per_device(comm: Any, device: torch.device) -> int:
    """Ranks on the most crowded GPU (cuda) or node (cpu) of the job (collective)."""
    from launch.device import ranks_per_gpu

    return ranks_per_gpu(comm, torch.cuda.current_device() if device.type == "cuda" else None)


def ranks_section(comm: Any, x: SparseTensor, make_net: Callable[[], torch.nn.Module],
                  device: torch.device, factory: Factory, repeats: int, align: int,
                  reducer: Optional[Callable[[Any], Any]] = None) -> dict[str, Any]:
    """The distributed step on all n ranks (grid n x 1 x 1, overlap on) versus the plain U-Net
    on rank 0 alone while the others sleep (collective over ``comm``); and what one more
    distributed step asked of each rank's device and host (``launches``: kernels, blocking calls
    and where they come from, :func:`~sparsepipe_hpc.bench.launches.step_launches`). Rank 0
    also profiles one step alone (``launches_one_rank``) and lists the kernels by which its
    part of the split step takes longer (``kernel_gap``: what the split adds, halo parts and
    the group form of BatchNorm among them)."""
    from launch.env import available_cores
    from sparsepipe_hpc.bench.launches import kernel_gap, step_launches
    from sparsepipe_hpc.bench.spatial import step_fn
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    n = comm.Get_size()
    ctx = ParallelContext(comm, RankLayout(1, 1, (n, 1, 1)), overlap=True, transport=factory,
                          reducer=reducer)
    one = step_fn(make_net(), x) if comm.Get_rank() == 0 else (lambda: None)
    dist = step_fn(make_net(), x, ctx, align)
    t = time_side_by_side(comm, {"one_rank": (one, True), f"{n}_ranks": (dist, False)},
                          device, repeats)
    shared, note = ranks_note(device.type, n, ranks_per_device(comm, device), available_cores())
    comm.Barrier()
    launches = step_launches(dist, device, comm=comm)  # each rank its part of one more step
    ctx.close()
    out = {"one_rank": t["one_rank"], "n_ranks": t[f"{n}_ranks"], "ranks": n,
           "ratio_n_over_1": t[f"{n}_ranks"]["median_s"] / t["one_rank"]["median_s"],
           "shared_device": shared, "note": note, "launches": launches}
    if comm.Get_rank() == 0:  # what the split adds to rank 0's kernels, against one rank alone
        one_launches = step_launches(one, device)
        out["launches_one_rank"] = one_launches
        out["kernel_gap"] = kernel_gap(launches, one_launches)
    _idle_barrier(comm)
    return out


def write_traces(comm: Any, x: SparseTensor, make_net: Callable[[], torch.nn.Module],
                 device: torch.device, factory: Factory, steps: int, align: int,
                 folder: str, reducer: Optional[Callable[[Any], Any]] = None) -> str:
    """A torch.profiler Chrome trace of ``steps`` overlapped steps per rank, in
    ``folder/gpu_comm_rank{r}.json`` (on CUDA the communication stream's copies show beside the
    compute stream's kernels). Returns this rank's file."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from sparsepipe_hpc.bench.spatial import step_fn
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    n = comm.Get_size()
    ctx = ParallelContext(comm, RankLayout(1, 1, (n, 1, 1)), overlap=True, transport=factory,
                          force_spatial=True, reducer=reducer)
    fn = step_fn(make_net(), x, ctx, align)
    fn()  # warm-up outside the trace
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    comm.Barrier()
    with profile(activities=acts) as prof:
        for i in range(steps):
            with record_function(f"step {i}"):
                fn()
            sync(device)
    os.makedirs(folder, exist_ok=True)
    path = str(Path(folder) / f"gpu_comm_rank{comm.Get_rank()}.json")
    prof.export_chrome_trace(path)
    ctx.close()
    comm.Barrier()
    return path
