"""Benchmark skeleton: device halo-style exchange time per transport versus message size.

    mpirun -n 2 python -m sparsepipe_hpc.bench gpu-comm --json gpu_comm.json

Each rank sends a device tensor to the next rank of a ring and receives one from the previous,
through each device transport this machine offers (staged always; ipc and nccl with CuPy; nccl
only with one GPU per rank), CUDA-synchronized timing, median over repeats. On a CPU-only
machine it exits with a message saying so. UNVERIFIED: written without a GPU, never run on one;
the overlap figures the issue asks for (exchange hidden behind the interior convolution, with an
injected delay) are not measured here yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from typing import Any

import torch

__all__ = ["main"]


def _transports(comm: Any) -> dict[str, Any]:
    from halo.transport.mpi import MPITransport
    from halo.transport.staged import StagedTransport
    from halo.transport.streams import CudaDevice

    dev = CudaDevice()
    out: dict[str, Any] = {"staged": StagedTransport(MPITransport(comm), dev)}
    if importlib.util.find_spec("cupy") is not None:
        from halo.transport.ipc import IPCTransport

        out["ipc"] = IPCTransport(comm, dev)
        if torch.cuda.device_count() >= comm.Get_size():
            from halo.transport.nccl import NCCLTransport

            out["nccl"] = NCCLTransport(comm, dev)
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench gpu-comm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench gpu-comm: no CUDA device here (torch.cuda.is_available() is False); it "
                 "measures device transports: run it on a GPU machine")
    from mpi4py import MPI

    from sparsepipe_hpc.bench.common import environment, write_json

    comm = MPI.COMM_WORLD
    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    right, left = (comm.Get_rank() + 1) % comm.Get_size(), (comm.Get_rank() - 1) % comm.Get_size()
    rows = []
    for name, tr in _transports(comm).items():
        nbytes = 1 << 10
        while nbytes <= args.max_bytes:
            send = torch.ones(nbytes // 4, device="cuda")
            recv = torch.empty_like(send)
            times = []
            for rep in range(args.repeats + 2):
                torch.cuda.synchronize()
                comm.Barrier()
                t = time.perf_counter()
                tr.start([(right, send)], [(left, recv)], tag=9).wait()
                torch.cuda.synchronize()
                if rep >= 2:
                    times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            rows.append({"transport": name, "bytes": nbytes, "median_s": statistics.median(times)})
            if comm.Get_rank() == 0:
                print(f"{name:<7} {nbytes:>10} B  {statistics.median(times) * 1e6:9.1f} us")
            nbytes *= 4
    if comm.Get_rank() == 0:
        write_json(args.json, {"benchmark": "gpu-comm", "ranks": comm.Get_size(), "rows": rows,
                               "environment": environment(comm)})
