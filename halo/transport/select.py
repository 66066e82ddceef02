"""Which transport a run uses: ``--transport auto|nccl|ipc|staged|mpi`` against the device.

    name = choose_transport("auto", "cpu")                  # "mpi"
    name = choose_transport("auto", "cuda", nccl=True, shared_gpu=False)   # "nccl"
    choose_transport("nccl", "cpu")                         # TransportError: needs --device cuda

Pure: the caller says what the machine offers (device type, whether CuPy's NCCL imports, whether
ranks of one node share a GPU). ``auto`` picks, for device tensors, NCCL when every rank has its
own GPU and NCCL is there, CUDA IPC when ranks share GPUs on a node (NCCL refuses two ranks on one
GPU), host-staged MPI otherwise; for CPU tensors mpi4py. ``device=None``: not known yet (``--device
auto`` before CUDA was probed): only the names that can never work are refused.
"""

from __future__ import annotations

from typing import Optional

from halo.transport.base import TransportError

__all__ = ["TRANSPORTS", "DEVICE_TRANSPORTS", "choose_transport"]

TRANSPORTS = ("auto", "nccl", "ipc", "staged", "mpi")
DEVICE_TRANSPORTS = ("nccl", "ipc", "staged")


def choose_transport(name: str, device: Optional[str], nccl: bool = False,
                     shared_gpu: bool = False) -> str:
    """The transport ``name`` resolves to on ``device`` ("cpu", "cuda", or None: not known yet;
    then "auto" comes back unresolved). Raises TransportError naming the remedy."""
    if name not in TRANSPORTS:
        raise TransportError(f"--transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")
    if device is None:
        return name
    if device == "cpu":
        if name in DEVICE_TRANSPORTS:
            raise TransportError(f"--transport {name} moves CUDA device tensors but this run "
                                 f"computes on the CPU (no CUDA device, or --device cpu); pass "
                                 f"--transport mpi (or auto), or --device cuda on a GPU machine")
        return "mpi"
    if name == "auto":
        return "ipc" if shared_gpu else ("nccl" if nccl else "staged")
    if name == "nccl" and not nccl:
        raise TransportError("--transport nccl needs CuPy with NCCL (cupy.cuda.nccl) and it does "
                             "not import here; install cupy-cuda12x/13x or pass --transport "
                             "staged")
    if name == "nccl" and shared_gpu:
        raise TransportError("--transport nccl: ranks of this node share a GPU and NCCL refuses "
                             "two ranks on one GPU ('Duplicate GPU detected'); pass --transport "
                             "ipc or staged, or one rank per GPU")
    return name
