"""CUDA IPC transport: ranks of one node copy straight into each other's registered device buffers.

    transport = IPCTransport(comm, CudaDevice())   # comm: ranks of ONE node (Split_type shared)
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=3)
    ...                                             # enqueue interior work meanwhile
    req.wait()                                      # the compute stream waits for the copy-out

Protocol, per exchange and peer, with small host MPI control messages:

    receiver: takes a registered buffer from its pool per peer (its own allocation, so its
              IPC handle covers exactly it; power-of-two sizes) and sends the sender its handle
              ("ready": the buffer may be written)
    sender:   once "ready" has arrived, opens the handle (once per buffer), enqueues the copy of
              its tensor into it on the communication stream, after the compute stream's event
              of ``start``, records its interprocess event for that buffer and sends "done" with
              the event's handle and the bytes written
    receiver: on "done", makes its communication stream wait for the sender's event (opened once
              per handle) and copies the buffer into the receive tensor there; ``wait`` makes the
              compute stream wait for that copy

Neither ``start`` nor ``wait`` makes the host wait for the device: the hosts trade only control
messages, and device work is ordered across processes by events, as NCCL orders its own. An event
is recorded again only for its buffer's next use, which its receiver offers only once the copy
out of it has run, long after the wait on the last record was enqueued (CUDA waits for the latest
record at the time of the wait). ``start`` does not wait for "ready" either: a send whose "ready"
has not arrived is carried out by the next call into any IPC transport of the process (every
``start``, ``test``, ``wait`` and ``progress``), so ranks may start exchanges in different orders
(a gradient bucket one rank starts in backward and another only at the end) as long as each
waits for them in an order its peers can follow. A rank blocked in MPI outside these transports
(a host collective, a staged transfer) hands nothing on: wait for its IPC exchanges before
calls its peers reach only after theirs, or call ``progress`` while blocked. Once
``MAX_PENDING`` buffers of a peer that would fit a receive wait for their copy out (a host
running ahead of its device), the host waits for one of those copies (device work only) rather
than register yet another buffer.

Where the buffers and events live is the ``memory`` (:mod:`halo.transport.ipc_memory`): CUDA IPC
on a GPU, or files in ``/dev/shm`` for the CPU stand-in device
(:class:`~halo.transport.streams.SimDevice`): the same protocol between the processes of an
``mpirun`` on a CPU (tests/mpi/test_ipc_transport.py). Constructing a transport is collective
(it duplicates its communicator).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.ipc_memory import CudaIPCMemory, IPCMemory, SimIPCMemory
from halo.transport.streams import Device, Event

__all__ = ["IPCTransport", "MAX_PENDING", "progress_all"]

MAX_PENDING = 4  # registered buffers per peer whose copy out may still be queued


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


class _Send:
    """One tensor of a ``start`` for ``peer``: carried out once the peer's "ready" arrives."""

    def __init__(self, peer: int, tensor: torch.Tensor, ready: Any, tag: int) -> None:
        self.peer, self.tensor, self.ready, self.tag = peer, tensor, ready, tag
        self.done: Any = None  # the "done" message once sent
        self.failed: Optional[str] = None  # why it could not be carried out


_PENDING = object()  # a "done" not arrived yet
_live: "set[IPCTransport]" = set()  # every open one (until close): progress_all


def progress_all() -> bool:
    """Carry out every open IPC transport's sends whose "ready" has arrived; True while some
    wait for theirs."""
    held = False
    for tr in list(_live):
        held = tr._send_ready() or held
    return held


