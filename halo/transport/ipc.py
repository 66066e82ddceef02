"""CUDA IPC transport: ranks of one node copy straight into each other's registered device buffers.

    transport = IPCTransport(comm, CudaDevice())   # comm: ranks of ONE node (Split_type shared)
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=3)
    ...                                             # enqueue interior work meanwhile
    req.wait()                                      # the compute stream waits for the copy-out

Protocol, per exchange and peer, with small host MPI control messages:

    receiver: takes a registered buffer from its pool per (peer, tag) (its own allocation, so its
              IPC handle covers exactly it; power-of-two sizes, reused once the copy out of it
              has run) and sends the sender its handle ("ready": the buffer may be written)
    sender:   waits for "ready", opens the handle (once per buffer) and enqueues the copy of its
              tensor into it on the communication stream, after the compute stream's event;
              records its interprocess event for that buffer after the copy and sends "done"
              with the event's handle at once
    receiver: on "done", makes its communication stream wait for the sender's event (opened once
              per handle), copies the buffer into the receive tensor there; ``wait`` makes the
              compute stream wait for that copy

So neither ``start`` nor ``wait`` makes the host wait for the device: the hosts meet only in the
control messages, and the device work is ordered by events across processes, as NCCL orders its
own. An event is recorded again only once its buffer is offered again, which its receiver does
after it enqueued the wait on the last record (CUDA waits for the latest record at the time of
the wait). One limit: ``start`` meets each send peer's ``start`` of the same exchange (it needs
that peer's "ready"): start an exchange's sends and receives in one call, in the same order on
every rank (as the halo exchanges and plans do). A send-only start followed by a receive-only one
on both ranks would wait for each other.

Where the buffers and events live is the ``memory``: :class:`CudaIPCMemory` (``cudaMalloc`` and
IPC handles through CuPy, interprocess events through torch, both imported on construction), or
:class:`SimIPCMemory`, files in ``/dev/shm``, for the CPU stand-in device
(:class:`~halo.transport.streams.SimDevice`): the same protocol between the processes of an
``mpirun`` on a CPU (tests/mpi/test_ipc_transport.py).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.streams import SYNC_TIMEOUT_S, Device, Event, Stream, StreamError

__all__ = ["IPCTransport", "IPCMemory", "CudaIPCMemory", "SimIPCMemory"]

_CONTROL_TAG_BASE = 1 << 20  # control messages live above the data tags
PREFIX = "sparsepipe-ipc-"  # SimIPCMemory's files: /dev/shm/sparsepipe-ipc-<pid>-<n>


class IPCMemory(Protocol):
    """Buffers and events other processes of the node can open."""

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        """A new buffer, uint8 [nbytes] on the device, and the handle a peer opens it by."""

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        """A peer's buffer of ``nbytes`` as uint8 [nbytes] (call once per handle)."""

    def event(self) -> tuple[Any, bytes]:
        """A new event of ours other processes can wait for, and its handle."""

    def record(self, event: Any, stream: Stream) -> None:
        """Record ``event`` (of :meth:`event`) after the work enqueued so far on ``stream``."""

    def wait(self, stream: Stream, handle: bytes) -> None:
        """Work enqueued on ``stream`` from now on runs after the peer's event ``handle`` as last
        recorded before this call (the event opened on first use)."""

    def close_opened(self) -> None:
        """Unmap the peers' buffers and drop their events opened so far."""

    def free_own(self) -> None:
        """Free our own buffers and events (once every peer has unmapped them)."""


