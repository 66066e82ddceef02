"""Which transport a run uses: ``--transport auto|nccl|ipc|staged|mpi`` against the device.

    name = choose_transport("auto", "cpu")                  # "mpi"
    name = choose_transport("auto", "cuda", nccl=True, shared_gpu=False)   # "nccl"
    choose_transport("nccl", "cpu")                         # TransportError: needs --device cuda
    transport = make_transport("staged", comm, CudaDevice())  # the object, over one communicator
    reducer = make_reducer("staged", comm, CudaDevice())      # its all-reduce of device tensors

Pure: the caller says what the machine offers (device type, whether CuPy's NCCL imports, whether
ranks of one node share a GPU). ``auto`` picks, for device tensors, NCCL when every rank has its
own GPU and NCCL is there, CUDA IPC when ranks share GPUs on a node (NCCL refuses two ranks on one
GPU), host-staged MPI otherwise; for CPU tensors mpi4py. ``device=None``: not known yet (``--device
auto`` before CUDA was probed): only the names that can never work are refused.

:func:`make_transport` builds the chosen transport over one communicator; each group of ranks
(the spatial grid, a stage pair) gets its own, made by the layer that owns the communicator.
:func:`make_reducer` builds the matching all-reduce of device tensors: NCCL's own, CUDA IPC's
(every rank's tensor to every other, summed alike on each), or host-staged MPI.
"""

from __future__ import annotations

from typing import Any, Optional

from halo.transport.base import Reducer, Transport, TransportError
from halo.transport.streams import Device

__all__ = ["TRANSPORTS", "DEVICE_TRANSPORTS", "choose_transport", "make_transport",
           "make_reducer", "one_node"]

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
        raise TransportError("--transport nccl needs CuPy with NCCL (cupy.cuda.nccl.available) "
                             "and this machine has none; install cupy-cuda12x/13x or pass "
                             "--transport staged")
    if name == "nccl" and shared_gpu:
        raise TransportError("--transport nccl: several ranks share a GPU and NCCL refuses "
                             "two ranks on one GPU ('Duplicate GPU detected'); pass --transport "
                             "ipc or staged, or one rank per GPU")
    return name


def make_transport(name: str, comm: Any, device: Optional[Device] = None) -> Transport:
    """The transport ``name`` ("mpi", "staged", "ipc" or "nccl", as :func:`choose_transport`
    resolved it) over the mpi4py communicator ``comm``; the device transports order their work
    on ``device``'s streams (:class:`~halo.transport.streams.CudaDevice`, or the CPU stand-in
    in tests). Collective over ``comm`` for "nccl" (its unique id is broadcast) and "ipc" (it
    checks that ``comm`` is on one node, the same verdict on every rank, and duplicates it)."""
    if name == "mpi":
        from halo.transport.mpi import MPITransport

        return MPITransport(comm)
    if name not in DEVICE_TRANSPORTS:
        raise TransportError(f"make_transport: {name!r} is not a transport; pass one of mpi, "
                             f"{', '.join(DEVICE_TRANSPORTS)} (resolve 'auto' with "
                             f"choose_transport first)")
    if device is None:
        raise TransportError(f"make_transport: the {name} transport moves device tensors and "
                             f"needs the device whose streams order its copies; pass device=")
    if name == "staged":
        from halo.transport.mpi import MPITransport
        from halo.transport.staged import StagedTransport

        return StagedTransport(MPITransport(comm), device)
    if name == "ipc":
        from halo.transport.ipc import IPCTransport

        if not one_node(comm):  # CUDA IPC handles open only on the node that made them
            raise TransportError(f"the ipc transport connects the ranks of one node, but this "
                                 f"group of {comm.Get_size()} ranks spans nodes; pass "
                                 f"--transport staged (any MPI) or nccl, or place the group's "
                                 f"ranks on one node")
        return IPCTransport(comm, device)
    from halo.transport.nccl import NCCLTransport

    return NCCLTransport(comm, device)


def one_node(comm: Any) -> bool:
    """Whether every rank of the mpi4py communicator ``comm`` shares this rank's node
    (collective)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return bool(local.Get_size() == comm.Get_size())
    finally:
        local.Free()


def make_reducer(name: str, comm: Any, device: Optional[Device] = None) -> Optional[Reducer]:
    """The all-reduce of ``device``'s tensors over ``comm`` for the resolved transport ``name``:
    None for "mpi" (host tensors, reduced where they lie), NCCL's for "nccl", CUDA IPC's for
    "ipc" where every rank of ``comm`` is on this node, else host-staged MPI on a stream of
    ``device`` (each collective over ``comm``; ``close`` it, collectively, when done)."""
    if name == "mpi":
        return None
    if name not in DEVICE_TRANSPORTS:
        raise TransportError(f"make_reducer: {name!r} is not a transport; pass one of mpi, "
                             f"{', '.join(DEVICE_TRANSPORTS)}")
    if device is None:
        raise TransportError(f"make_reducer: the {name} transport reduces device tensors and "
                             f"needs the device whose streams order its copies; pass device=")
    if name == "nccl":
        from halo.transport.nccl import NCCLTransport

        return NCCLTransport(comm, device)
    if name == "ipc" and one_node(comm):  # replicas on other nodes: no CUDA IPC to them
        from halo.transport.ipc_reduce import IPCReducer

        return IPCReducer(comm, device)
    from halo.transport.staged_reduce import StagedReducer

    return StagedReducer(comm, device)
