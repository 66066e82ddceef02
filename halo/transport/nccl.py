"""NCCL transport through CuPy: grouped send/receive and all-reduce on a communication stream.

    transport = NCCLTransport(comm, CudaDevice())       # collective: rank 0's unique id, bcast
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=0)
    req.wait()                                          # the compute stream waits; the host not
    transport.iallreduce_(grads).wait()                 # in place; also a Reducer

Ran on an H100 at world size 1 (``tests/mpi/test_nccl.py``, 2026-11-26; docs/gpu.md); between
several GPUs it has not run anywhere (NCCL refuses two ranks on one GPU, and every machine lent
here has one).

Zero copy: NCCL reads and writes the torch tensors' memory through their raw pointers, on the
communication stream, after an event recorded on the compute stream; the tensors are marked used
by that stream (``record_stream``) so the caching allocator keeps them until the work ran. NCCL
matches by call order per communicator, not by tag: every rank must start the same exchanges in
the same order (the halo exchange and the gradient buckets already do); ``tag`` is ignored.
CuPy is imported when a transport is built, never at module import.
"""

from __future__ import annotations

from typing import Any

import torch

from halo.transport.base import (CompletedRequest, Peers, Reducer, Request, Transport,
                                 TransportError)
from halo.transport.streams import Device, Event

__all__ = ["NCCLTransport", "StreamRequest", "nccl_available"]


class StreamRequest(Request):
    """Work enqueued on a stream; ``wait`` makes the stream torch computes on at the time of the
    wait (as the other transports' waits: autograd's thread may start what the main thread
    waits for) wait for it, without blocking the host."""

    def __init__(self, done: Event, device: Device, keep: list[torch.Tensor]) -> None:
        self._done, self._device, self._keep = done, device, keep
        self._waited = False

    def test(self) -> bool:
        return self._done.query()

    def wait(self) -> None:
        if not self._waited:
            self._device.compute.wait_event(self._done)
            self._waited = True


def nccl_available() -> bool:
    """Whether CuPy imports here with NCCL. ``import cupy.cuda.nccl`` alone does not say: CuPy
    built without NCCL imports that module all the same, with ``available = False`` and no
    functions (checked in CuPy 14)."""
    try:  # imported on use only, never at module import
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or a CuPy that cannot load its CUDA libraries
        return False
    return bool(getattr(nccl, "available", False))


def _nccl_dtype(nccl: Any, t: torch.Tensor) -> Any:
    table = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
             torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
             torch.int64: "NCCL_INT64", torch.int32: "NCCL_INT32", torch.uint8: "NCCL_UINT8",
             torch.int8: "NCCL_INT8"}
    name = table.get(t.dtype)
    if name is None or not hasattr(nccl, name):
        raise TransportError(f"NCCLTransport: dtype {t.dtype} has no NCCL type here; pass one "
                             f"of {', '.join(str(d) for d in table)}")
    return getattr(nccl, name)


class NCCLTransport(Transport, Reducer):
    """NCCL over the ranks of the mpi4py communicator ``comm`` (one GPU per rank): point-to-point
    and all-reduce on one NCCL communicator and stream."""

    kind = "nccl"

    def __init__(self, comm: Any, device: Device) -> None:
        if not nccl_available():
            raise TransportError("NCCLTransport needs CuPy with NCCL (cupy.cuda.nccl.available) "
                                 "and this CuPy has none; install cupy-cuda12x/13x with NCCL, "
                                 "or use the staged transport")
        from cupy.cuda import nccl  # on use only

        self._nccl = nccl
        uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
        self.nccl_comm: Any = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.device = device
        self.stream = device.new_stream("nccl")

    def close(self) -> None:
        """Destroy the NCCL communicator once its stream has run what was enqueued (closing
        again does nothing; a call after it raises TransportError)."""
        if self.nccl_comm is None:
            return
        self.stream.record().synchronize()
        self.nccl_comm.destroy()
        self.nccl_comm = None

    def _handle(self) -> int:
        return int(self.stream.stream.cuda_stream)  # type: ignore[attr-defined]

    def _check(self, t: torch.Tensor, what: str) -> None:
        if self.nccl_comm is None:
            raise TransportError("NCCLTransport: used after close (its communicator is gone)")
        if not t.is_cuda or not t.is_contiguous():
            raise TransportError(f"NCCLTransport: {what} must be a contiguous CUDA tensor; got "
                                 f"{'a non-contiguous' if t.is_cuda else 'a'} tensor on {t.device}")

    def _enqueue(self, tensors: list[torch.Tensor]) -> None:
        self.stream.wait_event(self.device.compute.record())  # after the producers
        for t in tensors:
            t.record_stream(self.stream.stream)  # type: ignore[attr-defined]

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in recvs:
            self._check(t, f"the receive buffer from rank {peer}")
        for peer, t in sends:
            self._check(t, f"the send buffer to rank {peer}")
        tensors = [t for _, t in recvs] + [t for _, t in sends]
        self._enqueue(tensors)
        nccl, s = self._nccl, self._handle()
        nccl.groupStart()
        try:
            for peer, t in recvs:
                self.nccl_comm.recv(t.data_ptr(), t.nbytes, nccl.NCCL_UINT8, peer, s)
            for peer, t in sends:
                self.nccl_comm.send(t.data_ptr(), t.nbytes, nccl.NCCL_UINT8, peer, s)
        finally:
            nccl.groupEnd()
        return StreamRequest(self.stream.record(), self.device, tensors)

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Request:
        """Start an in-place all-reduce on the NCCL stream; ``wait`` makes the compute stream
        wait for it."""
        self._check(t, "the all-reduce buffer")
        nccl = self._nccl
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        if op not in ops:
            raise ValueError(f"reduction op must be one of sum, max, min; got {op!r}")
        dtype = _nccl_dtype(nccl, t)
        self._enqueue([t])
        self.nccl_comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), dtype, ops[op],
                                 self._handle())
        return StreamRequest(self.stream.record(), self.device, [t])
