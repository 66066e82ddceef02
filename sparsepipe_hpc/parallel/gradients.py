"""Bucketed gradient all-reduce, started during backward as soon as a bucket's gradients are final.

    reducer = GradientReducer(model.parameters(), ctx.stats_comm, bucket_bytes=4 << 20)
    opt.zero_grad(set_to_none=True)
    reducer.arm()                 # the NEXT backward is the step's last: reduce as grads appear
    loss.backward()               # buckets start (MPI_Iallreduce) from inside backward
    reducer.finish()              # start the rest, wait for all, write the sums into p.grad
    opt.step()

The result is :meth:`ParallelContext.allreduce_gradients`'s: every parameter's ``.grad`` becomes
the sum over the ranks of ``comm`` (zeros where a rank had none), elementwise the same MPI sum,
only split into buckets and started earlier. A parameter no rank gave a gradient, and a frozen one
(``requires_grad=False``), keeps ``grad = None``, as in one process: an optimizer skips it (with
its weight decay) there too.

How a bucket starts. Buckets hold parameters in reverse registration order (backward produces the
last layers' gradients first), at most ``bucket_bytes`` each, one dtype and device per bucket. A
``register_post_accumulate_grad_hook`` per parameter marks it ready once autograd has accumulated
its gradient for the armed backward (once per backward, however often the parameter was used).
When a bucket's parameters are all ready its gradients are copied into its flat buffer and the
buffer's all-reduce is started - but only in bucket order: bucket k starts once buckets 0..k-1
have, so every rank starts the same collectives in the same order even where gradients arrive in a
different order or never (a parameter a rank did not use this step is only started by ``finish``;
a frozen one, ``requires_grad=False``, counts as ready from ``arm``).
The collectives run on a duplicate of ``comm``, so they cannot be matched against the blocking
ones the layers make on ``comm`` in the middle of backward (BatchNorm statistics).

Gradient accumulation over micro-batches: arm only before the LAST backward of the step (the
pipeline executor calls ``arm`` before its last BACKWARD action); earlier backwards only
accumulate. A gradient that arrives for a bucket already started (two backwards while armed) is
an error, not a silent partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from halo.agree import agree
from halo.transport.base import Reducer, Request
from halo.transport.collectives import ReduceGroup, iallreduce_

__all__ = ["GradientReducer", "GradientReducerError", "DEFAULT_BUCKET_BYTES", "gradient_anywhere",
           "check_same_parameters"]

DEFAULT_BUCKET_BYTES = 4 << 20  # 4 MiB: a few buckets for the default U-Net, latency amortized


def check_same_parameters(params: list[torch.nn.Parameter], comm: Any, what: str) -> None:
    """Raise ValueError on every rank of ``comm`` unless all pass parameters of the same shapes
    and dtypes in the same order: sums of unlike lists would add unrelated numbers, or leave
    the ranks in collectives of different sizes. Collective (one small all-reduce)."""
    layout = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    _, same = agree(comm, False, layout)
    if not same:
        raise ValueError(f"{what}: the ranks that sum these gradients pass different parameters "
                         f"(this rank: {len(params)} tensors of "
                         f"{sum(p.numel() for p in params)} elements); every rank must pass the "
                         f"same model's parameters, in the same order")


def gradient_anywhere(params: list[torch.nn.Parameter], comm: Any) -> Iterator[bool]:
    """For each of ``params``, whether it takes the summed gradient: it requires one and some
    rank of ``comm`` has one (a host all-reduce of flags: nothing is read from a device).
    Collective."""
    from mpi4py import MPI

    had = np.array([p.grad is not None for p in params], np.uint8)
    comm.Allreduce(MPI.IN_PLACE, had, op=MPI.MAX)
    return (bool(h) and p.requires_grad for h, p in zip(had, params))


class GradientReducerError(RuntimeError):
    """The reducer was driven in an order that would reduce a partial gradient."""


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)  # indices into params
    request: Optional[Request] = None


class GradientReducer:
    """Sums the gradients of ``params`` over ``comm`` in buckets of at most ``bucket_bytes``
    (a parameter larger than that gets a bucket of its own); see the module docstring.
    ``comm``: an mpi4py communicator (None or one rank: nothing to do, no hooks). ``reducer``:
    makes the :class:`~halo.transport.base.Reducer` of device buckets from the duplicated
    communicator (NCCL, CUDA IPC, or host-staged on a stream; None: MPI through host copies),
    closed by :meth:`close`. Collective over ``comm`` to construct (it duplicates the
    communicator)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], comm: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reducer: Optional[Callable[[Any], Optional[Reducer]]] = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer; got {bucket_bytes!r}")
        unique: dict[int, torch.nn.Parameter] = {}
        for p in params:
            unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.bucket_bytes = bucket_bytes
        self.active = comm is not None and comm.Get_size() > 1
        self.comm = comm.Dup() if self.active else None
        self.group = ReduceGroup(self.comm, reducer(self.comm) if self.active and reducer
                                 else None)
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        self._hooks: list[Any] = []
        self._armed = False
        self._next = 0  # the first bucket not started yet
        self.closed = False
        if self.active:
            check_same_parameters(self.params, self.comm, "GradientReducer")
            self._build()

    def _build(self) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[list[torch.nn.Parameter]]] = {}
        for p in reversed(self.params):
            runs = groups.setdefault((p.dtype, p.device), [[]])
            cur = runs[-1]
            used = sum(q.numel() for q in cur) * p.element_size()
            if cur and used + p.numel() * p.element_size() > self.bucket_bytes:
                runs.append(cur := [])
            cur.append(p)
        for runs in groups.values():
            for ps in runs:
                offsets, n = [], 0
                for p in ps:
                    offsets.append(n)
                    n += p.numel()
                buf = torch.empty(n, dtype=ps[0].dtype, device=ps[0].device)
                self.buckets.append(_Bucket(ps, offsets, buf))
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # --- one step ----------------------------------------------------------------------------
    def arm(self) -> None:
        """The next backward is the step's last: start each bucket as its gradients arrive."""
        self._check_open()
        if self._armed:
            raise GradientReducerError("GradientReducer.arm() called twice without finish(); "
                                       "arm once per step, before the step's last backward")
        self._armed = True
        self._next = 0
        for bucket in self.buckets:
            # A frozen parameter gets no gradient from backward: ready (as it stands) at once.
            bucket.ready = {i for i, p in enumerate(bucket.params) if not p.requires_grad}
            bucket.request = None

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return  # an earlier micro-batch's backward: the gradient is still accumulating
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        if bucket.request is not None:
            raise GradientReducerError(
                f"a gradient of parameter {i} of bucket {b} (shape {tuple(p.shape)}) arrived after "
                f"its bucket's all-reduce started: more than one backward ran after "
                f"GradientReducer.arm(); call arm() only before the step's last backward")
        bucket.ready.add(i)
        if self._next > 0:
            # Open MPI moves a started collective only inside MPI calls: poke it from backward.
            self.buckets[self._next - 1].request.test()  # type: ignore[union-attr]
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._start(self._next)

    def _start(self, b: int) -> None:
        """Copy bucket ``b``'s gradients (zeros for none) into its buffer, start its all-reduce."""
        bucket = self.buckets[b]
        with torch.no_grad():
            for p, off in zip(bucket.params, bucket.offsets):
                part = bucket.buffer[off:off + p.numel()]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(p.grad.reshape(-1))
        bucket.request = iallreduce_(bucket.buffer, self.group)
        self._next = b + 1

    def finish(self) -> None:
        """Start the buckets not started yet, wait for all, and set every ``p.grad`` to its sum.
        Without a preceding :meth:`arm` this reduces everything now (the one-shot path)."""
        self._check_open()
        if not self.active:
            self._armed = False
            return
        if not self._armed:
            self.arm()
        while self._next < len(self.buckets):
            self._start(self._next)
        # After every bucket's start, so that every rank makes the collectives in one order.
        had = gradient_anywhere([p for b in self.buckets for p in b.params], self.comm)
        for bucket in self.buckets:
            assert bucket.request is not None  # every bucket was started just above
            bucket.request.wait()
            for p, off in zip(bucket.params, bucket.offsets):
                if next(had):
                    # A fresh tensor per parameter, as allreduce_gradients gives: the buffer is
                    # reused by the next step, and an optimizer may keep a reference to p.grad.
                    p.grad = bucket.buffer[off:off + p.numel()].view_as(p).clone()
        self._armed = False

    def _check_open(self) -> None:
        if self.closed:  # inactive after close: it would leave every gradient unsummed
            raise GradientReducerError("GradientReducer used after close(); make a new one")

    def close(self) -> None:
        """Remove the hooks, close the reducer and free the duplicated communicator
        (collective); closing again does nothing."""
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.comm is not None:
            if self.group.reducer is not None:
                self.group.reducer.close()
            self.group = ReduceGroup(None)  # its reducer may hold the communicator
            self.comm.Free()
            self.comm = None
            self.active = False

    def __repr__(self) -> str:
        sizes = [b.buffer.numel() * b.buffer.element_size() for b in self.buckets]
        return (f"GradientReducer({len(self.params)} parameters, {len(self.buckets)} buckets of "
                f"{sizes} bytes, limit {self.bucket_bytes})")
