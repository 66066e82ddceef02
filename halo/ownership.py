"""Ownership: which rank owns a voxel, and moving voxel rows to their owners and back.

    owner = owner_ranks(grid, cuts, coords)                     # int64 [N] rank per row
    coords, feats = distribute(grid, cuts, coords, feats)       # collective: rows to their owners
    out = gather(grid, coords, feats, root=0)                   # collective: (coords, feats) on root

Contract: coords int32 [N, 4] (batch, x, y, z), global voxel indices at ``stride``; payloads are
tensors with N rows of any trailing shape and dtype. Rows arrive sorted by
:func:`halo.kmap.coord_keys`, so the result does not depend on which rank contributed what.
Transport is ``Alltoallv`` / ``Gatherv`` on raw bytes of host copies (buffer protocol, no
pickling); this is for set-up and I/O, not the training hot path. Bad input (out-of-extent
coordinates, batch indices outside [0, MAX_BATCH), mismatched rows, or cuts, stride, dtypes or
trailing shapes that differ between ranks) raises OwnershipError on every rank.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from halo.agree import agree
from halo.cuts import Cuts
from halo.grid import ProcessGrid
from halo.kmap import MAX_BATCH, coord_keys

__all__ = ["OwnershipError", "owner_ranks", "distribute", "gather"]


class OwnershipError(ValueError):
    """Rows passed to distribute or gather break their contract."""


def owner_ranks(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """int64 [N]: the grid rank owning each row of ``coords`` (int [N, 4] at ``stride``)."""
    if tuple(cuts.dims) != tuple(grid.dims):
        raise OwnershipError(f"cuts are for a grid {cuts.dims} but the process grid is {grid.dims}")
    if coords.ndim != 2 or coords.shape[1] != 4:
        raise OwnershipError(f"coords has shape {tuple(coords.shape)}; expected [N, 4] "
                             f"(batch, x, y, z)")
    g = torch.as_tensor(cuts.locate(coords[:, 1:], stride))
    d = grid.dims
    return (g[:, 0] * d[1] + g[:, 1]) * d[2] + g[:, 2]


def _problems(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, payloads, stride: int) -> str:
    """A description of what is wrong with this rank's input, or ''."""
    if tuple(cuts.dims) != tuple(grid.dims):
        return f"cuts are for a grid {cuts.dims} but the process grid is {grid.dims}"
    if not isinstance(stride, (int, np.integer)) or stride < 1:
        return f"stride is {stride!r}; it must be a positive integer"
    problem = _rows_problem(coords, payloads)
    if problem or not len(coords):
        return problem
    hi = torch.tensor([cuts.axis_bounds(a, stride)[-1] for a in range(3)])
    xyz = coords[:, 1:].long().cpu()
    batch = coords[:, 0].long().cpu()
    bad = ((xyz < 0) | (xyz >= hi)).any(1) | (batch < 0) | (batch >= MAX_BATCH)
    if bad.any():
        row = int(torch.nonzero(bad)[0])
        return (f"coords row {row} is {coords[row].tolist()}, outside the extent "
                f"{tuple(hi.tolist())} at stride {stride} or batch [0, {MAX_BATCH}) "
                f"({int(bad.sum())} such rows)")
    return ""


def _rows_problem(coords: torch.Tensor, payloads) -> str:
    """What is wrong with the shapes of ``coords`` and the payloads, or ''."""
    if coords.ndim != 2 or coords.shape[1] != 4:
        return f"coords has shape {tuple(coords.shape)}; expected [N, 4] (batch, x, y, z)"
    for i, p in enumerate(payloads):
        if p.ndim < 1 or p.shape[0] != coords.shape[0]:
            return f"payload {i} has shape {tuple(p.shape)}; expected {coords.shape[0]} rows"
    return ""


def _agree(comm: MPI.Comm, problem: str, tensors, setting: str = "") -> None:
    """Raise OwnershipError on every rank if any rank found a problem, or the ranks' tensors
    (coords, then payloads: their dtypes and row shapes, since rows travel as bytes and are read
    back as the receiver's dtype) or ``setting`` differ."""
    words = "; ".join([setting] + [f"{t.dtype} x {tuple(t.shape[1:])}" for t in tensors])
    any_problem, same = agree(comm, bool(problem), words)
    if problem:
        raise OwnershipError(problem)
    if any_problem:
        raise OwnershipError("another rank passed bad rows; see its error")
    if not same:
        raise OwnershipError(f"ranks passed different arguments (cuts, stride, or the dtype or "
                             f"row shape of coords or a payload): here {words}; every rank "
                             f"must pass the same")


