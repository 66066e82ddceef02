"""Streams and events, the ordering device transports rely on: a CUDA one and a CPU stand-in.

    dev = SimDevice()                       # CPU stand-in: streams are queues run in order
    comm = dev.new_stream("comm")
    ev = dev.compute.record()               # a point in the compute stream's work
    comm.wait_event(ev)                     # comm's later work starts after that point
    comm.copy_(host_buf, device_buf)        # enqueued, runs when comm gets there
    comm.record().query()                   # True once comm has run everything before it

A device transport orders its work with these and never blocks the host on the device: ``start``
records an event on the compute stream and makes the communication stream wait on it; ``wait``
makes the compute stream wait on the communication stream's event. :class:`CudaDevice` maps this
onto ``torch.cuda.Stream``/``Event`` (no CuPy). :class:`SimDevice` is the same contract on the CPU
for tests: each stream is a FIFO of operations that run eagerly as soon as what they wait for has
run, and a test can ``hold`` a stream (a slow GPU) to check that nothing runs out of order - a
copy reads its source when it runs, not when it is enqueued, exactly as on a GPU.
``SimDevice(lag=k)`` is asynchronous as a GPU is: an operation runs only ``k`` ticks after it was
enqueued (a tick: each time the host enqueues or queries), so a host that stops touching the
device while blocked elsewhere (in MPI) sees its copies still pending, and ``synchronize`` ticks
until they are done. ``SimDevice(lag=k, autonomous=True)`` also ticks on its own, every half
millisecond, from a thread: its work runs while its host is blocked, as a GPU's does, which a
peer process waiting on that work (an event another process completes: ``external``) needs.
``stream.delay(seconds)`` pauses one stream and nothing else (a slow link's transfer, simulated):
a spinning kernel on CUDA, a timed hold of the queue on the stand-in.

:class:`StagingPool` hands out byte buffers and takes them back with an event: a buffer is reused
only once that event has completed (the copy out of it or into it has run).
"""

from __future__ import annotations

import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable, Optional

import torch

__all__ = ["Event", "Stream", "Device", "SimDevice", "SimStream", "SimEvent", "CudaDevice",
           "StagingPool", "StreamError"]


SYNC_TIMEOUT_S = 60.0  # longest a stand-in waits for work another process or thread completes


class StreamError(RuntimeError):
    """Waiting on work that can never run (a held stand-in stream)."""


class Event(ABC):
    """A point in a stream's work."""

    @abstractmethod
    def query(self) -> bool:
        """True once the stream has run everything enqueued before the event (no blocking)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until :meth:`query` is true (only where the host must hand data on)."""


