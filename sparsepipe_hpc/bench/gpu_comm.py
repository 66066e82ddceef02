"""Device communication benchmark: exchange time per transport, overlap in step time, n vs 1 rank.

    mpirun -n 2 python -m sparsepipe_hpc.bench gpu-comm --json gpu_comm.json      # on a GPU
    mpirun -n 2 python -m sparsepipe_hpc.bench gpu-comm --device cpu \\
        --sections overlap,ranks --json gc.json                  # the code path on CPU tensors

Sections (``--sections``, default all):

  sizes    per device transport (staged always; ipc with CuPy on one node; nccl with CuPy
           and one GPU per rank), a ring exchange of one device tensor (to rank+1, from
           rank-1) versus message size, CUDA-synchronized, median over ``--repeats``. Device
           transports only: skipped (and said so) with ``--device cpu``.
  overlap  step time of the distributed U-Net (forward + backward, grid n x 1 x 1) with overlap
           on and off (``ParallelContext(overlap=...)``), without a delay and with each of
           ``--delay-ms`` injected per halo exchange (DelayedTransport over the chosen transport,
           halo tags only); per delay d, hidden fraction = 1 - (T_on(d) - T_on(0)) /
           (T_off(d) - T_off(0)), and its standard error from the spread of the step times
           (``hidden_fraction_se``; on an H100 shared by 2 ranks the steps varied by +-50 ms,
           so a 38 ms delay per step gave fractions of -1.4 to 2.2, each +-1). Target on a
           GPU: >= 0.8. ``--delay-on``: where the delay runs, ``device`` (a pause on a stream
           of its own, which the compute stream waits for: the default for device transports)
           or ``host`` (``wait`` sleeps; the only way for mpi); :mod:`._gpu_comm_steps` says
           why a host sleep measures a device transport badly.
  ranks    the distributed step on all n ranks versus the plain U-Net on one rank; with the
           ranks sharing one GPU the ratio is about cost, not speed-up (the JSON says which);
           and one more distributed step's kernels, blocking calls and where they come from,
           on rank 0 (``launches``, as ``bench gpu`` counts them).

``--trace DIR`` adds a torch.profiler Chrome trace of a few overlapped steps per rank.
``--transport`` picks the halo transport of overlap/ranks (default staged on CUDA, mpi on CPU).
Without CUDA, ``--device cuda`` (the default) exits 1 saying so.

Run on an H100 with two ranks sharing it (docs/gpu.md); the CPU path (the same code with CPU
tensors and the mpi4py transport) is what the test suite runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

from halo.transport.nccl import nccl_available
from sparsepipe_hpc.bench._args import positive_int, sections as parse_sections

__all__ = ["main", "build_parser", "device_transports", "sizes_section", "SECTIONS"]

SECTIONS = ("sizes", "overlap", "ranks")
# A GPU's interior convolution per layer takes a fraction of a millisecond at the default scene:
# the delays a GPU run tries bracket it (the hidden share falls once a delay outgrows it).
DEFAULT_DELAYS_MS = {"cuda": [0.25, 1.0], "cpu": [20.0]}
SIZES_SKIPPED_CPU = ("--device cpu: the sizes section times device transports (staged, ipc, "
                     "nccl) on CUDA tensors; run it with --device cuda on a GPU machine")


def device_transports(ranks_per_gpu: int, one_node: bool) -> list[str]:
    """The device transports this job can use: staged always; ipc with CuPy and every rank on
    one node; nccl with CuPy's NCCL and one GPU per rank (NCCL refuses two ranks on one GPU)."""
    names = ["staged"]
    if importlib.util.find_spec("cupy") is not None:
        if one_node:
            names.append("ipc")
        if ranks_per_gpu == 1 and nccl_available():
            names.append("nccl")
    return names


