"""The per-rank summary behind ``python -m launch info``: check binding before a long run.

Usage::

    mpirun -n 4 python -m launch info        # or: srun python -m launch info; mpiexec ... (PBS)
    python -m launch info --json             # one JSON object per rank

prints one line per rank, gathered to rank 0 and printed in rank order::

    rank 0/4 local 0/4 node gpu07 (#0) via slurm gpu 0 (physical 0, 4 visible) threads 8 ...
    rank 1/4 local 1/4 node gpu07 (#0) via slurm gpu 1 (physical 1, 4 visible) threads 8 ...

followed, on stderr, by warnings for what looks wrong: two ranks on one GPU, more threads than cores
on a node, launcher variables that disagree with MPI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Sequence

from launch.device import gpu_uuid, physical_gpu, select_gpu, visible_gpu_count
from launch.env import (Placement, check_world, detect, prefer_shared_memory,
                        ranks_sharing_cores, threads_per_rank)
from launch.errors import LaunchError

__all__ = ["summary", "format_line", "problems", "compress_cpus", "main"]


def compress_cpus(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3,8-9"``."""
    ranges: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def summary(placement: Placement, mpi_rank: int | None = None,
            gpu_count: int | None = None, sharing: int | None = None) -> dict[str, Any]:
    """Everything ``launch info`` reports about this process, as a JSON-able dict; ``sharing``:
    the ranks that share its cores (:func:`launch.env.threads_per_rank`)."""
    count = visible_gpu_count() if gpu_count is None else gpu_count
    gpu = select_gpu(placement, count)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "rank": placement.rank, "size": placement.size,
        "local_rank": placement.local_rank, "local_size": placement.local_size,
        "node": placement.node, "node_index": placement.node_index,
        "launcher": placement.launcher, "note": placement.note,
        "mpi_rank": placement.rank if mpi_rank is None else mpi_rank,
        "gpu": gpu, "gpu_physical": None if gpu is None else physical_gpu(gpu),
        "gpu_uuid": None if gpu is None or gpu_count is not None else gpu_uuid(gpu),
        "visible_gpus": count, "threads": threads_per_rank(placement, sharing=sharing),
        "cpus": cpus, "pid": os.getpid(),
    }


def format_line(info: dict[str, Any]) -> str:
    """The one-line form of a :func:`summary`."""
    where = info["node"]
    if info["node_index"] is not None:
        where += f" (#{info['node_index']})"
    gpu = ("-" if info["gpu"] is None else
           f"{info['gpu']} (physical {info['gpu_physical']}, {info['visible_gpus']} visible)")
    line = (f"rank {info['rank']}/{info['size']} local {info['local_rank']}/{info['local_size']} "
            f"node {where} via {info['launcher']} gpu {gpu} threads {info['threads']} "
            f"cpus {compress_cpus(info['cpus']) or '?'} pid {info['pid']}")
    if info["mpi_rank"] != info["rank"]:
        line += f" MISMATCH: MPI rank {info['mpi_rank']}"
    if info["note"]:
        line += f" [{info['note']}]"
    return line


def problems(infos: Sequence[dict[str, Any]]) -> list[str]:
    """What looks wrong across the ranks' summaries: shared GPUs, busy cores, mismatches."""
    found: list[str] = []
    by_gpu: dict[tuple[str, str], list[int]] = defaultdict(list)
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for info in infos:
        by_node[info["node"]].append(info)
        if info["gpu"] is not None:  # one GPU seen as device 0 by each rank has a UUID each
            by_gpu[(info["node"], info.get("gpu_uuid") or str(info["gpu_physical"]))].append(
                info["rank"])
        if info["mpi_rank"] != info["rank"]:
            found.append(f"rank {info['rank']} ({info['launcher']} variables) is MPI rank "
                         f"{info['mpi_rank']}: the launcher's variables describe another world")
        if info.get("note"):
            found.append(f"rank {info['rank']}: {info['note']}")
    for (node, gpu), ranks in sorted(by_gpu.items()):
        if len(ranks) > 1:
            found.append(f"node {node}: GPU {gpu} is shared by ranks {sorted(ranks)}")
    for node, members in sorted(by_node.items()):
        cores = set().union(*(set(m["cpus"]) for m in members))
        threads = sum(m["threads"] for m in members)
        if cores and threads > len(cores) and any(m["threads"] > 1 for m in members):
            found.append(f"node {node}: {len(members)} ranks run {threads} threads on "
                         f"{len(cores)} cores; set SPARSEPIPE_THREADS or the CPUs per rank")
    return found


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m launch info [--json]``: gather every rank's summary and print it on rank 0."""
    parser = argparse.ArgumentParser(prog="python -m launch info", description=(
        "Print one line per rank: rank, local rank, node, launcher, GPU, threads, CPU affinity."))
    parser.add_argument("--json", action="store_true", help="print one JSON object per rank")
    options = parser.parse_args(argv)
    prefer_shared_memory()  # before MPI starts: on one node, skip probing network transports
    try:
        from mpi4py import MPI
    except ImportError:  # no MPI: this process is the whole world
        comm = None
    else:
        comm = MPI.COMM_WORLD
    try:
        if comm is not None:  # without mpi4py the launcher's variables are all there is
            check_world(comm.Get_size())
        placement = detect(comm)
        mine = summary(placement, mpi_rank=None if comm is None else comm.Get_rank(),
                       sharing=None if comm is None else ranks_sharing_cores(comm))
    except LaunchError as err:  # a malformed variable, or MPI not started by the launcher
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        if comm is not None and comm.Get_size() > 1:
            comm.Abort(2)  # the others may wait in a collective for this rank
        raise SystemExit(2) from None
    infos = [mine] if comm is None else comm.gather(mine, root=0)
    if infos is None:  # not rank 0
        return
    infos = sorted(infos, key=lambda info: info["mpi_rank"])
    for info in infos:
        print(json.dumps(info, sort_keys=True) if options.json else format_line(info))
    sys.stdout.flush()
    for problem in problems(infos):
        print(f"warning: {problem}", file=sys.stderr)