class Stream(ABC):
    """An in-order queue of device work."""

    @abstractmethod
    def record(self) -> Event:
        """An event completed once everything enqueued so far on this stream has run."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream from now on runs after ``event`` (no host block)."""

    @abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` (same number of elements; asynchronous)."""

    @abstractmethod
    def launch(self, fn: Callable[[], Any]) -> None:
        """Enqueue ``fn``'s torch work on this stream (it allocates from and runs on it)."""

    @abstractmethod
    def delay(self, seconds: float) -> None:
        """Enqueue a pause: work enqueued later on this stream starts ``seconds`` after the
        stream reaches this point, while the host and the other streams go on (a simulated slow
        link, :class:`~halo.transport.delay.DelayedTransport`)."""


class Device(ABC):
    """A device's compute stream, new streams and host staging memory. ``type``: the
    ``torch.device`` type its tensors have ("cuda"; "cpu" for the stand-in)."""

    compute: Stream
    type: str

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A stream of its own (e.g. for communication)."""

    @abstractmethod
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer device copies can run from and to asynchronously (pinned)."""


# --- CPU stand-in ------------------------------------------------------------------------------
class SimEvent(Event):
    def __init__(self, device: "SimDevice", stream: "SimStream") -> None:
        self._device, self._stream, self.done = device, stream, False

    def query(self) -> bool:
        self._device.pump()
        return self.done

    def synchronize(self) -> None:
        for _ in range(self._device.lag + 1):  # each query is a tick: the device gets there
            if self.query():
                return
        # Work another process (or the device's own thread) completes: wait for it, a while.
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while time.monotonic() < deadline:
            elsewhere = self._device.runs_elsewhere()  # before the query: it may complete between
            if self.query():
                return
            if not elsewhere:
                break
            time.sleep(0.001)
        if time.monotonic() >= deadline:
            raise StreamError(f"synchronize on an event of stream {self._stream.name!r}: "
                              f"another process's work it waits for did not run within "
                              f"{SYNC_TIMEOUT_S:.0f} s (a held stream there?)")
        raise StreamError(f"synchronize on an event of stream {self._stream.name!r}, which is "
                          f"held or waits on a held stream: the host would block forever")


class SimStream(Stream):
    """A FIFO of operations; see the module docstring. ``hold()``/``release()`` pause it."""

    def __init__(self, device: "SimDevice", name: str) -> None:
        self._device, self.name = device, name
        self._queue: deque[tuple[str, Any, int]] = deque()  # (kind, item, due tick)
        self.held = False
        self._pause_until: Optional[float] = None  # the head pause's end (time.monotonic)

    def _enqueue(self, kind: str, item: Any) -> None:
        with self._device.lock:
            self._queue.append((kind, item, self._device.clock + self._device.lag))
        self._device.pump()

    def _run_ready(self) -> bool:
        ran = False
        while self._queue and not self.held:
            kind, item, due = self._queue[0]
            if (kind == "wait" and not item.done) or due > self._device.clock:
                break
            if kind == "pause":  # its time counts from when the stream gets there
                now = time.monotonic()
                if self._pause_until is None:
                    self._pause_until = now + item
                if now < self._pause_until:
                    break
                self._pause_until = None
            self._queue.popleft()
            if kind == "op":
                item()
            elif kind == "record":
                item.done = True
            ran = True
        return ran

    def record(self) -> Event:
        ev = SimEvent(self._device, self)
        self._enqueue("record", ev)
        return ev

    def wait_event(self, event: Event) -> None:
        self._enqueue("wait", event)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue("op", lambda: dst.copy_(src.reshape(dst.shape)))

    def launch(self, fn: Callable[[], Any]) -> None:
        self._enqueue("op", fn)

    def delay(self, seconds: float) -> None:
        self._enqueue("pause", float(seconds))

    def waits_elsewhere(self) -> bool:
        """True while an event another process completes (``external``), or a pause, holds this
        stream up: either ends without this host's ticks."""
        with self._device.lock:
            return self._pause_until is not None or any(
                kind == "wait" and getattr(item, "external", False) and not item.done
                for kind, item, _ in self._queue)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        self._device.pump()


class SimDevice(Device):
    """CPU stand-in for a GPU: its "device" tensors are CPU tensors, its streams FIFOs.
    ``lag``: ticks an operation waits after it is enqueued before it may run (0: at once);
    ``autonomous``: a thread ticks it too, so its work runs while the host is blocked."""

    type = "cpu"

    def __init__(self, lag: int = 0, autonomous: bool = False) -> None:
        self.lag, self.clock, self.autonomous = lag, 0, autonomous
        self.lock = threading.RLock()  # the host and the ticking thread both run the streams
        self.streams: list[SimStream] = []
        self.compute: SimStream = self.new_stream("compute")
        if autonomous:
            threading.Thread(target=_tick, args=(weakref.ref(self),), daemon=True).start()

    def new_stream(self, name: str) -> SimStream:
        s = SimStream(self, name)
        self.streams.append(s)
        return s

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def pump(self) -> None:
        """One tick: run every operation whose turn has come, across streams, until none can."""
        with self.lock:
            self.clock += 1
            while any([s._run_ready() for s in self.streams]):
                pass

    def runs_elsewhere(self) -> bool:
        """True while work can complete without this host's ticks: the device's own thread, or
        a stream held up by another process's event."""
        held = any(s.held for s in self.streams)  # its own thread cannot get past those
        return (self.autonomous and not held) or any(s.waits_elsewhere() for s in self.streams)


def _tick(device: "weakref.ref[SimDevice]") -> None:
    """An autonomous stand-in's clock: a tick every half millisecond while it has work queued,
    every 20 ms while idle, until the device is gone."""
    busy = True
    while True:
        time.sleep(0.0005 if busy else 0.02)
        dev = device()
        if dev is None:
            return
        dev.pump()
        busy = any(s._queue for s in dev.streams)
        del dev


# --- CUDA (torch.cuda; not run in the CPU suite) -----------------------------------------------
class _CudaEvent(Event):
    def __init__(self, event: Any) -> None:
        self.event = event

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()


class _CudaStream(Stream):
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def record(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return _CudaEvent(ev)

    def wait_event(self, event: Event) -> None:
        self.stream.wait_event(event.event)  # type: ignore[attr-defined]

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src.reshape(dst.shape), non_blocking=True)
        for t in (dst, src):  # the caching allocator must not hand t out before the copy ran
            if t.is_cuda:
                t.record_stream(self.stream)

    def launch(self, fn: Callable[[], Any]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def delay(self, seconds: float) -> None:
        """A spinning kernel of one thread block (``torch.cuda._sleep``), its cycles from the
        rate timed on the first call per device (a host sync then)."""
        if seconds > 0:
            cycles = int(seconds * _spin_cycles_per_s(self.stream.device))
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(cycles)


_SPIN_RATE: dict[int, float] = {}  # device index -> torch.cuda._sleep's cycles per second


def _spin_cycles_per_s(device: torch.device) -> float:
    """``torch.cuda._sleep``'s cycles per second on ``device`` (it counts the SM clock), timed
    once by CUDA events: the median of three 2**22-cycle spins, after one to load the kernel."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SPIN_RATE:
        cycles, rates = 1 << 22, []
        with torch.cuda.device(index):
            torch.cuda._sleep(cycles)
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
                b.synchronize()
                rates.append(cycles / (a.elapsed_time(b) / 1e3))
        _SPIN_RATE[index] = sorted(rates)[1]
    return _SPIN_RATE[index]


class CudaDevice(Device):
    """Streams of one CUDA device through torch (run on an H100: docs/gpu.md); the same logic
    runs in the CPU suite on :class:`SimDevice`."""

    type = "cuda"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = torch.device(device or "cuda")

    @property
    def compute(self) -> Stream:  # type: ignore[override]
        """The stream torch computes on now (not the one current at construction: work run
        under ``torch.cuda.stream(s)`` is ordered against ``s``)."""
        return _CudaStream(torch.cuda.current_stream(self.device))

    def new_stream(self, name: str) -> Stream:
        return _CudaStream(torch.cuda.Stream(self.device))

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


# --- staging buffers ---------------------------------------------------------------------------
class StagingPool:
    """Host byte buffers, reused only after the event they were released with has completed.

        buf = pool.acquire(nbytes)        # uint8 [>= nbytes]
        stream.copy_(buf[:nbytes].view(dtype)..., device_tensor)
        pool.release(buf, stream.record())
    """

    def __init__(self, device: Device) -> None:
        self._device = device
        self._free: list[torch.Tensor] = []
        self._pending: list[tuple[torch.Tensor, Event]] = []
        self.allocated = 0  # buffers made so far (tests, and a leak shows as growth)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` no pending copy uses (power-of-two sizes, >= 256)."""
        still = []
        for buf, ev in self._pending:
            if ev.query():
                self._free.append(buf)
            else:
                still.append((buf, ev))
        self._pending = still
        fits = [b for b in self._free if b.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not best]
            return best
        self.allocated += 1
        return self._device.host_buffer(max(256, 1 << max(0, nbytes - 1).bit_length()))

    def release(self, buf: torch.Tensor, event: Event) -> None:
        """Give ``buf`` back; it is handed out again once ``event`` has completed."""
        self._pending.append((buf, event))

    @property
    def pending(self) -> int:
        """Buffers released whose event has not completed yet (not counting a query now)."""
        return len(self._pending)
