"""``--transport`` in the trainer: resolve it on this rank's device, the same way on every rank.

    name = trainer_transport(cfg, device, comm)   # "mpi" on CPU; ConfigError for nccl without CUDA
    make, reduce = device_comm(name, device)      # None, None (mpi4py) or comm -> transport,
    ctx = ParallelContext(comm, layout, transport=make, reducer=reduce)   # comm -> reducer

On CPU only ``mpi`` exists (``auto`` -> ``mpi``); a device transport asked for on a CPU run is a
ConfigError on every rank (``agree``). On CUDA ``auto`` resolves to ``staged`` for now: halo rows
and plan coordinates then move device -> pinned host -> MPI -> pinned host -> device on a
communication stream, the path whose ordering the CPU suite tests on a stand-in device; ``nccl``
and ``ipc`` must be asked for by name (not yet run on a GPU). Reductions (gradient buckets,
BatchNorm statistics, pooling) of device tensors go through the matching reducer on a stream of
the same device: NCCL's for ``nccl``, host-staged MPI for ``staged`` and ``ipc``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from halo.transport.base import Reducer, Transport, TransportError
from halo.transport.select import choose_transport, make_reducer, make_transport
from sparsepipe_hpc.train.config import ConfigError

__all__ = ["trainer_transport", "device_comm"]


def _nccl_imports() -> bool:
    import importlib

    try:  # imported on use only, never at module import
        importlib.import_module("cupy.cuda.nccl")
    except Exception:
        return False
    return True


def trainer_transport(cfg: Any, device: torch.device, comm: Any) -> str:
    """The transport name for ``cfg.transport`` on ``device``. **Collective** over ``comm``: a
    ConfigError on any rank is raised on every rank."""
    from sparsepipe_hpc.train.agreement import SetupError, agree

    def pick() -> str:
        try:
            if device.type != "cuda":
                return choose_transport(cfg.transport, "cpu")
            if cfg.transport == "auto":
                return "staged"
            from launch.env import detect

            shared = detect(comm).local_size > max(1, torch.cuda.device_count())
            return choose_transport(cfg.transport, "cuda", nccl=_nccl_imports(),
                                    shared_gpu=shared)
        except TransportError as e:
            raise ConfigError(str(e)) from None

    try:
        return str(agree(comm, pick))
    except SetupError as e:  # the same ConfigError on every rank, whichever rank found it
        raise ConfigError(str(e)) from None


def device_comm(name: str, device: torch.device
                ) -> tuple[Optional[Callable[[Any], Transport]],
                           Optional[Callable[[Any], Optional[Reducer]]]]:
    """What makes a group's halo transport and its reducer from its communicator, for the
    resolved ``name``: (None, None) for "mpi" (host buffers, the default), else device ones on
    the streams of one :class:`~halo.transport.streams.CudaDevice` for ``device``, shared by
    every group (the ParallelContext's ``transport=`` and ``reducer=``)."""
    if name == "mpi":
        return None, None
    from halo.transport.streams import CudaDevice

    streams = CudaDevice(device)
    return (lambda comm: make_transport(name, comm, streams),
            lambda comm: make_reducer(name, comm, streams))