class CudaIPCMemory:
    """``cudaMalloc``'d buffers and their CUDA IPC handles, through CuPy, as torch tensors on the
    same memory (``__cuda_array_interface__``; a copy instead would be an error, not a silent
    stale buffer). A peer's buffer is a tensor on the GPU that holds it. Events are torch's
    interprocess CUDA events (``cudaIpcGetEventHandle``)."""

    def __init__(self, device: torch.device) -> None:
        import cupy  # on use only

        self._cp = cupy
        device = torch.device(device)
        self._index = torch.cuda.current_device() if device.index is None else device.index
        self._own: list[int] = []
        self._opened: list[int] = []
        self._events: list[Any] = []
        self._peer_events: dict[bytes, Any] = {}

    def _tensor(self, ptr: int, nbytes: int) -> torch.Tensor:
        cp = self._cp
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self)  # its device from the pointer
        t = torch.as_tensor(cp.ndarray((nbytes,), dtype=cp.uint8,
                                       memptr=cp.cuda.MemoryPointer(mem, 0)))
        if t.data_ptr() != ptr:
            raise RuntimeError("CudaIPCMemory: torch copied an IPC buffer instead of viewing it")
        return t

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        rt = self._cp.cuda.runtime
        with self._cp.cuda.Device(self._index):
            ptr = rt.malloc(nbytes)
            handle = bytes(rt.ipcGetMemHandle(ptr))
        self._own.append(ptr)
        return self._tensor(ptr, nbytes), handle

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        with self._cp.cuda.Device(self._index):
            ptr = self._cp.cuda.runtime.ipcOpenMemHandle(handle)
        self._opened.append(ptr)
        return self._tensor(ptr, nbytes)

    def event(self) -> tuple[Any, bytes]:
        with torch.cuda.device(self._index):
            ev = torch.cuda.Event(interprocess=True)  # no timing: interprocess events have none
            handle = bytes(ev.ipc_handle())
        self._events.append(ev)
        return ev, handle

    def record(self, event: Any, stream: Stream) -> None:
        event.record(stream.stream)  # type: ignore[attr-defined]  # a CudaDevice stream

    def wait(self, stream: Stream, handle: bytes) -> None:
        ev = self._peer_events.get(handle)
        if ev is None:
            ev = self._peer_events[handle] = torch.cuda.Event.from_ipc_handle(self._index, handle)
        stream.stream.wait_event(ev)  # type: ignore[attr-defined]

    def close_opened(self) -> None:
        rt = self._cp.cuda.runtime
        with self._cp.cuda.Device(self._index):
            rt.deviceSynchronize()  # no copy of ours may still write into them
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
        self._opened, self._peer_events = [], {}

    def free_own(self) -> None:
        # cudaFree of an exported buffer before every importer closed it is undefined behaviour:
        # the caller frees only after all peers' close_opened (IPCTransport.close's barrier).
        with self._cp.cuda.Device(self._index):
            for ptr in self._own:
                self._cp.cuda.runtime.free(ptr)
        self._own, self._events = [], []


class _SimPeerEvent(Event):
    """A peer's stand-in event as a waiter sees it: done once the peer's stream has run its
    record number ``target`` (counters: int64 [2], records issued and records run)."""

    external = True  # completed by another process (SimDevice.synchronize waits for it)

    def __init__(self, counters: torch.Tensor, target: int) -> None:
        self._counters, self._target = counters, target

    @property
    def done(self) -> bool:
        return int(self._counters[1]) >= self._target

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        import time

        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not self.done:
            if time.monotonic() > deadline:
                raise StreamError("a peer's event never completed: its stream is held")
            time.sleep(0.001)


