"""A simulated slow network: wrap a transport so each request takes at least ``seconds``.

    slow = DelayedTransport(MPITransport(comm), seconds=0.02)
    ex = HaloExchange(plan, slow)           # the exchange now costs >= 20 ms per start/wait
    # time (local work + wait) with and without overlap to see how much of it the work hides

The delay is measured from ``start``: a request whose caller computed for longer than ``seconds``
before waiting costs nothing extra, exactly like a transfer hidden behind computation. ``tags``
limits it to some kinds of message (e.g. the halo exchange's, not the plans' blocking ones), and
``delayed`` counts the requests it held back.
"""

from __future__ import annotations

import time
from typing import Collection, Optional

from halo.transport.base import Peers, Request, Transport

__all__ = ["DelayedTransport"]


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


class DelayedTransport(Transport):
    """``inner`` with every request's completion held back until ``seconds`` after its start;
    ``progress`` and ``close`` are ``inner``'s (it owns ``inner``)."""

    def __init__(self, inner: Transport, seconds: float,
                 tags: Optional[Collection[int]] = None) -> None:
        if seconds < 0:
            raise ValueError(f"DelayedTransport: seconds is {seconds}; it must be >= 0")
        self.inner = inner
        self.kind = inner.kind
        self.seconds = float(seconds)
        self.tags = None if tags is None else frozenset(int(t) for t in tags)
        self.delayed = 0  # requests held back so far

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        t0 = time.perf_counter()
        req = self.inner.start(sends, recvs, tag)
        if self.tags is not None and tag not in self.tags:
            return req
        self.delayed += 1
        return DelayedRequest(req, t0 + self.seconds)

    def progress(self) -> bool:
        return self.inner.progress()

    def close(self) -> None:
        self.inner.close()