def sizes_section(comm: Any, names: list[str], streams: Any, max_bytes: int,
                  repeats: int) -> dict[str, Any]:
    """Ring exchange time of float32 device tensors of 1 KiB, 4 KiB, ... ``max_bytes`` per
    transport (collective over ``comm``; rows: transport, bytes, median_s, min_s)."""
    from mpi4py import MPI

    from halo.transport.select import make_transport

    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    rows = []
    for name in names:
        tr = make_transport(name, comm, streams)
        nbytes = 1 << 10
        while nbytes <= max_bytes:
            send = torch.ones(nbytes // 4, device="cuda")
            recv = torch.empty_like(send)
            times = []
            for rep in range(repeats + 2):  # two warm-ups (buffer pools, IPC handles)
                torch.cuda.synchronize()
                comm.Barrier()
                t = time.perf_counter()
                tr.start([(right, send)], [(left, recv)], tag=9).wait()
                torch.cuda.synchronize()
                if rep >= 2:
                    times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            rows.append({"transport": name, "bytes": nbytes,
                         "median_s": statistics.median(times), "min_s": min(times)})
            nbytes *= 4
        tr.close()
    return {"transports": names, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench gpu-comm",
                                description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--json", help="write the results here (rank 0)")
    a("--device", choices=("cpu", "cuda"), default="cuda")
    a("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    a("--transport", choices=("staged", "ipc", "nccl", "mpi"),
      help="halo transport of overlap/ranks (default staged on cuda, mpi on cpu)")
    a("--max-bytes", type=positive_int, default=64 << 20, help="sizes: largest message")
    a("--repeats", type=positive_int, default=10, help="timed repeats per figure (median)")
    a("--delay-ms", type=float, nargs="+", help="overlap: injected per-halo-exchange delay(s) "
      f"(default {DEFAULT_DELAYS_MS['cuda']} on cuda, {DEFAULT_DELAYS_MS['cpu']} on cpu)")
    a("--delay-on", choices=("device", "host"), help="overlap: where the delay runs (default "
      "device for a device transport, host for mpi)")
    a("--voxel-size", type=float, default=0.03, help="scene: metres per voxel")
    a("--points", type=positive_int, default=1_000_000, help="scene: points of the synthetic room")
    a("--width", type=positive_int, default=16)
    a("--depth", type=positive_int, default=4)
    a("--trace", metavar="DIR", help="write a torch.profiler Chrome trace per rank there")
    a("--trace-steps", type=positive_int, default=3)
    return p


def _resolve_transport(p: argparse.ArgumentParser, args: Any, ranks_per_gpu: int) -> str:
    from halo.transport.base import TransportError
    from halo.transport.select import choose_transport

    if args.device == "cuda" and args.transport == "mpi":
        p.error("--transport mpi moves host tensors and this run's are on CUDA; pass staged, "
                "ipc or nccl, or --device cpu")
    name = args.transport or ("staged" if args.device == "cuda" else "mpi")
    try:
        return choose_transport(name, args.device, nccl=nccl_available(),
                                shared_gpu=ranks_per_gpu > 1)
    except TransportError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


def _say_overlap(say: Callable[..., None], ov: dict[str, Any]) -> None:
    for k, row in ov["variants"].items():
        say(f"overlap {k:26s} step {row['median_s'] * 1e3:9.1f} ms, exposed wait "
            f"{row['exposed_wait_s'] * 1e3:8.1f} ms, {row['halo_exchanges_per_step']:g} "
            f"halo exchanges")
    say(f"overlap without delay: {ov['without_delay']['saved_s'] * 1e3:.1f} ms saved per step")
    for d in ov["delays"]:
        frac = d["hidden_fraction"]
        say(f"overlap delay {d['delay_s'] * 1e3:g} ms on the {ov['delay_on']}: "
            f"{d['injected_s_per_step'] * 1e3:.1f} ms "
            f"injected per step, {d['added_s_no_overlap'] * 1e3:.1f} ms added without overlap, "
            f"{d['added_s_overlap'] * 1e3:.1f} ms with; hidden fraction "
            + (f"{frac:.2f} +- {d['hidden_fraction_se']:.2f}" if frac is not None
               else f"n/a ({d['note']})")
            + f" (target {ov['target_hidden_fraction']}; a step's median is known to "
            f"+- {ov['median_step_se_s'] * 1e3:.1f} ms)")


def _step_sections(args: Any, sections: list[str], comm: Any, device: torch.device,
                   streams: Any, name: str, result: dict[str, Any],
                   say: Callable[..., None], save: Callable[[], None]) -> None:
    """overlap, ranks and the trace: the distributed U-Net's steps on one synthetic room;
    ``save()`` after each section."""
    from sparsepipe_hpc.bench import _gpu_comm_steps as steps
    from sparsepipe_hpc.bench.common import synthetic_room
    from sparsepipe_hpc.bench.launches import describe_gap
    from sparsepipe_hpc.nn import SparseUNet

    n = comm.Get_size()
    x = synthetic_room(voxel_size=args.voxel_size, points=args.points)
    x = x.to(device)
    align = 2 ** args.depth
    result["scene"] = {"voxels": x.num_voxels, "spatial_shape": list(x.spatial_shape),
                       "voxel_size": args.voxel_size, "width": args.width, "depth": args.depth}
    say(f"room: {x.num_voxels} voxels, U-Net width {args.width} depth {args.depth}, {n} ranks "
        f"on {device}, transport {name}")

    def unet() -> torch.nn.Module:
        torch.manual_seed(0)
        return SparseUNet(x.num_channels, 8, width=args.width, depth=args.depth).to(device)

    def factory(d: float) -> Any:  # mpi has no device (streams None): its delay is the host's
        return steps.halo_factory(name, streams, d, args.delay_on or "device")

    from halo.transport.select import make_reducer

    # Device reductions (BatchNorm statistics, gradients) on the device, as the trainer runs them.
    reducer = None if name == "mpi" else (lambda c: make_reducer(name, c, streams))

    if "overlap" in sections and n >= 2:
        delays = args.delay_ms or (DEFAULT_DELAYS_MS[device.type])
        result["overlap"] = steps.overlap_section(comm, x, unet, device, factory,
                                                  [d / 1e3 for d in delays], args.repeats, align,
                                                  reducer=reducer)
        _say_overlap(say, result["overlap"])
        save()
    if "ranks" in sections and n >= 2:
        rk = result["ranks"] = steps.ranks_section(comm, x, unet, device, factory(0.0),
                                                   args.repeats, align, reducer=reducer)
        say(f"ranks: 1 rank {rk['one_rank']['median_s'] * 1e3:.1f} ms, {n} ranks "
            f"{rk['n_ranks']['median_s'] * 1e3:.1f} ms, ratio {rk['ratio_n_over_1']:.2f}: "
            f"{rk['note']}")
        lc = rk["launches"]
        say(f"ranks: one {n}-rank step on rank 0: {lc['kernels']} kernels, {lc['syncs']} "
            f"blocking calls, {lc['torch_host_syncs']} torch syncs; most frequent: "
            + ", ".join(f"{k} x{v}" for k, v in list(lc["sync_sites"].items())[:6]))
        if rk.get("kernel_gap"):
            say("ranks: rank 0's kernels in the split step over one rank's: "
                + describe_gap(rk["kernel_gap"], "alone"))
        save()
    if args.trace:
        path = steps.write_traces(comm, x, unet, device, factory(0.0), args.trace_steps, align,
                                  args.trace, reducer=reducer)
        result["trace"] = comm.gather(path)
        say(f"trace: {', '.join(result['trace'] or [])}")


def main(argv: list[str]) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    sections = parse_sections(p, args.sections, SECTIONS)
    for flag in ("repeats", "points", "width", "depth", "trace_steps", "max_bytes"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} is {getattr(args, flag)}; it must be >= 1")
    if args.delay_on == "device" and (args.device == "cpu" or args.transport == "mpi"):
        p.error("--delay-on device: the mpi transport moves host tensors, so its delay runs on "
                "the host; pass a device transport (staged, ipc, nccl) on --device cuda")
    for d in args.delay_ms or []:
        if not d > 0:
            p.error(f"--delay-ms {d}: each delay must be > 0 ms (the delay overlap hides)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench gpu-comm: no CUDA device here (torch.cuda.is_available() is False); it "
                 "measures device transports: run it on a GPU machine, or pass --device cpu "
                 "to check the overlap and ranks code path on CPU tensors")
    from mpi4py import MPI

    from sparsepipe_hpc.bench._gpu_comm_steps import ranks_per_device
    from sparsepipe_hpc.bench.common import environment, write_json

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    device, streams = torch.device("cpu"), None
    if args.device == "cuda":
        from halo.transport.streams import CudaDevice
        from launch.device import bind_gpu
        from launch.env import detect

        device = torch.device("cuda", bind_gpu(detect(comm)) or 0)
        streams = CudaDevice(device)
    else:
        torch.set_num_threads(1)
    per_device = ranks_per_device(comm, device)
    name = _resolve_transport(p, args, per_device if device.type == "cuda" else 1)
    result: dict[str, Any] = {
        "benchmark": "gpu-comm", "device": str(device), "world_size": n, "transport": name,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "sections": sections, "env": environment(comm),
        "figures": "GPU" if device.type == "cuda" else "CPU (say nothing about a GPU)",
        "complete": False}

    def save() -> None:  # after each section: what is measured survives a later crash
        if rank == 0:
            write_json(args.json, result)

    if "sizes" in sections:
        if device.type != "cuda":
            result["sizes"] = {"skipped": SIZES_SKIPPED_CPU}
            say(f"sizes: skipped: {SIZES_SKIPPED_CPU}")
        else:
            one_node = len(set(comm.allgather(socket.gethostname()))) == 1
            sz = result["sizes"] = sizes_section(comm, device_transports(per_device, one_node),
                                                 streams, args.max_bytes, args.repeats)
            for row in sz["rows"]:
                say(f"sizes {row['transport']:<7} {row['bytes']:>10} B "
                    f"{row['median_s'] * 1e6:10.1f} us")
            save()
    for sec in ("overlap", "ranks"):
        if sec in sections and n < 2:
            result[sec] = {"skipped": f"{n} rank: needs >= 2 (mpirun -n 2 ...)"}
            say(f"{sec}: skipped: {result[sec]['skipped']}")
    if args.trace or ({"overlap", "ranks"} & set(sections) and n >= 2):
        _step_sections(args, sections, comm, device, streams, name, result, say, save)
    result["complete"] = True
    save()