class _IPCRequest(Request):
    def __init__(self, owner: "IPCTransport", recvs: list[tuple[torch.Tensor, _Registered]],
                 done_from: list[Any], sends: list[_Send], ready_sent: list[Any]) -> None:
        self._owner, self._recvs, self._done_from = owner, recvs, done_from
        self._sends, self._ready_sent = sends, ready_sent
        self._dones: list[Any] = [_PENDING] * len(recvs)  # each sender's (event handle, bytes)
        self._finished = False

    def _complete(self) -> bool:
        """Progress every IPC transport; True once every message of this request has gone and
        every peer's "done" has arrived."""
        progress_all()
        failed = [s.failed for s in self._sends if s.failed]
        if failed:
            raise TransportError(f"IPCTransport: a send of this exchange failed: {failed[0]}")
        for j, req in enumerate(self._done_from):
            if self._dones[j] is _PENDING:
                arrived, msg = req.test()
                if arrived:
                    self._dones[j] = msg
        return (_PENDING not in self._dones
                and all(s.done is not None and s.done.Test() for s in self._sends)
                and all(r.Test() for r in self._ready_sent))

    def test(self) -> bool:
        if not self._finished and self._complete():
            self._finish()
        return self._finished

    def wait(self) -> None:
        if self._finished:
            return
        polls = 0
        while not self._complete():  # waits for the peers' hosts, never for a device
            if not progress_all():  # nothing of ours waits for a "ready": block in MPI
                for j, req in enumerate(self._done_from):
                    if self._dones[j] is _PENDING:
                        self._dones[j] = req.wait()
                for r in [s.done for s in self._sends] + self._ready_sent:
                    r.Wait()
                break
            polls += 1
            time.sleep(0 if polls < 100 else 1e-4)  # yield to ranks sharing this core
        self._finish()

    def _finish(self) -> None:
        o = self._owner
        for (t, buf), (event_handle, nbytes) in zip(self._recvs, self._dones):
            if nbytes != t.nbytes:
                raise TransportError(f"IPCTransport: a peer sent {nbytes} bytes where the "
                                     f"receive tensor has {t.nbytes}; start exchanges in the "
                                     f"same order with matching sizes on every rank")
            if event_handle is not None:  # a peer's copy into buf: after its event
                o.memory.wait(o.stream, event_handle)
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

    kind = "ipc"

    def __init__(self, comm: Any, device: Device, memory: Optional[IPCMemory] = None) -> None:
        # Communicators of its own (collective), one per kind of control message, so both carry
        # the caller's tags unchanged (no tag arithmetic past MPI_TAG_UB) apart from any other
        # messages on ``comm``.
        self.comm, self.done_comm, self.device = comm.Dup(), comm.Dup(), device
        if memory is None:
            memory = (CudaIPCMemory(getattr(device, "device", torch.device("cuda")))
                      if device.type == "cuda" else SimIPCMemory())
        self.memory: IPCMemory = memory
        self.stream = device.new_stream("ipc")
        # peer -> pool, whatever the tag: a pipeline's micro-batches (a tag each) reuse the
        # buffers of the ones whose copy out has run instead of holding one each.
        self._buffers: dict[int, list[_Registered]] = {}
        self._targets: dict[bytes, _Target] = {}  # buffer handle -> where our copies go
        self._unsent: list[_Send] = []  # started, "ready" not arrived yet
        self.closed = False
        _live.add(self)

    def _acquire(self, peer: int, nbytes: int) -> _Registered:
        """The smallest free registered buffer for ``peer`` that holds ``nbytes``; else, with
        MAX_PENDING of them waiting for their copy out, the smallest once its copy out has run
        (device work only: it never needs a host); else a new one of the next power of two (at
        least 256 bytes)."""
        pool = self._buffers.setdefault(peer, [])
        fits = [b for b in pool if b.capacity >= nbytes and not b.busy]
        free = [b for b in fits if b.free()]
        if not free and len(fits) >= MAX_PENDING:
            smallest = min(fits, key=lambda b: b.capacity)
            assert smallest.copied is not None  # not busy, not free: its copy out is queued
            smallest.copied.synchronize()  # the host has run far enough ahead of the device
            free = [b for b in fits if b.free()]
        if free:
            buf = min(free, key=lambda b: b.capacity)
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

    def _send_ready(self) -> bool:
        """Carry out the sends whose "ready" has arrived, in start order per (peer, tag) (the
        peer matches our "done"s in that order); True while some still wait for theirs."""
        waiting: list[_Send] = []
        behind: set[tuple[int, int]] = set()
        todo, self._unsent = self._unsent, []
        try:
            while todo:
                s = todo.pop(0)
                arrived, msg = (False, ()) if (s.peer, s.tag) in behind else s.ready.test()
                if arrived:
                    self._carry_out(s, *msg)  # "ready": (the peer's buffer, its capacity)
                else:
                    waiting.append(s)
                    behind.add((s.peer, s.tag))
        finally:  # after an error too: the failed send dropped, the rest still unsent
            self._unsent = waiting + todo
        return bool(waiting)

    def _carry_out(self, s: _Send, handle: bytes, capacity: int) -> None:
        """The copy of ``s`` into the peer's buffer ``handle``, our event after it, "done"."""
        nbytes = s.tensor.nbytes
        if capacity < nbytes:
            s.failed = (f"rank {s.peer} offered {capacity} bytes for a send of {nbytes}; start "
                        f"exchanges in the same order with matching sizes on every rank")
            # A "done" without an event all the same: the receiver's wait raises on the size
            # (rather than hang), and later messages of this (peer, tag) keep their order.
            s.done = self.done_comm.isend((None, nbytes), dest=s.peer, tag=s.tag)
            raise TransportError(f"IPCTransport: {s.failed}")
        target = self._target(handle, capacity)
        self.stream.copy_(target.data[:nbytes], _bytes(s.tensor))
        if target.event is not None:
            self.memory.record(target.event, self.stream)
        s.done = self.done_comm.isend((target.event_handle, nbytes), dest=s.peer, tag=s.tag)

    @property
    def registered(self) -> int:
        """Receive buffers allocated so far (a leak shows as growth)."""
        return sum(len(pool) for pool in self._buffers.values())

    def progress(self) -> bool:
        return progress_all()

    def close(self) -> None:
        """Release every buffer and event. Collective over the communicator, after every request
        has completed on every rank: each rank unmaps its peers' buffers, and frees its own only
        once every peer has unmapped them. A send still waiting for its peer's start raises
        TransportError on every rank (nothing freed). Closing again does nothing."""
        if self.closed:
            return
        try:
            self._send_ready()
            failed = ""
        except TransportError as e:  # counted below: raised alone, it would leave peers waiting
            failed = str(e)
        # Agreed (one allgather), so every rank raises, rather than one raising while its peers
        # wait in the barrier below.
        states = self.comm.allgather((len(self._unsent), failed))
        if any(n or why for n, why in states):
            held = ", ".join(f"rank {r}: {n}" + (f" ({why})" if why else "")
                             for r, (n, why) in enumerate(states) if n or why)
            raise TransportError(f"IPCTransport: close with send(s) still waiting for their "
                                 f"peer's start or failed ({held}); wait for every request first")
        self.closed = True
        _live.discard(self)
        self._buffers, self._targets = {}, {}
        self.memory.close_opened()
        self.comm.Barrier()
        self.memory.free_own()
        self.comm.Free()
        self.done_comm.Free()

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if self.closed:
            raise TransportError("IPCTransport: start after close (its buffers are freed)")
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in sends + recvs:
            if t.device.type != self.device.type or not t.is_contiguous():
                raise TransportError(f"IPCTransport: the tensor for rank {peer} must be a "
                                     f"contiguous {self.device.type} tensor; got a "
                                     f"{'' if t.is_contiguous() else 'non-contiguous '}tensor "
                                     f"on {t.device} (pass .contiguous() on this device)")
        mine, done_from, ready_sent = [], [], []
        for peer, t in recvs:
            buf = self._acquire(peer, t.nbytes)
            ready_sent.append(self.comm.isend((buf.handle, buf.capacity), dest=peer, tag=tag))
            done_from.append(self.done_comm.irecv(source=peer, tag=tag))
            mine.append((t, buf))
        # After the producers of the send tensors and the last readers of the receive tensors
        # (the copy-out in _finish overwrites them) on the compute stream.
        self.stream.wait_event(self.device.compute.record())
        out = [_Send(peer, t, self.comm.irecv(source=peer, tag=tag), tag)
               for peer, t in sends]
        self._unsent.extend(out)
        progress_all()
        return _IPCRequest(self, mine, done_from, out, ready_sent)
