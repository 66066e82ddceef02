"""``--transport`` in the trainer: resolve it on this rank's device, the same way on every rank.

    name = trainer_transport(cfg, device, comm)   # "mpi" on CPU; ConfigError for nccl without CUDA
    dc = device_comm(name, device)                # what makes each group's transports
    ctx = ParallelContext(comm, layout, transport=dc.halo, reducer=dc.reducer)
    pipe = Pipeline(model, ctx, transport=dc.stages)

On CPU only ``mpi`` exists (``auto`` -> ``mpi``); a device transport asked for on a CPU run is a
ConfigError on every rank (``agree``). On CUDA ``auto`` resolves to ``staged`` for now: halo rows
and plan coordinates then move device -> pinned host -> MPI -> pinned host -> device on a
communication stream, the path whose ordering the CPU suite tests on a stand-in device; ``nccl``
and ``ipc`` must be asked for by name. Reductions (gradient buckets, BatchNorm statistics,
pooling) of device tensors go through the matching reducer, ordered on the same device's streams:
NCCL's for ``nccl``, CUDA IPC's for ``ipc``, host-staged MPI for ``staged``. Pipeline stage
transfers of device tensors go through CUDA IPC for ``ipc`` when the job is on one node (its
sends wait for their receivers without blocking anyone: any later IPC call, the wait for a
header, or the executor between two blocks carries them out), else host-staged: their receives
are posted late and from both directions at once, which MPI's matching serves, while NCCL's
calls match in order on one stream. ``ipc`` with a spatial grid spread over nodes is a
ConfigError.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from halo.transport.base import Reducer, Transport, TransportError
from halo.transport.nccl import nccl_available
from halo.transport.select import choose_transport, make_reducer, make_transport, one_node
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.train.config import ConfigError, resolve_layout

__all__ = ["trainer_transport", "device_comm", "DeviceComm", "check_mpi_threads",
           "check_one_node_grids", "node_names"]


def trainer_transport(cfg: Any, device: torch.device, comm: Any) -> str:
    """The transport name for ``cfg.transport`` on ``device``. **Collective** over ``comm``: a
    ConfigError on any rank is raised on every rank."""
    from launch.device import ranks_per_gpu
    from sparsepipe_hpc.train.agreement import SetupError, agree

    # Outside pick: every rank must reach this collective, whatever pick raises where.
    gpu = None if device.type != "cuda" else (
        torch.cuda.current_device() if device.index is None else device.index)
    shared = ranks_per_gpu(comm, gpu) > 1
    nodes = node_names(comm) if cfg.transport == "ipc" else []

    def pick() -> str:
        try:
            if device.type != "cuda":
                return choose_transport(cfg.transport, "cpu")
            check_mpi_threads(comm)
            moves_device_tensors = math.prod(cfg.grid or (1, 1, 1)) > 1 or cfg.stages > 1
            if cfg.transport == "mpi" and moves_device_tensors:
                raise ConfigError(
                    "--transport mpi moves host tensors only, but with --device cuda the "
                    f"{'--grid halos' if cfg.stages == 1 else '--stages transfers'} move device "
                    "tensors between ranks; pass --transport staged (any MPI), ipc or nccl, "
                    "or auto")
            if cfg.transport == "auto":
                return "staged"
            if nodes:
                check_one_node_grids(resolve_layout(cfg, comm.Get_size()), nodes)
            return choose_transport(cfg.transport, "cuda", nccl=nccl_available(),
                                    shared_gpu=shared)
        except TransportError as e:
            raise ConfigError(str(e)) from None

    try:
        return str(agree(comm, pick))
    except SetupError as e:  # the same ConfigError on every rank, whichever rank found it
        raise ConfigError(str(e)) from None


def node_names(comm: Any) -> list[str]:
    """Each rank's node, as MPI sees shared memory (the test :func:`halo.transport.select.
    one_node` makes): the processor name of the node's lowest rank. **Collective.**"""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        first = local.bcast((comm.Get_rank(), MPI.Get_processor_name()), root=0)
    finally:
        local.Free()
    return [f"{name} (rank {rank})" for rank, name in comm.allgather(first)]


def check_one_node_grids(layout: RankLayout, hosts: list[str]) -> None:
    """Raise ConfigError when a spatial grid of ``layout`` has ranks on several of ``hosts``
    (the node of each rank): its halos cannot travel by CUDA IPC (``--transport ipc``)."""
    groups: dict[tuple[int, int], set[str]] = {}
    for rank, host in enumerate(hosts):
        p = layout.position(rank)
        groups.setdefault((p.replica, p.stage), set()).add(host)
    spans = {k: sorted(v) for k, v in groups.items() if len(v) > 1}
    if spans:
        (replica, stage), where = next(iter(spans.items()))
        raise ConfigError(f"--transport ipc moves halos within a node, but {len(spans)} spatial "
                          f"grid(s) of {layout} span nodes (replica {replica}, stage {stage}: "
                          f"{', '.join(where)}); pass --transport staged or nccl, or a --grid "
                          f"whose ranks share a node")


def check_mpi_threads(comm: Any) -> None:
    """Raise ConfigError unless MPI may be called from a thread other than the main one, as a
    CUDA run with several ranks does: autograd runs the backward of CUDA operations on a thread
    of its own, and that backward calls MPI (gradient buckets, BatchNorm statistics, halo
    adjoints). One call at a time (MPI_THREAD_SERIALIZED) is enough."""
    if comm.Get_size() == 1:
        return
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
             MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise ConfigError(
            f"--device cuda with {comm.Get_size()} ranks calls MPI from autograd's CUDA thread, "
            f"which needs MPI_THREAD_SERIALIZED or more, but MPI was initialized with "
            f"{names.get(level, level)}; leave mpi4py.rc.thread_level at 'multiple' (its "
            f"default) before importing mpi4py.MPI, or use an MPI built with thread support")


class DeviceComm(NamedTuple):
    """What makes each group's communication from its communicator (None: mpi4py on host
    tensors): the spatial grid's halo transport, the reducer of device tensors, and the pipeline
    stages' payload transport."""

    halo: Optional[Callable[[Any], Transport]] = None
    reducer: Optional[Callable[[Any], Optional[Reducer]]] = None
    stages: Optional[Callable[[Any], Transport]] = None


def device_comm(name: str, device: torch.device) -> DeviceComm:
    """The :class:`DeviceComm` of the resolved transport ``name``: all None for "mpi", else
    device ones on the streams of one :class:`~halo.transport.streams.CudaDevice` for
    ``device``, shared by every group (stage payloads through CUDA IPC for "ipc" on one node,
    else host-staged)."""
    if name == "mpi":
        return DeviceComm()
    from halo.transport.streams import CudaDevice

    streams = CudaDevice(device)

    def stages(comm: Any) -> Transport:  # collective over the job (one_node)
        ipc = name == "ipc" and one_node(comm)
        return make_transport("ipc" if ipc else "staged", comm, streams)

    return DeviceComm(halo=lambda comm: make_transport(name, comm, streams),
                      reducer=lambda comm: make_reducer(name, comm, streams), stages=stages)
