"""Transports: how halo messages move between ranks (host MPI now; CuPy + NCCL later).

    transport = MPITransport(grid.comm)
    req = transport.start(sends=[(1, buf_a)], recvs=[(1, buf_b)], tag=7)
    ...                      # compute while the messages move; req.test() makes progress
    req.wait()               # buf_b now holds rank 1's message

A transport moves whole tensors to and from peer ranks; matching is by (peer, tag) in posting
order, as in MPI. Layers above never touch MPI directly, so a device transport can replace
:class:`MPITransport` without changing them.

Modules: ``base`` (the interfaces: Transport, Reducer), ``mpi`` (host tensors, mpi4py),
``collectives`` (all-reduce, broadcast and all-gather of tensors: the one home of every collective
the layers make; a ReduceGroup routes device tensors to its Reducer), ``streams`` (stream/event
ordering: CUDA through torch, and a CPU stand-in for tests; staging-buffer pool), ``staged`` and
``staged_reduce`` (device -> pinned host -> MPI -> host -> device, point-to-point and all-reduce),
``nccl`` (CuPy NCCL, both), ``ipc`` and ``ipc_reduce`` (CUDA IPC between ranks of a node,
point-to-point and all-reduce; device work ordered across processes by interprocess events) on
``ipc_memory`` (CUDA's IPC buffers and events, or shared-memory files for the CPU stand-in),
``select`` (``--transport auto|nccl|ipc|staged|mpi``), ``delay`` (a simulated slow
network).
Nothing here imports CuPy at module import.
"""

from halo.transport.base import Reducer, Request, Transport, TransportError
from halo.transport.collectives import ReduceGroup, allgatherv, allreduce_, bcast_, iallreduce_
from halo.transport.delay import DelayedTransport
from halo.transport.mpi import MPITransport

__all__ = ["Transport", "Reducer", "Request", "TransportError", "MPITransport",
           "DelayedTransport", "ReduceGroup", "allreduce_", "iallreduce_", "bcast_", "allgatherv"]
