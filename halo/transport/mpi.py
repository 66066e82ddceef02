"""Host transport: mpi4py non-blocking point-to-point on CPU tensors, no copies, no pickling.

    transport = MPITransport(grid.comm)
    req = transport.start([(peer, send_buf)], [(peer, recv_buf)], tag=11)
    req.wait()

Receives are posted before sends (so an eager message lands in its buffer, not in MPI's unexpected
queue); tensors go to MPI as raw bytes of a numpy view sharing their memory (``MPI.BYTE``, the
upper-case buffer-protocol calls), so any dtype works, bfloat16 included.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError

__all__ = ["MPITransport", "MPIRequest"]


def _bytes_view(t: torch.Tensor, what: str) -> np.ndarray:
    """A uint8 numpy array sharing ``t``'s memory."""
    if t.device.type != "cpu":
        raise TransportError(f"MPITransport: {what} is on {t.device}; it moves host (CPU) tensors "
                             f"only - use a device transport or move the tensor to the CPU")
    if not t.is_contiguous():
        raise TransportError(f"MPITransport: {what} of shape {tuple(t.shape)} is not contiguous; "
                             f"pass a contiguous tensor (its bytes are sent as they lie)")
    t = t.detach()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


class MPIRequest(Request):
    """MPI requests plus the buffers they use (kept alive until completion)."""

    def __init__(self, reqs: list[MPI.Request], keep: list) -> None:
        self._reqs = reqs
        self._keep = keep

    def test(self) -> bool:
        if self._reqs and MPI.Request.Testall(self._reqs):
            self._reqs, self._keep = [], []
        return not self._reqs

    def wait(self) -> None:
        if self._reqs:
            MPI.Request.Waitall(self._reqs)
            self._reqs, self._keep = [], []


class MPITransport(Transport):
    """Point-to-point ``Irecv``/``Isend`` over ``comm`` on host tensors."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        reqs, keep = [], []
        for peer, t in recvs:
            buf = _bytes_view(t, f"the receive buffer from rank {peer}")
            reqs.append(self.comm.Irecv([buf, MPI.BYTE], source=peer, tag=tag))
            keep.append(buf)
        for peer, t in sends:
            buf = _bytes_view(t, f"the send buffer to rank {peer}")
            reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=peer, tag=tag))
            keep.append(buf)
        return MPIRequest(reqs, keep)
