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
              tensor into it on the communication stream, after the compute stream's event. It
              sends "done" once that copy has run, seen by polling its event in every test, wait
              and progress call, and at the latest (blocking on the event) in the request's wait
    receiver: on "done", copies the buffer into the receive tensor on its communication stream;
              ``wait`` makes the compute stream wait for that copy

So ``start`` never makes the host wait for the device: the interior convolution is enqueued
behind the copy, and the host waits (if at all) in ``wait``, where the staged transport waits for
its device-to-host copy too. "done" tells the receiver the data has landed; no event crosses
processes. Two limits (the second is the staged transport's too):

- ``start`` meets each send peer's ``start`` of the same exchange (it needs that peer's "ready"):
  start an exchange's sends and receives in one call, in the same order on every rank (as the
  halo exchanges and plans do). A send-only start followed by a receive-only one on both ranks
  would wait for each other.
- A rank with "done"s held back hands them on only inside this transport's calls (every wait
  and ``_ready_from`` keeps doing so while it waits): wait for a request before blocking in
  other MPI calls a peer can only reach after that request (as the staged transport's sends).

Where the buffers live is the ``memory``: :class:`CudaIPCMemory` (``cudaMalloc`` and IPC handles
through CuPy, imported on construction), or :class:`SimIPCMemory`, files in ``/dev/shm``, for the
CPU stand-in device (:class:`~halo.transport.streams.SimDevice`): the same protocol between the
processes of an ``mpirun`` on a CPU (tests/mpi/test_ipc_transport.py).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.streams import Device, Event

__all__ = ["IPCTransport", "IPCMemory", "CudaIPCMemory", "SimIPCMemory"]

_CONTROL_TAG_BASE = 1 << 20  # control messages live above the data tags
PREFIX = "sparsepipe-ipc-"  # SimIPCMemory's files: /dev/shm/sparsepipe-ipc-<pid>-<n>


class IPCMemory(Protocol):
    """Buffers other processes of the node can open."""

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        """A new buffer, uint8 [nbytes] on the device, and the handle a peer opens it by."""

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        """A peer's buffer of ``nbytes`` as uint8 [nbytes] (call once per handle)."""

    def close_opened(self) -> None:
        """Unmap the peers' buffers opened so far."""

    def free_own(self) -> None:
        """Free our own buffers (once every peer has unmapped them)."""


class CudaIPCMemory:
    """``cudaMalloc``'d buffers and their CUDA IPC handles, through CuPy, as torch tensors on the
    same memory (``__cuda_array_interface__``; a copy instead would be an error, not a silent
    stale buffer). A peer's buffer is a tensor on the GPU that holds it."""

    def __init__(self, device: torch.device) -> None:
        import cupy  # on use only

        self._cp = cupy
        device = torch.device(device)
        self._index = torch.cuda.current_device() if device.index is None else device.index
        self._own: list[int] = []
        self._opened: list[int] = []

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

    def close_opened(self) -> None:
        rt = self._cp.cuda.runtime
        with self._cp.cuda.Device(self._index):
            rt.deviceSynchronize()  # no copy of ours may still write into them
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
        self._opened = []

    def free_own(self) -> None:
        # cudaFree of an exported buffer before every importer closed it is undefined behaviour:
        # the caller frees only after all peers' close_opened (IPCTransport.close's barrier).
        with self._cp.cuda.Device(self._index):
            for ptr in self._own:
                self._cp.cuda.runtime.free(ptr)
        self._own = []


class SimIPCMemory:
    """Files in ``/dev/shm`` standing in for CUDA IPC on the CPU (with
    :class:`~halo.transport.streams.SimDevice`): a handle is a file's path, and each tensor maps
    the file itself (its storage owns the mapping, so a view outlives ``close`` safely)."""

    _made = 0

    def __init__(self, folder: str = "/dev/shm") -> None:
        self.folder = folder
        self._own: list[str] = []

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        import os

        SimIPCMemory._made += 1
        path = os.path.join(self.folder, f"{PREFIX}{os.getpid()}-{SimIPCMemory._made}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._own.append(path)
        return self.open(path.encode(), nbytes), path.encode()

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        return torch.from_file(handle.decode(), shared=True, size=nbytes, dtype=torch.uint8)

    def close_opened(self) -> None:
        pass  # the mappings go with their tensors

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


class _Sent:
    """The copies of one ``start`` into peers' buffers: "done" goes to ``peers`` once they ran."""

    def __init__(self, copied: Event, peers: list[int], tag: int) -> None:
        self.copied, self.peers, self.tag = copied, peers, tag
        self.told = False


class _IPCRequest(Request):
    def __init__(self, owner: "IPCTransport", recvs: list[tuple[torch.Tensor, _Registered]],
                 control: list[Any], sent: Optional[_Sent]) -> None:
        self._owner, self._recvs, self._control, self._sent = owner, recvs, control, sent
        self._finished = False

    def _arrived(self) -> bool:
        return all(r.Test() for r in self._control)

    def test(self) -> bool:
        if not self._finished:
            self._owner.progress()
            if (self._sent is None or self._sent.told) and self._arrived():
                self._finish()
        return self._finished

    def wait(self) -> None:
        if self._finished:
            return
        o = self._owner
        if self._sent is not None:
            o._tell_done(upto=self._sent)  # the host waits for our own copies here, if at all
        while not self._arrived():
            if not o.progress():  # nothing of ours held back: block in MPI instead of spinning
                for r in self._control:
                    r.Wait()
        self._finish()

    def _finish(self) -> None:
        o = self._owner
        for t, buf in self._recvs:
            o.stream.copy_(_bytes(t), buf.data[:t.nbytes])
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
        self._opened: dict[bytes, torch.Tensor] = {}
        self._unsent: list[_Sent] = []  # copies started, "done" not yet sent (in start order)

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
            self._opened[buf.handle] = buf.data
            pool.append(buf)
        buf.busy = True
        return buf

    @property
    def registered(self) -> int:
        """Receive buffers allocated so far (a leak shows as growth)."""
        return sum(len(pool) for pool in self._buffers.values())

    def close(self) -> None:
        """Release every buffer. Collective over the communicator, after every request has
        completed on every rank: each rank unmaps its peers' buffers, and frees its own only
        once every peer has unmapped them."""
        self._buffers, self._opened = {}, {}
        self.memory.close_opened()
        self.comm.Barrier()
        self.memory.free_own()

    def progress(self) -> bool:
        self._tell_done(upto=None)
        return bool(self._unsent)

    def _tell_done(self, upto: Optional[_Sent]) -> None:
        """Send "done" for started copies, oldest first: those that have run, and (blocking on
        their events) every one up to and including ``upto``."""
        while self._unsent:
            head = self._unsent[0]
            must = upto is not None and not upto.told
            if not must and not head.copied.query():
                return
            head.copied.synchronize()  # at once when the query above saw it done
            self._unsent.pop(0)
            for peer in head.peers:
                self.comm.send(True, dest=peer, tag=head.tag)
            head.told = True
            if head is upto:
                return

    def _ready_from(self, peer: int, tag: int) -> tuple[bytes, int]:
        """The (handle, capacity) of the buffer ``peer`` offers, sending our own finished "done"s
        meanwhile: the peer may be waiting for one before it starts the exchange that offers it."""
        req = self.comm.irecv(source=peer, tag=tag)
        while self.progress():
            arrived, msg = req.test()
            if arrived:
                return msg
        return req.wait()  # nothing of ours held back: block in MPI instead of spinning

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in sends + recvs:
            if t.device.type != self.device.type or not t.is_contiguous():
                raise TransportError(f"IPCTransport: the tensor for rank {peer} must be a "
                                     f"contiguous {self.device.type} tensor; got one on "
                                     f"{t.device}")
        ctrl = _CONTROL_TAG_BASE + 2 * tag  # ready on ctrl, done on ctrl + 1: no overlap
        mine, control = [], []
        for peer, t in recvs:  # "ready" first on every rank, so no rank blocks on another
            buf = self._acquire(peer, tag, t.nbytes)
            control.append(self.comm.isend((buf.handle, buf.capacity), dest=peer, tag=ctrl))
            control.append(self.comm.irecv(source=peer, tag=ctrl + 1))
            mine.append((t, buf))
        # After the producers of the send tensors and the last readers of the receive tensors
        # (the copy-out in _finish overwrites them) on the compute stream.
        self.stream.wait_event(self.device.compute.record())
        sent = None
        if sends:
            for peer, t in sends:
                handle, capacity = self._ready_from(peer, ctrl)
                if handle not in self._opened:
                    self._opened[handle] = self.memory.open(handle, capacity)
                self.stream.copy_(self._opened[handle][:t.nbytes], _bytes(t))
            sent = _Sent(self.stream.record(), [peer for peer, _ in sends], ctrl + 1)
            self._unsent.append(sent)
            self.progress()
        return _IPCRequest(self, mine, control, sent)
