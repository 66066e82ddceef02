"""The transport interface: start point-to-point transfers of whole tensors, test, wait.

    class MyTransport(Transport):
        def start(self, sends, recvs, tag): ...   # returns a Request

Contract: ``sends`` and ``recvs`` are lists of ``(peer rank, tensor)``; every tensor is contiguous
and stays untouched (sends) or unread (recvs) until the request completes. A receive tensor must
have exactly the bytes its peer sends. Messages between one pair of ranks with one tag match in the
order they were started (MPI's non-overtaking rule), so callers that start exchanges in the same
order on every rank need no more than a tag per kind of exchange.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from halo.transport.streams import Device

__all__ = ["Transport", "Reducer", "Request", "TransportError", "Peers"]

Peers = list[tuple[int, torch.Tensor]]


class TransportError(ValueError):
    """A transport or reducer used against its contract: a tensor that does not fit it (device,
    layout, size), or a call out of turn (a start after close)."""


class Request(ABC):
    """A set of transfers in flight."""

    @abstractmethod
    def test(self) -> bool:
        """Make progress; True once every transfer of this request has completed."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every transfer has completed; the receive tensors then hold the data."""


class CompletedRequest(Request):
    """A request with nothing in flight (no peers)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Transport(ABC):
    """Moves tensors between ranks of one communicator (ranks are that communicator's).
    ``kind``: its name as ``--transport`` says it ("mpi", "staged", "ipc", "nccl")."""

    kind: str = ""

    @abstractmethod
    def start(self, sends: Peers, recvs: Peers, tag: int) -> Request:
        """Post every receive, then every send; return with a :class:`Request` without waiting
        for the transfers."""

    def progress(self) -> bool:
        """Hand on what this transport holds back (a staged send whose copy has finished);
        True while something is still held back. Call it while blocked on other messages that
        a peer may send only after receiving those. Most transports hold nothing back."""
        return False

    def close(self) -> None:
        """Free what it holds (CUDA IPC's buffers, an NCCL communicator): collective over its
        ranks, once every request has completed on every rank; closing again does nothing.
        Most transports hold nothing such."""


class Reducer(ABC):
    """All-reduces tensors of one device over the ranks of one communicator, stream-ordered.

    ``iallreduce_`` reads ``t`` after the work enqueued so far on the device's compute stream and
    returns at once; the request's ``wait`` makes the compute stream wait for the sum (the host
    need not block). Started all-reduces match by the order they were started on each rank: start
    them in the same order everywhere. The collective functions route a tensor here when it lives
    on ``device`` (:class:`~halo.transport.collectives.ReduceGroup`).
    """

    device: "Device"

    @abstractmethod
    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Request:
        """Start the in-place all-reduce (``op``: "sum", "max" or "min") of the contiguous
        ``t``; leave ``t`` untouched until the request's ``wait``."""

    def close(self) -> None:
        """Free what it holds that peers use (CUDA IPC's buffers): collective over its ranks,
        once every all-reduce has completed on every rank; closing again does nothing. Most
        reducers hold nothing such."""

    def _check(self, t: torch.Tensor, op: str) -> None:
        """Refuse, before anything is enqueued, an ``op`` MPI has no reduction for or a ``t``
        that is not a contiguous tensor of this reducer's device."""
        from halo.transport.collectives import mpi_op

        mpi_op(op)
        if t.device.type != self.device.type or not t.is_contiguous():
            raise TransportError(f"{type(self).__name__}: the all-reduce buffer must be a "
                                 f"contiguous {self.device.type} tensor; got a "
                                 f"{'' if t.is_contiguous() else 'non-contiguous '}tensor of "
                                 f"shape {tuple(t.shape)} on {t.device}")
