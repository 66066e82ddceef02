"""All-reduce of device tensors through CUDA IPC: every rank's tensor to every other, summed alike.

    reducer = IPCReducer(comm, CudaDevice())   # comm: ranks of ONE node; collective
    req = reducer.iallreduce_(stats)           # returns at once
    ...                                        # enqueue more work on the compute stream
    req.wait()                                 # the compute stream now waits for the sum

One :class:`~halo.transport.ipc.IPCTransport` exchange per all-reduce sends ``t`` to every other
rank of the communicator and receives theirs; then each rank reduces the ``n`` tensors in rank
order with the same kernel on its compute stream, so every rank holds the same result, bit for
bit (gradients of replicas stay equal). Started all-reduces match in start order, as MPI's do;
a start never waits for the peers'. Neither the host nor MPI ever touch the values: the hosts
trade only the exchange's control messages, and no host waits for its device, where the
host-staged :class:`~halo.transport.staged_reduce.StagedReducer` waits for each device-to-host
copy before MPI may read it (a BatchNorm layer's statistics, forward and backward, are two such
waits per layer). Each rank moves ``(n - 1) * t.nbytes`` each way, as a ring all-reduce would at
two ranks and more than it at many; the ranks of one node are few, and the reductions this serves
(BatchNorm statistics, loss counts, gradient buckets) small next to the convolutions.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from halo.transport.base import CompletedRequest, Reducer, Request
from halo.transport.ipc import IPCTransport
from halo.transport.ipc_memory import IPCMemory
from halo.transport.streams import Device

__all__ = ["IPCReducer"]


def _combine(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """``op`` over ``parts`` (one tensor per rank, in rank order); a sum of booleans is their
    "or", as MPI's sum of 0/1 values narrowed back to bool (integer sums come back as int64)."""
    stacked = torch.stack(parts)
    if op == "sum":
        return stacked.any(0) if stacked.dtype == torch.bool else stacked.sum(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


class _IPCReduction(Request):
    def __init__(self, owner: "IPCReducer", exchange: Request, t: torch.Tensor,
                 parts: list[torch.Tensor], op: str) -> None:
        self._owner, self._exchange, self._t, self._parts, self._op = owner, exchange, t, parts, op
        self._done = False

    def test(self) -> bool:
        if not self._done and self._exchange.test():
            self._finish()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._exchange.wait()
            self._finish()

    def _finish(self) -> None:
        t, parts, op = self._t, self._parts, self._op
        # On the compute stream, which the exchange made wait for the copies out.
        self._owner.device.compute.launch(lambda: t.copy_(_combine(parts, op)))
        self._parts = []
        self._done = True


class IPCReducer(Reducer):
    """All-reduce of ``device``'s tensors over the ranks of ``comm`` (one node) through CUDA IPC;
    see the module docstring. Collective to construct (its transport duplicates ``comm``, so its
    messages stay apart from any other on ``comm``). ``memory``: as :class:`IPCTransport`'s."""

    def __init__(self, comm: Any, device: Device, memory: Optional[IPCMemory] = None) -> None:
        self.comm, self.device = comm, device
        self.transport = IPCTransport(comm, device, memory)

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Request:
        self._check(t, op)
        n, me = self.comm.Get_size(), self.comm.Get_rank()
        if n == 1:
            return CompletedRequest()
        parts = [t if r == me else torch.empty_like(t) for r in range(n)]
        others = [r for r in range(n) if r != me]
        exchange = self.transport.start([(r, t) for r in others], [(r, parts[r]) for r in others],
                                        tag=0)  # all-reduces match in start order, as MPI's do
        return _IPCReduction(self, exchange, t, parts, op)

    def close(self) -> None:
        self.transport.close()
