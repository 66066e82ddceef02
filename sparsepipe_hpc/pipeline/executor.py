"""The engine that runs one stage's program of a pipeline Schedule on real tensors.

    plan = plan_carry([b.carry_arity for b in model.blocks], balance)
    sched = make_schedule("1f1b", stages=len(balance), micro_batches=m, skips=plan.skips)
    a, b = plan.stages[stage].blocks
    ex = StageExecutor(model.blocks[a:b], plan, sched, stage, StageLink(MPITransport(comm)),
                       peer_rank=lambda s: layout.rank_of(replica, s, spatial))
    shares = ex.run(inputs, contexts, loss_fn, step=lambda: (ctx.allreduce_gradients(blocks),
                                                             opt.step()))

Contract of :meth:`StageExecutor.run` on the ranks of stage ``stage``:

* ``inputs[i]``: micro-batch i's input SparseTensor on stage 0 (this rank's voxels, context
  attached); ignored on the other stages (pass None).
* ``contexts[i]``: the context attached to the tensors this rank receives for micro-batch i (the
  stage's ParallelContext, bound to micro-batch i's spatial domain under spatial parallelism, or
  None for a single process). Every stage decomposes a micro-batch with the same cuts, so rank i
  of stage s and rank i of stage s+1 own the same box and activations never re-partition.
* ``loss_fn(i, output)`` (last stage): micro-batch i's loss *share*, a scalar; shares sum over
  micro-batches, replicas and spatial ranks to the single-process loss of the global batch
  (seg: summed cross-entropy / voxels of the global batch). Returned detached, one per
  micro-batch (an empty list on the other stages).
* Parameter gradients *accumulate* into ``.grad`` over the micro-batches (zero them before);
  ``step()`` runs at the schedule's STEP, after every send has completed: the caller's gradient
  all-reduce over the stage's ranks (ParallelContext.allreduce_gradients, or a GradientReducer
  armed by ``last_backward`` and finished here) and optimizer step.

Actions: RECV_ACT waits for a carry (its header receive was posted when ``run`` started), FORWARD
runs the stage's blocks on the carry entries it pops (stage 0: the micro-batch input) and keeps
the autograd graph, SEND_ACT starts a non-blocking send and posts the gradient receives,
RECV_GRAD waits for them, BACKWARD runs autograd from the received output gradients (last stage:
from the loss share) and frees the micro-batch, SEND_GRAD sends the input gradients back.

Stage traffic: every message this rank sends or receives in a run is a :class:`Transfer` in
``executor.transfers`` (summed by ``executor.traffic()``), its payload bytes and carry slots also
in the args of the action's trace span. A U-Net skip is sent once, from the stage that makes it
straight to the stage that uses it, so its bytes count once, on that edge.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from sparsepipe_hpc.pipeline.carry import INPUT, CarryPlan, PipelineError
from sparsepipe_hpc.pipeline.p2p import PendingCarry, PendingGrads, StageLink
from sparsepipe_hpc.pipeline.schedule import Action, Op, Schedule
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.tracing import span

__all__ = ["StageExecutor", "Transfer", "payload_bytes", "sample_bounds", "split_batch"]


def sample_bounds(batch_size: int, micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous sample ranges [lo, hi) of the micro-batches, sizes differing by at most one."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PipelineError(f"micro-batches must be a positive integer; got {micro_batches!r}")
    if micro_batches > batch_size:
        raise PipelineError(f"{micro_batches} micro-batches need at least {micro_batches} samples "
                            f"per replica but the batch has {batch_size}; micro-batches are whole "
                            f"samples: pass --micro-batches <= {batch_size}")
    q, r = divmod(batch_size, micro_batches)
    bounds, lo = [], 0
    for k in range(micro_batches):
        hi = lo + q + (1 if k < r else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def split_batch(x: SparseTensor, micro_batches: int, *payloads: torch.Tensor,
                bounds: Optional[Sequence[tuple[int, int]]] = None) -> list[tuple[Any, ...]]:
    """Split a batch into micro-batches of whole samples, batch indices renumbered from 0.

    Returns, per micro-batch, ``(x_i, *payloads_i)``: the rows of samples [lo, hi) in their
    original order; per-voxel payloads ``[N, ...]`` (labels) follow their rows. ``bounds``: the
    ``[lo, hi)`` sample ranges, ``micro_batches`` of them covering the batch in order (default
    :func:`sample_bounds`; a replica's come from
    :func:`sparsepipe_hpc.data.sharding.local_micro_bounds`). No context or kernel maps are
    carried over (attach them afterwards, e.g. with ParallelContext.distribute).
    """
    if bounds is None:
        bounds = sample_bounds(x.batch_size, micro_batches)
    elif len(bounds) != micro_batches or [lo for lo, _ in bounds] != \
            [0, *(hi for _, hi in bounds[:-1])] or bounds[-1][1] != x.batch_size \
            or any(hi <= lo for lo, hi in bounds):
        raise PipelineError(f"micro-batch bounds {list(bounds)} must be {micro_batches} "
                            f"non-empty ranges covering the batch's {x.batch_size} samples "
                            f"in order")
    out = []
    b = x.coords[:, 0]
    for lo, hi in bounds:
        rows = (b >= lo) & (b < hi)
        coords = x.coords[rows].clone()
        coords[:, 0] -= lo
        xi = SparseTensor(coords, x.feats[rows], x.spatial_shape, hi - lo, x.stride)
        out.append((xi, *(p[rows] for p in payloads)))
    return out


# Trace categories of the actions (sparsepipe_hpc.tracing; render.py uses the same for simulations).
_CATEGORY = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.SEND_ACT: "send",
             Op.SEND_GRAD: "send", Op.RECV_ACT: "recv", Op.RECV_GRAD: "recv", Op.STEP: "step"}


def _mb_peer(act: Action) -> tuple[int, int]:
    """(micro-batch, peer stage) of an action; -1 for a compute action's missing peer."""
    return (act.micro_batch if act.micro_batch is not None else -1,
            act.peer if act.peer is not None else -1)


