"""Where CUDA IPC buffers and events live: memory and events other processes of a node open.

    memory = CudaIPCMemory(torch.device("cuda", 0))   # or SimIPCMemory() on the CPU stand-in
    data, handle = memory.alloc(1 << 20)              # uint8 [1 MiB] on the device; a peer opens
    peer_data = memory.open(peer_handle, nbytes)      #   it by handle, once
    event, ev_handle = memory.event()                 # ours, recorded after our writes
    memory.record(event, stream)
    memory.wait(stream, peer_ev_handle)               # stream waits for the peer's latest record

:class:`CudaIPCMemory` is the GPU's (``cudaMalloc`` and IPC memory handles through CuPy,
interprocess events through torch, both imported on construction); :class:`SimIPCMemory` stands in
for it on the CPU with files in ``/dev/shm``, so the processes of an ``mpirun`` share buffers and
events as GPU processes do. :mod:`halo.transport.ipc` runs its protocol on either.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any, Protocol

import torch

from halo.transport.streams import SYNC_TIMEOUT_S, Event, Stream, StreamError

__all__ = ["IPCMemory", "CudaIPCMemory", "SimIPCMemory", "PREFIX"]

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
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self, device_id=self._index)
        t = torch.as_tensor(cp.ndarray((nbytes,), dtype=cp.uint8,
                                       memptr=cp.cuda.MemoryPointer(mem, 0)))
        if t.data_ptr() != ptr:
            raise RuntimeError(f"CudaIPCMemory: torch copied the IPC buffer at {ptr:#x} "
                               f"({nbytes} bytes) to {t.data_ptr():#x} instead of viewing it "
                               f"(torch {torch.__version__}, CuPy {cp.__version__})")
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
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not self.done:
            if time.monotonic() > deadline:
                raise StreamError(f"a peer's event did not complete within {SYNC_TIMEOUT_S:.0f} "
                                  f"s (its stream held, or its process gone?)")
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
        # The files a failed close or an exception left, at the latest when the process exits
        weakref.finalize(self, _unlink, self._own)

    def _file(self, nbytes: int) -> bytes:
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
        _unlink(self._own)  # mappings stay valid; the names go


def _unlink(paths: list[str]) -> None:
    """Remove the files at ``paths`` (those already gone too) and empty the list."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    paths.clear()