class SimIPCMemory:
    """Files in ``/dev/shm`` standing in for CUDA IPC on the CPU (with
    :class:`~halo.transport.streams.SimDevice`): a handle is a file's path, and each tensor maps
    the file itself (its storage owns the mapping, so a view outlives ``close`` safely). An event
    is a file of two int64 counters: records issued (by the host, at once) and records run (by
    the stream, when it gets there); a wait waits until the second reaches the first as read
    at the wait."""

    _made = 0

    def __init__(self, folder: str = "/dev/shm") -> None:
        self.folder = folder
        self._own: list[str] = []
        self._peer_events: dict[bytes, torch.Tensor] = {}

    def _file(self, nbytes: int) -> bytes:
        import os

        SimIPCMemory._made += 1
        path = os.path.join(self.folder, f"{PREFIX}{os.getpid()}-{SimIPCMemory._made}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zeros
        finally:
            os.close(fd)
        self._own.append(path)
        return path.encode()

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        handle = self._file(nbytes)
        return self.open(handle, nbytes), handle

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        return torch.from_file(handle.decode(), shared=True, size=nbytes, dtype=torch.uint8)

    def _counters(self, handle: bytes) -> torch.Tensor:
        return torch.from_file(handle.decode(), shared=True, size=2, dtype=torch.int64)

    def event(self) -> tuple[Any, bytes]:
        handle = self._file(16)
        return self._counters(handle), handle

    def record(self, event: Any, stream: Stream) -> None:
        event[0] += 1  # issued now, by the host
        issued = int(event[0])
        stream.launch(lambda: event[1].fill_(issued))  # run when the stream gets there

    def wait(self, stream: Stream, handle: bytes) -> None:
        counters = self._peer_events.get(handle)
        if counters is None:
            counters = self._peer_events[handle] = self._counters(handle)
        stream.wait_event(_SimPeerEvent(counters, int(counters[0])))

    def close_opened(self) -> None:
        self._peer_events = {}  # the buffers' mappings go with their tensors

    def free_own(self) -> None:
        import os

        for path in self._own:
            os.unlink(path)  # mappings stay valid; the name goes
        self._own = []


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8 [nbytes] (a view)."""
    return t.reshape(-1).view(torch.uint8)


class _Registered:
    """A receive buffer of ours that peers write into: uint8 data on the device, its IPC handle,
    and the event after the last copy out of it (None: never used, or not in flight)."""

    def __init__(self, data: torch.Tensor, handle: bytes) -> None:
        self.data, self.handle = data, handle
        self.capacity = data.numel()
        self.busy = False
        self.copied: Optional[Event] = None

    def free(self) -> bool:
        return not self.busy and (self.copied is None or self.copied.query())


class _Target:
    """A buffer we write into: a peer's (opened) with our event recorded after each write and
    that event's handle, or one of our own (a send to ourselves: no event, one stream)."""

    def __init__(self, data: torch.Tensor, event: Any = None,
                 event_handle: Optional[bytes] = None) -> None:
        self.data, self.event, self.event_handle = data, event, event_handle


_PENDING = object()  # a "done" not arrived yet


class _IPCRequest(Request):
    def __init__(self, owner: "IPCTransport", recvs: list[tuple[torch.Tensor, _Registered]],
                 done_from: list[Any], sent: list[Any]) -> None:
        self._owner, self._recvs, self._done_from, self._sent = owner, recvs, done_from, sent
        self._events: list[Any] = [_PENDING] * len(recvs)  # each sender's event handle
        self._finished = False

    def test(self) -> bool:
        if not self._finished:
            for j, req in enumerate(self._done_from):
                if self._events[j] is _PENDING:
                    arrived, handle = req.test()
                    if arrived:
                        self._events[j] = handle
            if _PENDING not in self._events and all(r.Test() for r in self._sent):
                self._finish()
        return self._finished

    def wait(self) -> None:
        if self._finished:
            return
        for j, req in enumerate(self._done_from):  # the peers' hosts, never a device
            if self._events[j] is _PENDING:
                self._events[j] = req.wait()
        for r in self._sent:
            r.Wait()
        self._finish()

    def _finish(self) -> None:
        o = self._owner
        for (t, buf), handle in zip(self._recvs, self._events):
            if handle is not None:  # a peer's copy into buf: after its event
                o.memory.wait(o.stream, handle)
            o.stream.copy_(_bytes(t), buf.data[:t.nbytes])
        # The receive tensors' consumers, and whatever overwrites the send tensors, on the compute
        # stream after the copies out and in (both on this stream).
        copied = o.stream.record()
        o.device.compute.wait_event(copied)
        for _, buf in self._recvs:  # offered to a peer again once the copy out has run
            buf.busy, buf.copied = False, copied
        self._finished = True


class IPCTransport(Transport):
    """Point-to-point between ranks of one node through CUDA IPC; see the module docstring.
    ``memory``: where the registered buffers live (default: CUDA IPC on a CUDA ``device``, shared
    memory on the CPU stand-in)."""

    def __init__(self, comm: Any, device: Device, memory: Optional[IPCMemory] = None) -> None:
        self.comm, self.device = comm, device
        if memory is None:
            memory = (CudaIPCMemory(getattr(device, "device", torch.device("cuda")))
                      if device.type == "cuda" else SimIPCMemory())
        self.memory: IPCMemory = memory
        self.stream = device.new_stream("ipc")
        self._buffers: dict[tuple[int, int], list[_Registered]] = {}  # (peer, tag) -> pool
        self._targets: dict[bytes, _Target] = {}  # buffer handle -> where our copies go

    def _acquire(self, peer: int, tag: int, nbytes: int) -> _Registered:
        """The smallest free registered buffer for (peer, tag) that holds ``nbytes``, else a new
        one of the next power of two (at least 256 bytes)."""
        pool = self._buffers.setdefault((peer, tag), [])
        fits = [b for b in pool if b.capacity >= nbytes and b.free()]
        if fits:
            buf = min(fits, key=lambda b: b.capacity)
        else:
            buf = _Registered(*self.memory.alloc(max(256, 1 << max(0, nbytes - 1).bit_length())))
            # A send to ourselves writes it directly: CUDA opens only other processes' handles
            # (ipcOpenMemHandle of our own fails with "invalid device context").
            self._targets[buf.handle] = _Target(buf.data)
            pool.append(buf)
        buf.busy = True
        return buf

    def _target(self, handle: bytes, capacity: int) -> _Target:
        """A peer's buffer, opened on first use with an event of ours for it."""
        target = self._targets.get(handle)
        if target is None:
            target = self._targets[handle] = _Target(self.memory.open(handle, capacity),
                                                     *self.memory.event())
        return target

    @property
    def registered(self) -> int:
        """Receive buffers allocated so far (a leak shows as growth)."""
        return sum(len(pool) for pool in self._buffers.values())

    def close(self) -> None:
        """Release every buffer and event. Collective over the communicator, after every request
        has completed on every rank: each rank unmaps its peers' buffers, and frees its own only
        once every peer has unmapped them."""
        self._buffers, self._targets = {}, {}
        self.memory.close_opened()
        self.comm.Barrier()
        self.memory.free_own()

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in sends + recvs:
            if t.device.type != self.device.type or not t.is_contiguous():
                raise TransportError(f"IPCTransport: the tensor for rank {peer} must be a "
                                     f"contiguous {self.device.type} tensor; got one on "
                                     f"{t.device}")
        ctrl = _CONTROL_TAG_BASE + 2 * tag  # ready on ctrl, done on ctrl + 1: no overlap
        mine, done_from, sent = [], [], []
        for peer, t in recvs:  # "ready" first on every rank, so no rank blocks on another
            buf = self._acquire(peer, tag, t.nbytes)
            sent.append(self.comm.isend((buf.handle, buf.capacity), dest=peer, tag=ctrl))
            done_from.append(self.comm.irecv(source=peer, tag=ctrl + 1))
            mine.append((t, buf))
        # After the producers of the send tensors and the last readers of the receive tensors
        # (the copy-out in _finish overwrites them) on the compute stream.
        self.stream.wait_event(self.device.compute.record())
        written = []
        for peer, t in sends:
            target = self._target(*self.comm.recv(source=peer, tag=ctrl))  # its "ready"
            self.stream.copy_(target.data[:t.nbytes], _bytes(t))
            written.append((peer, target))
        for peer, target in written:  # "done" once every copy is enqueued, not once it ran
            if target.event is not None:
                self.memory.record(target.event, self.stream)
            sent.append(self.comm.isend(target.event_handle, dest=peer, tag=ctrl + 1))
        return _IPCRequest(self, mine, done_from, sent)
