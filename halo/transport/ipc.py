"""CUDA IPC transport: ranks of one node copy straight into each other's registered device buffers.

    transport = IPCTransport(comm, CudaDevice())   # comm: ranks of ONE node (Split_type shared)
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=3)
    req.wait()                                      # the compute stream waits for the copy-out

UNVERIFIED: written without a GPU; no test has run it (tests/test_transport_gpu.py skips without
CUDA). Minimal protocol, per exchange and peer, with small host MPI control messages:

    receiver: a registered device buffer from its pool per (peer, tag): cudaMalloc'd (its own
              allocation, so its IPC handle covers exactly it) in power-of-two sizes and reused
              once the copy out of it has run, so a training run's varying halo sizes allocate a
              bounded set; sends its handle to the sender ("ready": the buffer may be written)
    sender:   opens the handle once per buffer (cached), copies its tensor into it on the
              communication stream after the compute stream's event, waits for that copy on the
              host, sends "done"
    receiver: on "done", copies the registered buffer into the receive tensor on its
              communication stream; ``wait`` makes the compute stream wait for that copy

The sender's host waits for its copy before "done" (no cross-process events here, to keep it
small); cudaIpcGetEventHandle would remove that block. CuPy is imported on construction only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.streams import Device, Event

__all__ = ["IPCTransport"]

_CONTROL_TAG_BASE = 1 << 20  # control messages live above the data tags


class _Registered:
    """A receive buffer of ours that peers write into: device pointer, capacity, IPC handle, and
    the event after the last copy out of it (None: never used, or not in flight)."""

    def __init__(self, ptr: int, capacity: int, handle: bytes) -> None:
        self.ptr, self.capacity, self.handle = ptr, capacity, handle
        self.busy = False
        self.copied: Optional[Event] = None

    def free(self) -> bool:
        return not self.busy and (self.copied is None or self.copied.query())


class _IPCRequest(Request):
    def __init__(self, owner: "IPCTransport", recvs: list[tuple[int, torch.Tensor, _Registered]],
                 done_reqs: list[Any]) -> None:
        self._owner, self._recvs, self._done_reqs = owner, recvs, done_reqs
        self._finished = False

    def test(self) -> bool:
        if not self._finished and all(r.Test() for r in self._done_reqs):
            self._finish()
        return self._finished

    def wait(self) -> None:
        if not self._finished:
            for r in self._done_reqs:
                r.Wait()
            self._finish()

    def _finish(self) -> None:
        o = self._owner
        for peer, t, buf in self._recvs:
            o._copy(t.data_ptr(), buf.ptr, t.nbytes)
        copied = o.stream.record()
        o.device.compute.wait_event(copied)
        for _, _, buf in self._recvs:  # offered to a peer again once the copy out has run
            buf.busy, buf.copied = False, copied
        self._finished = True


class IPCTransport(Transport):
    """Point-to-point between ranks of one node through CUDA IPC; see the module docstring."""

    def __init__(self, comm: Any, device: Device) -> None:
        from cupy.cuda import runtime  # on use only

        self._rt, self.comm, self.device = runtime, comm, device
        self.stream = device.new_stream("ipc")
        self._buffers: dict[tuple[int, int], list[_Registered]] = {}  # (peer, tag) -> pool
        self._opened: dict[bytes, int] = {}

    def _acquire(self, peer: int, tag: int, nbytes: int) -> _Registered:
        """The smallest free registered buffer for (peer, tag) that holds ``nbytes``, else a new
        one of the next power of two (at least 256 bytes)."""
        pool = self._buffers.setdefault((peer, tag), [])
        fits = [b for b in pool if b.capacity >= nbytes and b.free()]
        if fits:
            buf = min(fits, key=lambda b: b.capacity)
        else:
            cap = max(256, 1 << max(0, nbytes - 1).bit_length())
            ptr = self._rt.malloc(cap)
            buf = _Registered(ptr, cap, bytes(self._rt.ipcGetMemHandle(ptr)))
            # A send to ourselves writes it directly: CUDA opens only other processes' handles
            # (ipcOpenMemHandle of our own fails with "invalid device context").
            self._opened[buf.handle] = ptr
            pool.append(buf)
        buf.busy = True
        return buf

    @property
    def registered(self) -> int:
        """Receive buffers allocated so far (a leak shows as growth)."""
        return sum(len(pool) for pool in self._buffers.values())

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        handle = int(self.stream.stream.cuda_stream)  # type: ignore[attr-defined]
        self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyDeviceToDevice, handle)

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        for peer, t in sends + recvs:
            if not t.is_cuda or not t.is_contiguous():
                raise TransportError(f"IPCTransport: the tensor for rank {peer} must be a "
                                     f"contiguous CUDA tensor; got one on {t.device}")
        ctrl = _CONTROL_TAG_BASE + 2 * tag  # ready on ctrl, done on ctrl + 1: no overlap
        mine, done_reqs = [], []
        for peer, t in recvs:  # "ready" first on every rank, so no rank blocks on another
            buf = self._acquire(peer, tag, t.nbytes)
            done_reqs.append(self.comm.isend(buf.handle, dest=peer, tag=ctrl))  # kept until done
            done_reqs.append(self.comm.irecv(source=peer, tag=ctrl + 1))
            mine.append((peer, t, buf))
        # After the producers of the send tensors and the last readers of the receive tensors
        # (the copy-out in _finish overwrites them) on the compute stream.
        self.stream.wait_event(self.device.compute.record())
        for peer, t in sends:
            handle = self.comm.recv(source=peer, tag=ctrl)
            if handle not in self._opened:
                self._opened[handle] = self._rt.ipcOpenMemHandle(handle)
            self._copy(self._opened[handle], t.data_ptr(), t.nbytes)
        if sends:
            self.stream.record().synchronize()  # the peer may read once this has landed
            for peer, _ in sends:
                self.comm.send(True, dest=peer, tag=ctrl + 1)
        return _IPCRequest(self, mine, done_reqs)