def _feats(e: Any) -> torch.Tensor:
    return e.feats if isinstance(e, SparseTensor) else e


def payload_bytes(entries: Sequence[Any]) -> int:
    """Bytes a stage message carries for ``entries`` (the fixed-size header not included):
    coords and feats of a SparseTensor, a dense tensor's elements; None (no gradient): 0."""
    total = 0
    for e in entries:
        for t in ((e.coords, e.feats) if isinstance(e, SparseTensor)
                  else (e,) if isinstance(e, torch.Tensor) else ()):
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class Transfer:
    """One stage message this rank sent or received: ``direction`` "send"/"recv", ``kind``
    "act" (a carry) or "grad" (its gradients), the micro-batch, the other stage, the carry slots
    it holds (:class:`~sparsepipe_hpc.pipeline.carry.Slot` ids) and its payload bytes."""

    direction: str
    kind: str
    micro_batch: int
    peer: int
    slots: tuple[int, ...]
    bytes: int


class StageExecutor:
    """Runs ``schedule.actions[stage]`` over ``blocks`` (see the module docstring)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], plan: CarryPlan, schedule: Schedule,
                 stage: int, link: StageLink, peer_rank: Callable[[int], int],
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext):
        if schedule.stages != len(plan.stages):
            raise PipelineError(f"the schedule has {schedule.stages} stages but the partition "
                                f"{len(plan.stages)}")
        want = tuple(sorted({(s, s + 1) for s in range(schedule.stages - 1)} | set(plan.skips)))
        if schedule.edges != want:
            raise PipelineError(f"the schedule's edges {schedule.edges} are not the model's "
                                f"{want}; build it with make_schedule(..., skips=plan.skips)")
        self.blocks = list(blocks)
        self.plan = plan.stages[stage]
        a, b = self.plan.blocks
        if len(self.blocks) != b - a:
            raise PipelineError(f"stage {stage} runs blocks {a}..{b - 1} ({b - a}) but was given "
                                f"{len(self.blocks)}")
        self.schedule, self.stage, self.link, self.peer_rank = schedule, stage, link, peer_rank
        self.last = stage == schedule.stages - 1
        self.autocast = autocast  # around every FORWARD (its blocks and the loss): mixed precision
        self.transfers: list[Transfer] = []  # the last run's stage messages, in program order

    def traffic(self) -> dict[str, dict[str, int]]:
        """The last run's stage traffic: ``{"send act -> 2": {"messages": 4, "bytes": ...},
        ...}`` keyed by direction, kind and the other stage. A skip counts once, on the edge
        from the stage that makes it to the stage that uses it (it is never relayed)."""
        out: dict[str, dict[str, int]] = {}
        for t in self.transfers:
            key = f"{t.direction} {t.kind} {'->' if t.direction == 'send' else '<-'} {t.peer}"
            row = out.setdefault(key, {"messages": 0, "bytes": 0})
            row["messages"] += 1
            row["bytes"] += t.bytes
        return out

    def _count(self, info: dict[str, Any], direction: str, kind: str, i: int, peer: int,
               slots: Sequence[Any], entries: Sequence[Any]) -> None:
        t = Transfer(direction, kind, i, peer, tuple(s.id for s in slots), payload_bytes(entries))
        self.transfers.append(t)
        info.update(bytes=t.bytes, slots=list(t.slots))  # shows in the trace's args

    def run(self, inputs: Sequence[Optional[SparseTensor]], contexts: Sequence[Any],
            loss_fn: Optional[Callable[[int, Any], torch.Tensor]] = None,
            step: Optional[Callable[[], None]] = None,
            backward: bool = True,
            last_backward: Optional[Callable[[], None]] = None,
            scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
            ) -> list[torch.Tensor]:
        """Run the stage's program once (one mini-batch); see the module docstring.

        ``last_backward``: called just before the program's last BACKWARD action, the one after
        which the parameter gradients are final (``GradientReducer.arm``: buckets start their
        all-reduce during that backward, ``step`` finishes them).

        ``scale_loss`` (last stage): what autograd starts from instead of a share, e.g. fp16's
        ``GradScaler.scale``; the gradients sent back are then scaled as well (``step`` unscales
        them on every stage). The shares returned stay unscaled.

        ``backward=False`` (evaluation): only the forward actions and their transfers run, under
        ``torch.no_grad()``; nothing steps. ``loss_fn`` may then return any tensor (a loss, the
        predictions): its results come back, one per micro-batch, on the last stage.
        """
        m = self.schedule.micro_batches
        if len(contexts) != m or (self.stage == 0 and len(inputs) != m):
            raise PipelineError(f"the schedule has {m} micro-batches but run() got "
                                f"{len(inputs)} inputs and {len(contexts)} contexts")
        if self.last and loss_fn is None:
            raise PipelineError("the last stage needs a loss_fn")
        link, plan = self.link, self.plan
        actions = self.schedule.actions[self.stage]
        # Receives posted ahead: every carry header of the mini-batch, at once.
        carries: dict[tuple[int, int], PendingCarry] = {}
        for a in actions:
            if a.op is Op.RECV_ACT:
                i, peer = _mb_peer(a)
                carries[(i, peer)] = link.post_carry(self.peer_rank(peer), i)
        received: dict[int, dict[int, Any]] = {i: {} for i in range(m)}
        kmaps: dict[int, dict] = {i: {} for i in range(m)}
        outputs: dict[int, dict[int, Any]] = {}
        out_grads: dict[int, dict[int, Optional[torch.Tensor]]] = {i: {} for i in range(m)}
        grad_recvs: dict[tuple[int, int], PendingGrads] = {}
        in_grads: dict[int, dict[int, Optional[torch.Tensor]]] = {}
        losses: dict[int, torch.Tensor] = {}
        sends: list[Any] = []
        if not backward:
            actions = tuple(a for a in actions
                            if a.op in (Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT))
        self.transfers = []
        last_bwd = max((k for k, a in enumerate(actions) if a.op is Op.BACKWARD), default=-1)
        for k, act in enumerate(actions):
            with span(str(act), _CATEGORY[act.op], micro_batch=act.micro_batch,
                      peer=act.peer) as info:
                if act.op is Op.STEP:
                    with span("wait sends", "idle"):
                        for r in sends:
                            r.wait()
                    sends.clear()
                    if step is not None:
                        step()
                    continue
                i, peer = _mb_peer(act)
                if act.op is Op.RECV_ACT:
                    got = link.finish_carry(carries.pop((i, peer)), contexts[i], kmaps[i])
                    slots = plan.recv_slots(peer)
                    if len(got) != len(slots):
                        raise PipelineError(f"stage {self.stage} expected {len(slots)} carry "
                                            f"entries from stage {peer}, got {len(got)}")
                    received[i].update(zip((s.id for s in slots), got))
                    self._count(info, "recv", "act", i, peer, slots, got)
                elif act.op is Op.FORWARD:
                    carry = [inputs[i] if s.producer == INPUT else received[i][s.id]
                             for s in plan.inputs]
                    with torch.set_grad_enabled(backward), self.autocast():
                        for block in self.blocks:
                            carry = block(carry)
                            # Hand on the sends held back so far whose receivers are ready now
                            # (IPC: their "ready"; staged: their copy), not a block later.
                            link.transport.progress()
                        if len(carry) != len(plan.outputs):
                            raise PipelineError(f"stage {self.stage}'s blocks left {len(carry)} "
                                                f"carry entries but their carry_arity says "
                                                f"{len(plan.outputs)}")
                        outputs[i] = dict(zip((s.id for s in plan.outputs), carry))
                        if self.last:
                            losses[i] = loss_fn(i, carry[-1])  # type: ignore[misc]
                elif act.op is Op.SEND_ACT:
                    out_slots = plan.send_slots(peer)
                    ents = [outputs[i][s.id] for s in out_slots]
                    rank = self.peer_rank(peer)
                    sends += link.send_carry(rank, i, ents)
                    self._count(info, "send", "act", i, peer, out_slots, ents)
                    if backward:
                        grad_recvs[(i, peer)] = link.post_grads(rank, i, ents)
                elif act.op is Op.RECV_GRAD:
                    got_g = link.finish_grads(grad_recvs.pop((i, peer)))
                    out_slots = plan.send_slots(peer)
                    out_grads[i].update(zip((s.id for s in out_slots), got_g))
                    self._count(info, "recv", "grad", i, peer, out_slots, got_g)
                elif act.op is Op.BACKWARD:
                    if k == last_bwd and last_backward is not None:
                        last_backward()
                    loss = losses.get(i)
                    if loss is not None and scale_loss is not None:
                        loss = scale_loss(loss)
                    in_grads[i] = self._backward(i, outputs.pop(i), out_grads.pop(i),
                                                 received.pop(i), loss)
                    kmaps.pop(i)
                elif act.op is Op.SEND_GRAD:
                    in_slots = plan.recv_slots(peer)
                    grads = [in_grads[i].pop(s.id) for s in in_slots]
                    sends += link.send_grads(self.peer_rank(peer), i, grads)
                    self._count(info, "send", "grad", i, peer, in_slots, grads)
        if not backward:
            for r in sends:
                r.wait()
        return [losses[i].detach() for i in range(m)] if self.last else []

    def _backward(self, i: int, outs: dict[int, Any], grads: dict[int, Optional[torch.Tensor]],
                  recv: dict[int, Any], loss: Optional[torch.Tensor]) -> dict[int, Any]:
        """Autograd from this stage's outputs; returns the gradients of its received entries
        (None where the producer needs none, zeros where nothing here reached the entry)."""
        roots, seeds = [], []
        if loss is not None:
            roots.append(loss)
            seeds.append(torch.ones_like(loss))
        for slot_id, g in grads.items():
            if g is not None:
                roots.append(_feats(outs[slot_id]))
                seeds.append(g)
        live = [(r, s) for r, s in zip(roots, seeds) if r.requires_grad]
        if live:
            torch.autograd.backward([r for r, _ in live], [s for _, s in live])
        result: dict[int, Any] = {}
        for slot_id, e in recv.items():
            f = _feats(e)
            if not f.requires_grad:
                result[slot_id] = None
            else:
                result[slot_id] = f.grad if f.grad is not None else torch.zeros_like(f)
        return result
