"""A simulated slow network: wrap a transport so each request takes at least ``seconds``.

    slow = DelayedTransport(MPITransport(comm), seconds=0.02)
    ex = HaloExchange(plan, slow)           # the exchange now costs >= 20 ms per start/wait
    # time (local work + wait) with and without overlap to see how much of it the work hides
    slow = DelayedTransport(IPCTransport(comm, dev), 0.001, device=dev)   # on the device instead

The delay is measured from ``start``: a request whose caller computed for longer than ``seconds``
before waiting costs nothing extra, exactly like a transfer hidden behind computation. ``tags``
limits it to some kinds of message (e.g. the halo exchange's, not the plans' blocking ones), and
``delayed`` counts the requests it held back.

Where the delay runs: by default on the host (``wait`` sleeps until ``seconds`` after ``start``),
the model of a host transport, whose ``wait`` blocks the host until the message is in. A device
transport's ``wait`` does not block the host: it makes the compute stream wait for the
communication stream. So with ``device`` (the transport's
:class:`~halo.transport.streams.Device`) the delay runs there, as a slow link's transfer would:
``start`` pauses a stream of its own from the compute stream's point at ``start`` for
``seconds``, and ``wait`` makes the compute stream wait for that pause besides the transfer, the
host waiting for neither. A host sleep models such a transport badly: the GPU runs through it
whatever was queued before (and, on a GPU that ranks share, the other ranks' work), with overlap
or without. On an H200 shared by two ranks, 38 ms of host delay per step lengthened the step
without overlap by 11.5 ms only, and the share overlap hides was lost in the noise (docs/gpu.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Collection, Optional

from halo.transport.base import Peers, Request, Transport

if TYPE_CHECKING:
    from halo.transport.streams import Device, Event

__all__ = ["DelayedTransport", "DELAY_STREAMS"]

DELAY_STREAMS = 4  # device pauses that run side by side: more requests in flight queue behind


class DelayedRequest(Request):
    def __init__(self, inner: Request, ready_at: float) -> None:
        self._inner = inner
        self._ready_at = ready_at

    def test(self) -> bool:
        done = self._inner.test()  # progress the real transfer even while the delay runs
        return done and time.perf_counter() >= self._ready_at

    def wait(self) -> None:
        self._inner.wait()
        left = self._ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class DeviceDelayedRequest(Request):
    """A request whose completion on the device also waits for ``paused``, the end of its pause."""

    def __init__(self, inner: Request, device: "Device", paused: "Event") -> None:
        self._inner, self._device, self._paused = inner, device, paused

    def test(self) -> bool:
        return self._inner.test() and self._paused.query()

    def wait(self) -> None:
        self._inner.wait()
        self._device.compute.wait_event(self._paused)


class DelayedTransport(Transport):
    """``inner`` with every request's completion held back until ``seconds`` after its start: on
    the host, or with ``device`` on that device's timeline (the module docstring says which fits
    which transport); ``progress`` and ``close`` are ``inner``'s (it owns ``inner``)."""

    def __init__(self, inner: Transport, seconds: float,
                 tags: Optional[Collection[int]] = None, device: Optional["Device"] = None) -> None:
        if seconds < 0:
            raise ValueError(f"DelayedTransport: seconds is {seconds}; it must be >= 0")
        self.inner = inner
        self.kind = inner.kind
        self.seconds = float(seconds)
        self.tags = None if tags is None else frozenset(int(t) for t in tags)
        self.device = device
        # Pauses of requests in flight together run side by side, each on a stream of its own.
        self._streams = ([device.new_stream(f"delay{i}") for i in range(DELAY_STREAMS)]
                         if device is not None else [])
        self.delayed = 0  # requests held back so far

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        t0 = time.perf_counter()
        req = self.inner.start(sends, recvs, tag)
        if self.tags is not None and tag not in self.tags:
            return req
        self.delayed += 1
        if self.device is None:
            return DelayedRequest(req, t0 + self.seconds)
        stream = self._streams[self.delayed % DELAY_STREAMS]
        stream.wait_event(self.device.compute.record())
        stream.delay(self.seconds)
        return DeviceDelayedRequest(req, self.device, stream.record())

    def progress(self) -> bool:
        return self.inner.progress()

    def close(self) -> None:
        self.inner.close()
