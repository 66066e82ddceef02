"""Moving tensor rows between ranks with one ``Alltoallv`` per tensor, and sending answers back.

    moved = send_rows(comm, dest, coords, feats)     # collective: row i goes to rank dest[i]
    coords_here, feats_here = moved.rows             # from rank 0, then rank 1, ... (each in the
                                                     # sender's order)
    rows_back = moved.reply(answer_here)             # collective: one answer row per received
                                                     # row comes back, in the caller's order

Contract: ``dest`` int [N] ranks of ``comm``; tensors have N rows of any trailing shape and dtype
(host copies are sent as raw bytes, no pickling). The receiver learns nothing about where a row
was in the sender's array; :meth:`Moved.reply` undoes the permutation for the sender. MPI counts
are C ints: a single tensor may move at most 2 GiB per rank pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["Moved", "send_list", "send_rows"]


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A host uint8 [N, row_bytes] copy or view of ``t``'s rows."""
    t = t.detach().cpu().contiguous()
    per_row = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
    if t.numel() == 0:
        return np.zeros((len(t), per_row), np.uint8)
    return t.reshape(len(t), -1).view(torch.uint8).numpy()


def _alltoallv(comm: Any, t: torch.Tensor, send_n: np.ndarray, recv_n: np.ndarray) -> torch.Tensor:
    rows = _as_bytes(t)
    rb = rows.shape[1]
    total = int(recv_n.sum())
    recv = np.empty((total, rb), np.uint8)
    s_cnt, r_cnt = send_n * rb, recv_n * rb
    s_dsp = np.concatenate([[0], np.cumsum(s_cnt)[:-1]]).astype(np.int64)
    r_dsp = np.concatenate([[0], np.cumsum(r_cnt)[:-1]]).astype(np.int64)
    comm.Alltoallv([rows, (s_cnt, s_dsp), MPI.BYTE], [recv, (r_cnt, r_dsp), MPI.BYTE])
    out = torch.from_numpy(recv).view(t.dtype) if recv.size else torch.empty(0, dtype=t.dtype)
    return out.reshape((total,) + tuple(t.shape[1:]))


@dataclass
class Moved:
    """Rows received by :func:`send_rows`, and what is needed to send answers back."""

    rows: tuple[torch.Tensor, ...]
    comm: Any
    order: torch.Tensor     # int64 [N]: the sender's rows sorted by destination
    send_n: np.ndarray      # int64 [size]: rows sent to each rank
    recv_n: np.ndarray      # int64 [size]: rows received from each rank
    local: bool = False     # no rank sent a row to another: nothing moved, no copies made

    def reply(self, *answers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Send one answer row per received row back to its sender (collective).

        ``answers``: tensors with ``recv_n.sum()`` rows, aligned with :attr:`rows`. Returns them,
        on the sender, aligned with the rows it passed to :func:`send_rows`.
        """
        n = int(self.recv_n.sum())
        problem = next((f"reply: an answer has {len(a)} rows; one per received row ({n}) is "
                        f"needed" for a in answers if len(a) != n), "")
        # Agreed first: a rank raising alone would leave the others in the exchange below.
        if not self.local and self.comm.allreduce(1 if problem else 0, op=MPI.MAX) and \
                not problem:
            problem = "reply: another rank passed an answer of the wrong length; see its error"
        if problem:
            raise ValueError(problem)
        out = []
        for a in answers:
            if self.local:  # every row stayed on its rank, in its order
                out.append(a.cpu())
                continue
            back = _alltoallv(self.comm, a, self.recv_n, self.send_n)
            res = torch.empty_like(back)
            res[self.order] = back
            out.append(res)
        return tuple(out)


def send_rows(comm: Any, dest: torch.Tensor, *tensors: torch.Tensor) -> Moved:
    """Send row ``i`` of every tensor to rank ``dest[i]`` of ``comm`` (collective).

    Every rank must pass the same number of tensors with the same dtypes and trailing shapes.
    Received rows come ordered by source rank, each source's rows in that source's order.
    """
    return send_list(comm, dest, list(tensors))


def send_list(comm: Any, dest: torch.Tensor, tensors: list[torch.Tensor]) -> Moved:
    """:func:`send_rows` that consumes ``tensors``: each is removed from the list once sent, so
    that a caller holding no other reference frees it before the next one arrives (peak memory:
    what is received plus one tensor's sorted copy, not everything sent as well)."""
    size = comm.Get_size()
    dest = torch.as_tensor(dest).long().cpu()
    problem = next((f"send_rows: a tensor has {len(t)} rows but dest has {len(dest)}"
                    for t in tensors if len(t) != len(dest)), "")
    if not problem and len(dest) and (int(dest.min()) < 0 or int(dest.max()) >= size):
        problem = (f"send_rows: destinations must lie in [0, {size}); got "
                   f"[{int(dest.min())}, {int(dest.max())}]")
    if size == 1:  # nothing moves: no copies
        if problem:
            raise ValueError(problem)
        n = np.array([len(dest)], np.int64)
        rows = tuple(t.cpu() for t in tensors)
        tensors.clear()
        return Moved(rows, comm, torch.arange(len(dest)), n, n.copy(), local=True)
    # A rank with bad input sends counts of -1: every rank learns of it in the same exchange.
    send_n = np.full(size, -1, np.int64) if problem else \
        np.bincount(dest.numpy(), minlength=size).astype(np.int64)
    recv_n = np.empty(size, np.int64)
    comm.Alltoall(send_n, recv_n)
    if problem:
        raise ValueError(problem)
    if (recv_n < 0).any():
        raise ValueError(f"send_rows: rank {int(np.argmax(recv_n < 0))} passed bad rows; see "
                         f"its error")
    me = comm.Get_rank()
    away = int(send_n.sum() - send_n[me])
    if comm.allreduce(away, op=MPI.MAX) == 0:  # every row is already home (e.g. chunked input)
        rows = tuple(t.cpu() for t in tensors)
        tensors.clear()
        return Moved(rows, comm, torch.arange(len(dest)), send_n, recv_n, local=True)
    order = torch.sort(dest, stable=True)[1]
    received = []
    while tensors:
        t = tensors.pop(0)
        received.append(_alltoallv(comm, t.cpu()[order], send_n, recv_n))
        del t
    return Moved(tuple(received), comm, order, send_n, recv_n)
