"""Host-staged all-reduce of device tensors: device -> pinned host -> MPI -> pinned host -> device.

    reducer = StagedReducer(comm, CudaDevice())         # or SimDevice() on the CPU (tests)
    req = reducer.iallreduce_(grads)                    # returns at once
    ...                                                 # enqueue more work on dev.compute
    req.wait()                                          # compute stream now waits for the sum

The reduction half of :class:`~halo.transport.staged.StagedTransport`, for any MPI, CUDA-aware or
not (MPI only sees host buffers). Order of work:

    compute: ...produce t... [ev0]                                     [wait ev2] ...use t...
    reduce:        [wait ev0] D2H(t -> h) [ev1]        H2D(h -> t) [ev2]
    host:    Iallreduce(h) once ev1 has completed; on completion, enqueue the H2D

The MPI all-reduce of a request starts once its D2H copy has run, in the order the requests were
started (non-blocking collectives match by start order on every rank), checked by ``test`` and
forced by ``wait``. A dtype MPI cannot reduce (float16, bfloat16, bool) is widened on the device
first (float64 / int64: exact for max and min; a sum rounds once, to t's dtype) and narrowed back
on the compute stream. Staging buffers come from a :class:`~halo.transport.streams.StagingPool`
and return with the H2D copy's event.

Status: the ordering is tested on the CPU under mpirun with :class:`SimDevice`
(tests/mpi/test_staged_reduce.py), and ran with :class:`CudaDevice` on an H100 (two ranks
sharing it; docs/gpu.md).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from halo.transport.base import CompletedRequest, Reducer, Request, TransportError
from halo.transport.collectives import mpi_op, mpi_types, raw_buffer
from halo.transport.streams import Device, Event, StagingPool

__all__ = ["StagedReducer"]


class _StagedReduction(Request):
    """One all-reduce through a host staging buffer; see the module docstring."""

    def __init__(self, owner: "StagedReducer", t: torch.Tensor, src: torch.Tensor,
                 buf: torch.Tensor, d2h: Event, op: str) -> None:
        self._owner, self._t, self._src, self._buf, self._d2h = owner, t, src, buf, d2h
        self._op = op
        self._mpi: Any = None  # the MPI request once started
        self._done = False

    @property
    def _host(self) -> torch.Tensor:
        return self._buf[:self._src.nbytes].view(self._src.dtype)

    def _start_mpi(self) -> None:
        from mpi4py import MPI

        self._d2h.synchronize()  # MPI reads the host buffer: its copy must have landed
        self._mpi = self._owner.comm.Iallreduce(
            MPI.IN_PLACE, [raw_buffer(self._host), mpi_types()[self._src.dtype]],
            op=mpi_op(self._op))

    def test(self) -> bool:
        if self._done:
            return True
        self._owner._start_in_order(upto=None)
        if self._mpi is not None and self._mpi.Test():
            self._finish()
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        self._owner._start_in_order(upto=self)
        self._mpi.Wait()
        self._finish()

    def _finish(self) -> None:
        o = self._owner
        o.stream.copy_(self._src, self._host)
        done = o.stream.record()
        o.device.compute.wait_event(done)
        if self._src is not self._t:  # widened: narrow back, after the H2D, on compute
            o.device.compute.copy_(self._t, self._src)
        o.pool.release(self._buf, done)
        self._done = True


class StagedReducer(Reducer):
    """All-reduce of ``device``'s tensors over the mpi4py communicator ``comm`` through pinned
    host buffers and ``MPI_Iallreduce``; see the module docstring."""

    def __init__(self, comm: Any, device: Device) -> None:
        # A duplicate (collective): the MPI all-reduces start late, whenever their copies have
        # run, so a blocking collective of the caller's on ``comm`` could come before one on one
        # rank and after it on another; MPI would match the two (a silently wrong sum).
        self.comm: Any = comm.Dup()
        self.device = device
        self.stream = device.new_stream("reduce")
        self.pool = StagingPool(device)
        self._unstarted: list[_StagedReduction] = []

    def close(self) -> None:
        """Free the duplicated communicator (collective, once every all-reduce has completed);
        closing again does nothing, an all-reduce after it raises TransportError."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Request:
        self._check(t, op)
        if self.comm is None:
            raise TransportError("StagedReducer: used after close (its communicator is freed)")
        if self.comm.Get_size() == 1:
            return CompletedRequest()
        src = t
        if t.dtype not in mpi_types():  # widened on the compute stream, before the event below
            src = torch.empty(t.shape, device=t.device,
                              dtype=torch.float64 if t.is_floating_point() else torch.int64)
            self.device.compute.copy_(src, t)  # (a host-side t.to() would not wait for t)
        buf = self.pool.acquire(src.nbytes)
        self.stream.wait_event(self.device.compute.record())
        self.stream.copy_(buf[:src.nbytes].view(src.dtype), src)
        req = _StagedReduction(self, t, src, buf, self.stream.record(), op)
        self._unstarted.append(req)
        self._start_in_order(upto=None)
        return req

    def _start_in_order(self, upto: Optional[_StagedReduction]) -> None:
        """Start the MPI all-reduces of started requests, oldest first: those whose D2H copy has
        run, and (blocking on their copies) every one up to and including ``upto``."""
        while self._unstarted:
            head = self._unstarted[0]
            if upto is None or not any(r is upto for r in self._unstarted):
                if not head._d2h.query():
                    return
            self._unstarted.pop(0)
            head._start_mpi()
            if head is upto:
                return
