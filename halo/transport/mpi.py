"""Host transport: mpi4py non-blocking point-to-point on CPU tensors, no copies, no pickling.

    transport = MPITransport(grid.comm)
    req = transport.start([(peer, send_buf)], [(peer, recv_buf)], tag=11)
    req.wait()

Receives are posted before sends (so an eager message lands in its buffer, not in MPI's unexpected
queue); tensors go to MPI as raw bytes at their address (``MPI.buffer.fromaddress``, ``MPI.BYTE``,
the upper-case buffer-protocol calls), so any dtype works, bfloat16 included, and nothing is
copied or pickled. The request holds the tensors until it completes, so their memory stays valid.
"""

from __future__ import annotations

from typing import NoReturn

import torch
from mpi4py import MPI

from halo.transport.base import CompletedRequest, Peers, Request, Transport, TransportError

__all__ = ["MPITransport", "MPIRequest"]


# mpi4py >= 4 calls it MPI.buffer, 3.x MPI.memory.
_fromaddress = (getattr(MPI, "buffer", None) or getattr(MPI, "memory")).fromaddress


def _bytes_view(t: torch.Tensor, kind: str, peer: int):
    """An MPI buffer over ``t``'s bytes (no copy; ~10x cheaper than a numpy view)."""
    if not t.is_cpu or not t.is_contiguous():
        _refuse(t, f"the {kind} buffer {'to' if kind == 'send' else 'from'} rank {peer}")
    return _fromaddress(t.data_ptr(), t.nbytes)


def _refuse(t: torch.Tensor, what: str) -> NoReturn:
    if not t.is_cpu:
        raise TransportError(f"MPITransport: {what} is on {t.device}; it moves host (CPU) tensors "
                             f"only - use a device transport or move the tensor to the CPU")
    raise TransportError(f"MPITransport: {what} of shape {tuple(t.shape)} is not contiguous; "
                         f"pass a contiguous tensor (its bytes are sent as they lie)")


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

    kind = "mpi"

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm

    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        if not sends and not recvs:
            return CompletedRequest()
        # Every buffer is checked before anything is posted: an error leaves nothing in flight.
        rbufs = [_bytes_view(t, "receive", peer) for peer, t in recvs]
        sbufs = [_bytes_view(t, "send", peer) for peer, t in sends]
        reqs = [self.comm.Irecv([b, MPI.BYTE], source=peer, tag=tag)
                for b, (peer, _) in zip(rbufs, recvs)]
        reqs += [self.comm.Isend([b, MPI.BYTE], dest=peer, tag=tag)
                 for b, (peer, _) in zip(sbufs, sends)]
        return MPIRequest(reqs, [t for _, t in recvs] + [t for _, t in sends])
