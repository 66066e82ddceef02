"""CUDA IPC transport: ranks of one node copy straight into each other's registered device buffers.

    transport = IPCTransport(comm, CudaDevice())   # comm: ranks of ONE node (Split_type shared)
    req = transport.start([(peer, d_send)], [(peer, d_recv)], tag=3)
    req.wait()                                      # the compute stream waits for the copy-out

UNVERIFIED: written without a GPU; no test has run it (tests/test_transport_gpu.py skips without
CUDA). Minimal protocol, per exchange and peer, with small host MPI control messages:

    receiver: a registered device buffer per (peer, tag, bytes), allocated once with
              cudaMalloc (its own allocation, so its IPC handle covers exactly it) and reused;
              sends its handle to the sender ("ready": the buffer may be written)
    sender:   opens the handle once per buffer (cached), copies its tensor into it on the
              communication stream after the compute stream's event, waits for that copy on the
              host, sends "done"
    receiver: on "done", copies the registered buffer into the receive tensor on its
              communication stream; ``wait`` makes the compute stream wait for that copy

The sender's host waits for its copy before "done" (no cross-process events here, to keep it
small); cudaIpcGetEventHandle would remove that block. CuPy is imported on construction only.
"""

from __future__ import annotations

from typing import Any

import torch

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError
from halo.transport.streams import Device

__all__ = ["IPCTransport"]

_CONTROL_TAG_BASE = 1 << 20  # control messages live above the data tags


class _IPCRequest(Request):
    def __init__(self, owner: "IPCTransport", recvs: list[tuple[int, torch.Tensor, int]],
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
        for peer, t, ptr in self._recvs:
            o._copy(t.data_ptr(), ptr, t.nbytes)
        o.device.compute.wait_event(o.stream.record())
        self._finished = True


class IPCTransport(Transport):
    """Point-to-point between ranks of one node through CUDA IPC; see the module docstring."""

    def __init__(self, comm: Any, device: Device) -> None:
        from cupy.cuda import runtime  # on use only

        self._rt, self.comm, self.device = runtime, comm, device
        self.stream = device.new_stream("ipc")
        self._buffers: dict[tuple[int, int, int], tuple[int, bytes]] = {}  # -> (ptr, handle)
        self._opened: dict[bytes, int] = {}

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
        ctrl = _CONTROL_TAG_BASE + tag
        mine, done_reqs = [], []
        for peer, t in recvs:  # "ready" first on every rank, so no rank blocks on another
            key = (peer, tag, t.nbytes)
            if key not in self._buffers:
                ptr = self._rt.malloc(t.nbytes)
                self._buffers[key] = (ptr, bytes(self._rt.ipcGetMemHandle(ptr)))
            ptr, handle = self._buffers[key]
            done_reqs.append(self.comm.isend(handle, dest=peer, tag=ctrl))  # kept until done
            done_reqs.append(self.comm.irecv(source=peer, tag=ctrl + 1))
            mine.append((peer, t, ptr))
        if sends:
            self.stream.wait_event(self.device.compute.record())  # after the producers
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
