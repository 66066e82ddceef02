"""Which GPU is mine: round-robin over the visible CUDA devices by local rank.

Usage::

    from launch.env import detect
    from launch.device import select_gpu

    index = select_gpu(detect())          # None on a machine without CUDA
    device = torch.device("cpu" if index is None else f"cuda:{index}")
    # or: bind_gpu(detect()) also makes it the current device of torch (and of CuPy, if imported)

Indices are CUDA's, i.e. positions in ``CUDA_VISIBLE_DEVICES`` when it is set. The rule covers both
ways schedulers hand out GPUs:

* every rank of a node sees all the node's GPUs (``mpirun``; ``srun`` with ``--gpus-per-node``):
  local rank ``r`` of a node with ``g`` visible GPUs gets ``r % g``, so 4 ranks on 4 GPUs get one
  each, and 8 ranks on 4 GPUs share two per GPU;
* the scheduler gives each rank its own GPU (``srun --gpus-per-task=1``, a per-rank
  ``CUDA_VISIBLE_DEVICES``): one device is visible, and every rank gets index 0 -- its own GPU.

Nothing here imports torch or CuPy at module import; counting devices imports torch lazily and never
creates a CUDA context (``torch.cuda.device_count`` asks NVML), so it is safe before ``fork``.
:func:`gpu_uuid` and :func:`ranks_per_gpu` (collective: which ranks share a GPU) initialize CUDA:
call them once the rank computes on its GPU.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections import Counter
from typing import Any

from launch.env import Placement

__all__ = ["select_gpu", "bind_gpu", "make_current", "gpu_for_local_rank", "visible_gpu_count",
           "visible_devices", "physical_gpu", "gpu_uuid", "ranks_per_gpu"]

_INDEX = re.compile(r"^\d+$")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/-]+$")


def visible_devices(value: str | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA honours, or ``None`` when it is unset.

    CUDA reads the list up to its first invalid entry: ``"0,2"`` -> ``["0", "2"]``, ``""`` and
    ``"-1"`` -> ``[]`` (no device), ``"1,-1,3"`` -> ``["1"]``; ``GPU-<uuid>``/``MIG-<uuid>`` entries
    count as valid.
    """
    value = os.environ.get("CUDA_VISIBLE_DEVICES") if value is None else value
    if value is None:
        return None
    entries: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not (_INDEX.match(item) or _UUID.match(item)):
            break
        entries.append(item)
    return entries


# Device files of a GPU driver (NVIDIA; AMD's for ROCm builds of torch, which answer torch.cuda).
_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")


def visible_gpu_count() -> int:
    """CUDA devices this process can use (after ``CUDA_VISIBLE_DEVICES``); 0 without CUDA.

    Without a GPU driver on the machine the answer is 0 at once, without importing torch.
    """
    if visible_devices() == []:
        return 0
    if "torch" not in sys.modules and not any(os.path.exists(f) for f in _DRIVER_FILES):
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # no torch, or a CUDA driver that fails: try CuPy, then give up
        pass
    try:
        import cupy  # type: ignore[import-not-found]

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def gpu_for_local_rank(local_rank: int, count: int) -> int | None:
    """Round-robin: ``local_rank % count``; ``None`` when ``count`` is 0."""
    if count < 0 or local_rank < 0:
        raise ValueError(f"local_rank {local_rank} and device count {count} must be >= 0")
    return None if count == 0 else local_rank % count


def select_gpu(placement: Placement, count: int | None = None) -> int | None:
    """This rank's CUDA device index, or ``None`` when no CUDA device is visible.

    ``count``: the visible devices; default :func:`visible_gpu_count`.
    """
    return gpu_for_local_rank(placement.local_rank,
                              visible_gpu_count() if count is None else count)


def physical_gpu(index: int | None) -> str:
    """The driver's name for device ``index``: its ``CUDA_VISIBLE_DEVICES`` entry, or the index."""
    if index is None:
        return "-"
    entries = visible_devices()
    if entries and index < len(entries):
        return entries[index]
    return str(index)


def make_current(index: int) -> None:
    """Make CUDA device ``index`` current for torch, and for CuPy if it is imported."""
    import torch

    torch.cuda.set_device(index)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device(index).use()


def bind_gpu(placement: Placement) -> int | None:
    """Select this rank's GPU and make it current for torch (and CuPy, if imported); return it."""
    index = select_gpu(placement)
    if index is not None:
        make_current(index)
    return index


def gpu_uuid(index: int) -> str | None:
    """The driver's UUID of CUDA device ``index``: the same in every process that uses that GPU,
    whatever each one's ``CUDA_VISIBLE_DEVICES`` says; ``None`` where torch cannot tell."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # no CUDA, or a torch without the field
        return None
    return uuid or None


def ranks_per_gpu(comm: Any, index: int | None) -> int:
    """The most ranks of ``comm`` on one GPU, ``index`` being this rank's CUDA device (1 when
    every rank has its own); ``index=None`` (no GPU): the most ranks on one node. **Collective.**

    A GPU is named by its UUID, so ranks that each see only their own GPU as device 0 (``srun
    --gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``) count as one per GPU; where torch
    gives no UUID, by host and :func:`physical_gpu`. Initializes CUDA in this process: call it
    once the rank computes on its GPU.
    """
    host = socket.gethostname()
    where = (host, "cpu") if index is None else (gpu_uuid(index) or (host, physical_gpu(index)))
    return max(Counter(comm.allgather(where)).values())