def _rows_as_bytes(t: torch.Tensor) -> np.ndarray:
    """A host uint8 [N, row_bytes] view (or copy) of a tensor's rows."""
    t = t.detach().cpu().contiguous()
    per_row = int(np.prod(t.shape[1:], dtype=np.int64))
    if t.numel() == 0:
        return np.zeros((len(t), per_row * t.element_size()), np.uint8)
    return t.reshape(len(t), per_row).view(torch.uint8).numpy()


def _from_bytes(buf: np.ndarray, like: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.from_numpy(buf).view(like.dtype) if buf.size else \
        torch.empty(0, dtype=like.dtype)
    return out.reshape((n,) + tuple(like.shape[1:])).to(like.device)


def _sort_by_key(coords: torch.Tensor, payloads: list[torch.Tensor]):
    order = torch.sort(coord_keys(coords), stable=True)[1]
    return coords[order], [p[order] for p in payloads]


def distribute(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, *payloads: torch.Tensor,
               stride: int = 1) -> tuple[torch.Tensor, ...]:
    """Send every row to the rank owning its coordinate (collective over ``grid.comm``).

    Returns ``(coords, *payloads)`` holding exactly the rows this rank owns, from all ranks,
    sorted by key; devices and dtypes are kept. Any rank may contribute any rows (or none).
    """
    comm = grid.comm
    _agree(comm, _problems(grid, cuts, coords, payloads, stride), (coords, *payloads),
           f"cuts {cuts!r}, stride {stride}")
    owner = owner_ranks(grid, cuts, coords, stride).cpu()
    order = torch.sort(owner, stable=True)[1]
    send_n = np.bincount(owner.numpy(), minlength=grid.size).astype(np.int64)
    recv_n = np.empty(grid.size, np.int64)
    comm.Alltoall(send_n, recv_n)
    total = int(recv_n.sum())
    out = []
    for t in (coords,) + payloads:
        rows = _rows_as_bytes(t[order.to(t.device)])
        rb = rows.shape[1]
        recv = np.empty((total, rb), np.uint8)
        s_cnt, r_cnt = send_n * rb, recv_n * rb
        s_dsp = np.concatenate([[0], np.cumsum(s_cnt)[:-1]])
        r_dsp = np.concatenate([[0], np.cumsum(r_cnt)[:-1]])
        comm.Alltoallv([rows, (s_cnt, s_dsp), MPI.BYTE], [recv, (r_cnt, r_dsp), MPI.BYTE])
        out.append(_from_bytes(recv, t, total))
    c, ps = _sort_by_key(out[0], out[1:])
    return (c, *ps)


def gather(grid: ProcessGrid, coords: torch.Tensor, *payloads: torch.Tensor,
           root: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
    """Collect every rank's rows on ``root`` (collective): ``(coords, *payloads)`` sorted by key.

    Other ranks get None. Rows are concatenated as they are; duplicates are kept.
    """
    comm = grid.comm
    _agree(comm, _rows_problem(coords, payloads), (coords, *payloads), f"root {root!r}")
    n = np.array([len(coords)], np.int64)
    counts = np.empty(grid.size, np.int64) if grid.rank == root else None
    comm.Gather(n, counts, root=root)
    out = []
    for t in (coords,) + payloads:
        rows = _rows_as_bytes(t)
        rb = rows.shape[1]
        if counts is not None:  # the root
            recv = np.empty((int(counts.sum()), rb), np.uint8)
            cnt = counts * rb
            dsp = np.concatenate([[0], np.cumsum(cnt)[:-1]])
            comm.Gatherv(rows, [recv, (cnt, dsp), MPI.BYTE], root=root)
            out.append(_from_bytes(recv, t, int(counts.sum())))
        else:
            comm.Gatherv(rows, None, root=root)
    if grid.rank != root:
        return None
    c, ps = _sort_by_key(out[0], out[1:])
    return (c, *ps)
