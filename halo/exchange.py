"""Halo exchange of feature rows along a plan, its adjoint, and both as an autograd function.

    ex = HaloExchange(plan, MPITransport(grid.comm))
    pending = ex.start(feats)          # feats [num_local, C]; non-blocking
    ...                                # local work; pending.test() lets MPI progress
    halo = pending.wait()              # [num_halo, C], rows match plan.halo_coords

    grad_local = ex.start_adjoint(grad_halo).wait()   # [num_local, C]: H^T grad_halo
    halo = halo_exchange(feats, ex)                     # autograd: backward is the adjoint

The forward is a linear map H: ``halo[j] = feats[i]`` of the rank owning halo voxel j. Its adjoint
H^T sends each halo row's gradient back to the owner, which sums the gradients of a row sent to
several neighbours (a corner voxel goes to up to 7). Send and receive staging buffers are kept
per (C, dtype, device) and reused; the forward result and the adjoint result are new tensors each
call (they outlive the call, e.g. saved for a backward). Forward messages use ``tag``, adjoint
messages ``tag + 1``: give two exchanges that may be in flight at once tags at least 2 apart.
"""

from __future__ import annotations

from typing import Optional

import torch

from halo.plan import HaloPlan
from halo.transport.base import Request, Transport

__all__ = ["ExchangeError", "HaloExchange", "Pending", "halo_exchange", "EXCHANGE_TAG"]

EXCHANGE_TAG = 0x4A20


class ExchangeError(ValueError):
    """Features handed to an exchange do not fit its plan."""


class Pending:
    """An exchange in flight; ``wait()`` returns its result (once)."""

    def __init__(self, request: Request, finish, release) -> None:
        self._request = request
        self._finish = finish
        self._release = release
        self._result: Optional[torch.Tensor] = None

    def test(self) -> bool:
        """Make progress; True when the messages have all arrived (``wait`` will not block)."""
        return self._request.test()

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
        self._send_index: dict[torch.device, torch.Tensor] = {}
        self._send_offs = [0]
        for r in plan.send_rows:
            self._send_offs.append(self._send_offs[-1] + len(r))
        self._recv_offs = plan.recv_offsets
        # Free staging buffers [sum(send counts), C] per (C, dtype, device); one is taken per
        # exchange in flight and given back at wait, so overlapping exchanges never share one.
        self._pool: dict[tuple, list[torch.Tensor]] = {}

    def _index(self, device: torch.device) -> torch.Tensor:
        idx = self._send_index.get(device)
        if idx is None:
            rows = self.plan.send_rows
            idx = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)).to(device)
            self._send_index[device] = idx
        return idx

    def _acquire(self, c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._pool.setdefault((c, dtype, device), [])
        return free.pop() if free else torch.empty(self._send_offs[-1], c, dtype=dtype,
                                                    device=device)

    def _releaser(self, buf: torch.Tensor):
        key = (buf.shape[1], buf.dtype, buf.device)
        return lambda: self._pool.setdefault(key, []).append(buf)

    def _check(self, x: torch.Tensor, rows: int, what: str) -> None:
        if x.ndim != 2 or x.shape[0] != rows:
            raise ExchangeError(f"{what} has shape {tuple(x.shape)}; the plan needs [{rows}, C]")

    def start(self, feats: torch.Tensor, out: Optional[torch.Tensor] = None) -> Pending:
        """Start sending owned rows to the neighbours; ``wait()`` gives the halo [num_halo, C].

        feats: [num_local, C] rows matching the plan's local coords. out: optional contiguous
        [num_halo, C] tensor to receive into (same dtype and device); by default a new one.
        """
        p = self.plan
        self._check(feats, p.num_local, "feats")
        c = feats.shape[1]
        if out is None:
            out = torch.empty(p.num_halo, c, dtype=feats.dtype, device=feats.device)
        elif (tuple(out.shape) != (p.num_halo, c) or out.dtype != feats.dtype
              or out.device != feats.device or not out.is_contiguous()):
            raise ExchangeError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                                f"contiguous [{p.num_halo}, {c}] {feats.dtype} on {feats.device}")
        stage = self._acquire(c, feats.dtype, feats.device)
        torch.index_select(feats.detach(), 0, self._index(feats.device), out=stage)
        so, ro = self._send_offs, self._recv_offs
        sends = [(r, stage[so[i]:so[i + 1]]) for i, r in enumerate(p.send_ranks)]
        recvs = [(r, out[ro[i]:ro[i + 1]]) for i, r in enumerate(p.recv_ranks)]
        req = self.transport.start(sends, recvs, self.tag)
        return Pending(req, lambda: out, self._releaser(stage))

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
        if out is not None and (tuple(out.shape) != (p.num_local, c) or out.dtype != g.dtype
                                or out.device != g.device):
            raise ExchangeError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                                f"[{p.num_local}, {c}] {g.dtype} on {g.device}")
        stage = self._acquire(c, g.dtype, g.device)
        so, ro = self._send_offs, self._recv_offs
        sends = [(r, g[ro[i]:ro[i + 1]]) for i, r in enumerate(p.recv_ranks)]
        recvs = [(r, stage[so[i]:so[i + 1]]) for i, r in enumerate(p.send_ranks)]
        req = self.transport.start(sends, recvs, self.tag + 1)
        index = self._index(g.device)

        def finish() -> torch.Tensor:
            # g is referenced here on purpose: the send views into it must outlive the request.
            acc = torch.zeros(p.num_local, c, dtype=g.dtype, device=g.device) if out is None \
                else out
            return acc.index_add_(0, index, stage)

        return Pending(req, finish, self._releaser(stage))


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
