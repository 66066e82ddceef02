"""Host-staged transport: device -> pinned host -> MPI -> pinned host -> device, stream-ordered.

    dev = CudaDevice()                                  # or SimDevice() on the CPU (tests)
    transport = StagedTransport(MPITransport(comm), dev)
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=7)
    ...                                                 # enqueue interior work on dev.compute
    req.wait()                                          # compute stream now waits for d_recv

Correct on any MPI, CUDA-aware or not: MPI only ever sees host buffers. Order of work:

    compute: ...produce d_send, last read of d_recv... [ev0]        [wait ev2] ...use d_recv...
    comm:                   [wait ev0] D2H(d_send -> h_send) [ev1]   H2D(h_recv -> d_recv) [ev2]
    host:    Irecv(h_recv) at start; Isend(h_send) once ev1 has completed; MPI completes; H2D

Sends are posted to MPI in the order the requests were started (MPI's per-peer matching order),
even when a later request's copy finishes first; a rank waiting on one request keeps posting the
later ones as their copies finish (its peer may need them first). Staging buffers come from a
:class:`~halo.transport.streams.StagingPool` and go back with the event of the last copy that uses
them. After ``wait`` the receive tensors are ready *for work enqueued on the compute stream*; the
host itself must synchronize the stream before reading them (as with any CUDA kernel output).
The host blocks only where MPI needs host data: on the D2H copy before a send is posted.

Status: the ordering logic is tested on the CPU under mpirun with :class:`SimDevice`
(tests/mpi/test_staged_transport.py), and ran with :class:`CudaDevice` on an H100 (two ranks
sharing it; docs/gpu.md).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.streams import Device, Event, StagingPool

__all__ = ["StagedTransport", "StagedRequest"]


def _host_view(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buf``'s first bytes as a tensor of ``t``'s dtype and shape."""
    return buf[:t.nbytes].view(t.dtype).view(t.shape)


class StagedRequest(Request):
    """One exchange through host staging buffers; see the module docstring."""

    def __init__(self, owner: "StagedTransport", sends: Peers, recvs: list[tuple[torch.Tensor,
                 torch.Tensor]], host_recv: Request, send_bufs: list[torch.Tensor],
                 recv_bufs: list[torch.Tensor], d2h: Optional[Event], tag: int) -> None:
        self._owner, self._sends, self._recvs = owner, sends, recvs
        self._host_recv, self._send_bufs, self._d2h, self._tag = host_recv, send_bufs, d2h, tag
        self._recv_bufs = recv_bufs
        self._host_send: Optional[Request] = None
        self._done = False

    def _post_sends(self) -> None:
        """Hand the staged sends to MPI (the host waits for their D2H copy)."""
        if self._d2h is not None:
            self._d2h.synchronize()
        self._host_send = self._owner.host.start(self._sends, [], self._tag)

    @property
    def _posted(self) -> bool:
        return self._host_send is not None

    def test(self) -> bool:
        if self._done:
            return True
        self._owner._post_in_order(upto=None)
        if not self._posted:
            return False
        assert self._host_send is not None
        if self._host_recv.test() and self._host_send.test():
            self._finish()
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        o = self._owner
        o._post_in_order(upto=self)
        assert self._host_send is not None
        # Sends started after this request may still be held back, their D2H copy running. A
        # peer may need one of them before it sends what this request waits for (1F1B with 3+
        # stages: act 1 before grad 0), so post them as their copies finish instead of
        # blocking in MPI with them unsent - a deadlock on a GPU, whose copies lag.
        polls = 0
        while o._unposted and not (self._host_recv.test() and self._host_send.test()):
            o.progress()
            polls += 1
            time.sleep(0 if polls < 100 else 1e-4)  # yield to ranks sharing this core
        self._host_recv.wait()
        self._host_send.wait()
        self._finish()

    def _finish(self) -> None:
        """H2D copies on the comm stream; the compute stream waits for them; buffers go back."""
        o = self._owner
        for dev_t, host_t in self._recvs:
            o.comm_stream.copy_(dev_t, host_t)
        done = o.comm_stream.record()
        o.device.compute.wait_event(done)
        for buf in self._send_bufs:  # MPI has sent them: free once the D2H (before ``done``) ran
            o.pool.release(buf, done)
        for buf in self._recv_bufs:
            o.pool.release(buf, done)  # reused only after its H2D copy ran
        self._done = True


class StagedTransport(Transport):
    """``host`` (a host transport, e.g. MPITransport) behind pinned staging on ``device``."""

    kind = "staged"

    def __init__(self, host: Transport, device: Device) -> None:
        self.host, self.device = host, device
        self.comm_stream = device.new_stream("comm")
        self.pool = StagingPool(device)
        self._unposted: list[StagedRequest] = []  # started, sends not yet handed to MPI

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in sends + recvs:
            if not t.is_contiguous():
                raise TransportError(f"StagedTransport: the tensor for rank {peer} of shape "
                                     f"{tuple(t.shape)} is not contiguous; pass a contiguous one")
        # Receives first, into staging buffers, so an early message has somewhere to land.
        rbufs = [self.pool.acquire(t.nbytes) for _, t in recvs]
        host_recvs = [(peer, _host_view(b, t)) for b, (peer, t) in zip(rbufs, recvs)]
        host_recv = self.host.start([], host_recvs, tag)
        # Everything enqueued on the compute stream so far comes first: the producers of the send
        # tensors, and the last readers of the receive tensors (the H2D copy overwrites them).
        self.comm_stream.wait_event(self.device.compute.record())
        d2h: Optional[Event] = None
        sbufs, host_sends = [], []
        if sends:
            for peer, t in sends:
                b = self.pool.acquire(t.nbytes)
                self.comm_stream.copy_(_host_view(b, t), t)
                sbufs.append(b)
                host_sends.append((peer, _host_view(b, t)))
            d2h = self.comm_stream.record()
        req = StagedRequest(self, host_sends, [(t, h) for (_, t), (_, h) in zip(recvs, host_recvs)],
                            host_recv, sbufs, rbufs, d2h, tag)
        self._unposted.append(req)
        self._post_in_order(upto=None)
        return req

    def progress(self) -> bool:
        self._post_in_order(upto=None)
        return bool(self._unposted)

    def _post_in_order(self, upto: Optional[StagedRequest]) -> None:
        """Post the sends of started requests, oldest first: those whose D2H copy is done, and
        (blocking on their copies) every one up to and including ``upto``."""
        while self._unposted:
            head = self._unposted[0]
            must = upto is not None and any(r is upto for r in self._unposted)
            if not must and head._d2h is not None and not head._d2h.query():
                return
            self._unposted.pop(0)
            head._post_sends()
            if head is upto:
                return
