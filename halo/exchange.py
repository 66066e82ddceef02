"""Halo exchange of feature rows along a plan, its adjoint, and both as an autograd function.

    ex = HaloExchange(plan, MPITransport(grid.comm))
    pending = ex.start(feats)          # feats [num_local, C]; non-blocking
    ...                                # local work; pending.test() lets MPI progress
    halo = pending.wait()              # [num_halo, C], rows match plan.halo_coords

    grad_local = ex.start_adjoint(grad_halo).wait()   # [num_local, C]: H^T grad_halo
    halo = halo_exchange(feats, ex)                     # autograd: backward is the adjoint

The forward is a linear map H: ``halo[j] = feats[i]`` of the rank owning halo voxel j. Its adjoint
H^T sends each halo row's gradient back to the owner, which sums the gradients of a row sent to
several neighbours (a corner voxel goes to up to 7).

Copies. A block of send rows that is a contiguous range of ``feats`` (a face normal to x when
rows are sorted by key, as :func:`halo.distribute` leaves them) is sent straight from ``feats``
and its returning gradient added with one slice add; other blocks are packed with one
``index_select`` into a staging buffer and unpacked with one ``index_add_``. Staging buffers are
kept per (C, dtype, device) and reused; results are new tensors unless ``out=`` is given (they
usually outlive the call, e.g. saved for a backward). Until ``wait()`` returns, ``feats`` (and
``grad_halo``) must not be modified in place: their memory may be on the wire.

Tags: forward messages use ``tag``, adjoint messages ``tag + 1``; two exchanges that may be in
flight at once between the same ranks need tags at least 2 apart, or the same start order on
every rank (MPI matches messages of one tag in order).

Errors. ``start`` checks its tensors against the plan on this rank alone (an exchange is the hot
path: it agrees on nothing), so an ExchangeError there leaves the neighbours waiting for its
messages: run under ``python -m launch run`` or call :func:`launch.run.abort_on_exception`, so
that such an error ends the job. The plan itself is agreed when built (:func:`build_plan`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from halo.plan import HaloPlan, send_runs
from halo.transport.base import Request, Transport

__all__ = ["ExchangeError", "HaloExchange", "Pending", "halo_exchange", "EXCHANGE_TAG"]

EXCHANGE_TAG = 0x4A20


class ExchangeError(ValueError):
    """Features handed to an exchange do not fit its plan."""


class Pending:
    """An exchange in flight; ``wait()`` returns its result (the same tensor on every call)."""

    def __init__(self, request: Request, finish: Callable[[], torch.Tensor],
                 release: Callable[[], None]) -> None:
        self._request = request
        self._finish = finish
        self._release = release
        self._result: Optional[torch.Tensor] = None

    def test(self) -> bool:
        """Make progress; True when the messages have all arrived (``wait`` will not block)."""
        return self._result is not None or self._request.test()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._request.wait()
            self._result = self._finish()
            self._release()
        return self._result


class HaloExchange:
    """Exchanges feature rows along ``plan`` through ``transport`` (see the module docstring)."""

    def __init__(self, plan: HaloPlan, transport: Transport, tag: int = EXCHANGE_TAG) -> None:
        self.plan = plan
        self.transport = transport
        self.tag = int(tag)
        self._recv_offs = plan.recv_offsets
        self._runs = plan.send_runs if plan.send_runs is not None else \
            send_runs(plan.send_rows)
        # Staging layout: packed (non-range) blocks first, then range blocks (adjoint only), so
        # one index_select / index_add_ covers every packed block.
        packed = [i for i, r in enumerate(self._runs) if r is None]
        ranged = [i for i, r in enumerate(self._runs) if r is not None]
        self._slot: dict[int, tuple[int, int]] = {}
        off = 0
        for i in packed + ranged:
            n = len(plan.send_rows[i])
            self._slot[i] = (off, off + n)
            off += n
        self._n_packed = sum(len(plan.send_rows[i]) for i in packed)
        self._n_stage = off
        self._packed_rows = [plan.send_rows[i] for i in packed]
        self._index: dict[torch.device, torch.Tensor] = {}
        # Free staging buffers per (direction, C, dtype, device); one is taken per exchange in
        # flight and given back at wait, so overlapping exchanges never share one.
        self._pool: dict[tuple, list[tuple[torch.Tensor, dict[int, torch.Tensor]]]] = {}

    def _packed_index(self, device: torch.device) -> torch.Tensor:
        idx = self._index.get(device)
        if idx is None:
            rows = self._packed_rows
            idx = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)).to(device)
            self._index[device] = idx
        return idx

    def _acquire(self, key: tuple, rows: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A free staging buffer [rows, C] and its block views (made once per buffer)."""
        free = self._pool.setdefault(key, [])
        if free:
            return free.pop()
        _, c, dtype, device = key
        buf = torch.empty(rows, c, dtype=dtype, device=device)
        return buf, {i: buf[a:b] for i, (a, b) in self._slot.items() if b <= rows}

    def _releaser(self, key: tuple, staged: tuple) -> Callable[[], None]:
        return lambda: self._pool.setdefault(key, []).append(staged)

    def _check(self, x: torch.Tensor, rows: int, what: str) -> None:
        if x.ndim != 2 or x.shape[0] != rows:
            raise ExchangeError(f"{what} has shape {tuple(x.shape)}; the plan needs [{rows}, C]")

    def _check_out(self, out: torch.Tensor, rows: int, like: torch.Tensor) -> None:
        c = like.shape[1]
        if (tuple(out.shape) != (rows, c) or out.dtype != like.dtype or out.device != like.device
                or not out.is_contiguous()):
            raise ExchangeError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                                f"contiguous [{rows}, {c}] {like.dtype} on {like.device}")

    def start(self, feats: torch.Tensor, out: Optional[torch.Tensor] = None) -> Pending:
        """Start sending owned rows to the neighbours; ``wait()`` gives the halo [num_halo, C].

        feats: [num_local, C] rows matching the plan's local coords. out: optional contiguous
        [num_halo, C] tensor to receive into (same dtype and device); by default a new one.
        """
        p = self.plan
        self._check(feats, p.num_local, "feats")
        src = feats.detach().contiguous()
        c = src.shape[1]
        if out is None:
            out = torch.empty(p.num_halo, c, dtype=src.dtype, device=src.device)
        else:
            self._check_out(out, p.num_halo, src)
        key = ("fwd", c, src.dtype, src.device)
        staged = self._acquire(key, self._n_packed)
        stage, views = staged
        if self._n_packed:
            torch.index_select(src, 0, self._packed_index(src.device), out=stage)
        sends = []
        for i, r in enumerate(p.send_ranks):
            run = self._runs[i]
            # A range of rows goes straight from feats (no copy); the rest from the staging buffer.
            sends.append((r, src[run[0]:run[1]] if run is not None else views[i]))
        ro = self._recv_offs
        recvs = [(r, out[ro[i]:ro[i + 1]]) for i, r in enumerate(p.recv_ranks)]
        req = self.transport.start(sends, recvs, self.tag)
        result = out
        return Pending(req, lambda: result, self._releaser(key, staged))

    def start_adjoint(self, grad_halo: torch.Tensor, out: Optional[torch.Tensor] = None) -> Pending:
        """Start returning halo gradients [num_halo, C] to their owners; ``wait()`` gives
        [num_local, C]: the sum, per owned row, of the gradients of all its halo copies.

        out: optional [num_local, C] tensor to add the result into (e.g. the local gradient,
        saving an allocation and an add); by default a new zero tensor.
        """
        p = self.plan
        self._check(grad_halo, p.num_halo, "grad_halo")
        g = grad_halo.detach().contiguous()
        c = g.shape[1]
        if out is not None:
            self._check_out(out, p.num_local, g)
        key = ("adj", c, g.dtype, g.device)
        staged = self._acquire(key, self._n_stage)
        stage, views = staged
        ro = self._recv_offs
        sends = [(r, g[ro[i]:ro[i + 1]]) for i, r in enumerate(p.recv_ranks)]
        recvs = [(r, views[i]) for i, r in enumerate(p.send_ranks)]
        req = self.transport.start(sends, recvs, self.tag + 1)
        index = self._packed_index(g.device)
        n_packed = self._n_packed
        runs = [(run, i) for i, run in enumerate(self._runs) if run is not None]

        def finish() -> torch.Tensor:
            # g is referenced here on purpose: the send views into it must outlive the request.
            acc = torch.zeros(p.num_local, c, dtype=g.dtype, device=g.device) if out is None \
                else out
            if n_packed:
                acc.index_add_(0, index, stage[:n_packed])
            for (a, b), i in runs:
                acc[a:b] += views[i]
            return acc

        return Pending(req, finish, self._releaser(key, staged))


class _HaloExchangeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feats: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:  # type: ignore
        ctx.exchange = exchange
        return exchange.start(feats).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.start_adjoint(grad).wait(), None


def halo_exchange(feats: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:
    """Blocking exchange as an autograd function: halo [num_halo, C]; backward is the adjoint."""
    return _HaloExchangeFn.apply(feats, exchange)
