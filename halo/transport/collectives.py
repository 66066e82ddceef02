"""Collectives on tensors: all-reduce (blocking and started), broadcast, variable-count
all-gather - the one home for them.

    allreduce_(stats, comm)                  # in place, sum over comm (no-op for None / 1 rank)
    req = iallreduce_(bucket, comm)          # started; compute meanwhile ...
    req.wait()                               # bucket now holds the sum
    group = ReduceGroup(comm, NCCLTransport(comm, dev))   # device tensors reduce on the device
    allreduce_(d_stats, group)               # the compute stream waits for the sum
    bcast_(weights, comm, root=0)
    everything = allgatherv(my_rows, comm)   # every rank's rows, in rank order

Every layer that sums over ranks (BatchNorm statistics, pooling, loss counts, metrics, gradients)
calls these, never mpi4py directly. ``comm`` is an mpi4py communicator, None (one rank), or a
:class:`ReduceGroup`: a communicator with the :class:`~halo.transport.base.Reducer` for its
device's tensors (NCCL, CUDA IPC, or host-staged on a communication stream:
``select.make_reducer``). A
tensor on the reducer's device is all-reduced by it; every other tensor as follows. Host (CPU)
tensors go to MPI as raw bytes at their address with the matching MPI datatype: no numpy, no copy,
no pickling. A tensor MPI has no datatype for (float16, bfloat16, bool) is reduced through a
float64/int64 copy (exact for max/min; a sum rounds once, to the tensor's dtype); a non-contiguous
one through a contiguous copy. A device tensor without a reducer is staged through a blocking host
copy (correct, not fast). ``bcast_`` and ``allgatherv`` (set-up and evaluation, not the training
step) always stage device tensors through the host; ``allgatherv`` moves exact copies, so a dtype
MPI has no datatype for travels as bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from halo.transport.base import CompletedRequest, Reducer, Request, TransportError

__all__ = ["ReduceGroup", "allreduce_", "iallreduce_", "bcast_", "allgatherv", "group_size",
           "mpi_op", "mpi_types", "raw_buffer"]

_OPS = ("sum", "max", "min")


def _mpi() -> Any:
    from mpi4py import MPI  # imported on use: the geometry half of halo needs no MPI

    return MPI


def mpi_op(op: str) -> Any:
    """The MPI reduction of ``op`` ("sum", "max", "min")."""
    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {', '.join(_OPS)}; got {op!r}")
    MPI = _mpi()
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


@dataclass(frozen=True)
class ReduceGroup:
    """An mpi4py communicator (or None: one rank) and the reducer of its device tensors (None:
    every tensor goes through MPI, device tensors via host copies)."""

    comm: Any
    reducer: Optional[Reducer] = None


def _route(comm: Any, t: torch.Tensor) -> tuple[Any, Optional[Reducer]]:
    """(the mpi4py communicator or None, the group's reducer if ``t`` is on its device)."""
    if not isinstance(comm, ReduceGroup):
        return comm, None
    r = comm.reducer
    return comm.comm, (r if r is not None and t.device.type == r.device.type else None)


def mpi_types() -> dict[torch.dtype, Any]:
    """The MPI datatype of each torch dtype MPI can reduce."""
    MPI = _mpi()
    return {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T}


def _direct(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous() and t.dtype in mpi_types()


def raw_buffer(t: torch.Tensor) -> Any:
    """An MPI buffer over a contiguous host tensor's bytes (mpi4py >= 4: MPI.buffer, 3.x:
    MPI.memory)."""
    MPI = _mpi()
    return (getattr(MPI, "buffer", None) or getattr(MPI, "memory")).fromaddress(t.data_ptr(),
                                                                               t.nbytes)


def _buffer(t: torch.Tensor) -> list[Any]:
    """``[raw buffer at t's address, MPI datatype]`` for a host tensor ``_direct`` accepts."""
    return [raw_buffer(t), mpi_types()[t.dtype]]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy MPI can reduce: t's dtype where MPI has it, else float64 (float16,
    bfloat16) or int64 (bool)."""
    dt = t.dtype if t.dtype in mpi_types() else (
        torch.float64 if t.is_floating_point() else torch.int64)
    return t.detach().to("cpu", dt).contiguous()


def group_size(comm: Any) -> int:
    """Ranks of ``comm`` (a communicator, None: 1, or a :class:`ReduceGroup`)."""
    comm = comm.comm if isinstance(comm, ReduceGroup) else comm
    return 1 if comm is None else int(comm.Get_size())


def allreduce_(t: torch.Tensor, comm: Any, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``comm`` (a communicator, None, or a
    :class:`ReduceGroup`); returns ``t`` (no-op when comm is None or has one rank). On a
    reducer's device the compute stream, not the host, waits for the result."""
    MPI_op = mpi_op(op)
    if group_size(comm) == 1:
        return t
    comm, reducer = _route(comm, t)
    if reducer is not None:
        # Copies in and out through the compute stream: after t's producers, after the sum.
        compute, dense = reducer.device.compute, t.detach()
        if not dense.is_contiguous():
            dense = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            compute.copy_(dense, t.detach())
        reducer.iallreduce_(dense, op).wait()
        if dense.data_ptr() != t.data_ptr():
            with torch.no_grad():
                compute.copy_(t, dense)
        return t
    if _direct(t):
        comm.Allreduce(_mpi().IN_PLACE, _buffer(t.detach()), op=MPI_op)
        return t
    host = _host_copy(t)
    comm.Allreduce(_mpi().IN_PLACE, _buffer(host), op=MPI_op)
    with torch.no_grad():
        t.copy_(host)
    return t


class _CopyBack(Request):
    """A started all-reduce of a staging copy; ``wait`` copies the result into the tensor."""

    def __init__(self, req: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self._req, self._host, self._target = req, host, target

    def test(self) -> bool:
        if self._req is None:
            return True
        if not self._req.Test():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        if self._req is not None:
            self._req.Wait()
            self._finish()

    def _finish(self) -> None:
        self._req = None
        if self._host is not self._target:
            with torch.no_grad():
                self._target.copy_(self._host)


def iallreduce_(t: torch.Tensor, comm: Any, op: str = "sum") -> Request:
    """Start an in-place all-reduce of ``t`` over ``comm`` (``MPI_Iallreduce``, or the
    :class:`ReduceGroup`'s reducer on its device); ``t`` must stay untouched until the returned
    request's ``wait``. Host tensors MPI can type are reduced where they lie; others through a
    host copy that ``wait`` writes back.

    Non-blocking collectives match by the order they are started on each rank of ``comm``: start
    them in the same order everywhere, and keep blocking collectives on that communicator from
    interleaving with them differently on different ranks (give them a ``comm.Dup()``)."""
    MPI_op = mpi_op(op)
    if group_size(comm) == 1:
        return CompletedRequest()
    comm, reducer = _route(comm, t)
    if reducer is not None:
        return reducer.iallreduce_(t.detach(), op)
    host = t.detach() if _direct(t) else _host_copy(t)
    req = comm.Iallreduce(_mpi().IN_PLACE, _buffer(host), op=MPI_op)
    return _CopyBack(req, host, t.detach())


def bcast_(t: torch.Tensor, comm: Any, root: int = 0) -> torch.Tensor:
    """Broadcast ``t`` in place from ``root`` of ``comm``; any dtype (sent as bytes)."""
    if group_size(comm) == 1:
        return t
    comm = _route(comm, t)[0]
    byte = _mpi().BYTE
    if t.is_cpu and t.is_contiguous():
        comm.Bcast([raw_buffer(t.detach()), byte], root=root)
        return t
    host = t.detach().to("cpu").contiguous()
    comm.Bcast([raw_buffer(host), byte], root=root)
    with torch.no_grad():
        t.copy_(host)
    return t


def allgatherv(t: torch.Tensor, comm: Any) -> torch.Tensor:
    """Every rank's rows of ``t``, concatenated in rank order, on every rank of ``comm``.

    t: ``[n_r, *row]`` on rank r, any dtype and device; ``n_r`` may differ between ranks (and be
    0), ``row`` and the dtype must be the same everywhere. Returns ``[sum n_r, *row]``, t's dtype,
    on t's device, not part of the autograd graph (at one rank, or comm None: ``t.detach()``,
    sharing t's memory). **Collective** over ``comm``: the row counts, shapes and dtypes travel
    first (one small ``allgather``), so a mismatch raises the same :class:`TransportError` on
    every rank; then the rows go in one ``MPI_Allgatherv`` from the host tensor's address, with
    its MPI datatype, or as bytes for a dtype MPI lacks (bfloat16, bool, ...; a gather is exact).
    Device tensors go through a host copy.
    """
    comm = _route(comm, t)[0]
    row = tuple(t.shape[1:])
    n = int(t.shape[0]) if t.dim() else None
    metas = [(n, row, str(t.dtype))] if group_size(comm) == 1 else \
        comm.allgather((n, row, str(t.dtype)))
    scalar = [r for r, m in enumerate(metas) if m[0] is None]
    if scalar:  # checked after the allgather, so every rank raises, not only the odd one
        raise TransportError(f"allgatherv: t must have a row axis (at least one dimension); rank(s) "
                             f"{scalar} gave a 0-d tensor; gather t.reshape(1) instead")
    if len(metas) == 1:
        return t.detach()
    if any(m[1:] != metas[0][1:] for m in metas):  # every rank sees the same metas: same verdict
        found = ", ".join(f"rank {r}: rows {list(shape)} {dtype}"
                          for r, (_, shape, dtype) in enumerate(metas))
        raise TransportError(f"allgatherv: every rank must give rows of one shape and dtype; got "
                             f"{found}; reshape or convert t to agree before gathering")
    rows = [int(m[0]) for m in metas if m[0] is not None]  # all of them: no 0-d tensors above
    out = torch.empty((sum(rows),) + row, dtype=t.dtype)
    if out.numel() > 0:
        host = t.detach().to("cpu").contiguous()
        width = math.prod(row)
        if t.dtype in mpi_types():
            unit, per_row = mpi_types()[t.dtype], width
        else:
            unit, per_row = _mpi().BYTE, width * t.element_size()
        counts = [k * per_row for k in rows]
        displs = [0, *itertools.accumulate(counts)][:-1]
        comm.Allgatherv([raw_buffer(host), counts[comm.Get_rank()], unit],
                        [raw_buffer(out), (counts, displs), unit])
    return out.to(t.device)
