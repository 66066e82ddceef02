"""Stage partition of a block sequence, and which stage makes and which uses each carry entry.

    plan = plan_carry([blk.carry_arity for blk in model.blocks], balance=[3, 3, 2])
    plan.stages[1].blocks              # (3, 6): model.blocks[3:6] run on stage 1
    plan.stages[1].inputs              # the carry entries stage 1 receives, bottom to top
    plan.skips                         # ((0, 2),): a U-Net skip from stage 0 to stage 2,
                                       # the edges for make_schedule(skips=...)

A model is a sequence of blocks, each mapping a *carry* (a stack of tensors; the top is the
running activation, the ones below are U-Net skips) to a new carry. Every block declares
``carry_arity = (pops, pushes)``: it removes the top ``pops`` entries and pushes ``pushes`` new
ones, leaving the rest untouched. Replaying the arities on a stack of slot ids, pure and without
tensors, tells for every entry (a *slot*) the stage that pushes it (its producer; -1 for the
model's input) and the stage that pops it (its consumer; None for the model's output).

A stage therefore runs its blocks on the *tail* of the carry it touches: the entries it pops that
were there when it started are its ``inputs`` (each received from its producer, a skip directly
from the stage that made it, never relayed through the stages between); the entries it leaves
above that depth are its ``outputs`` (each sent to its consumer)::

    U-Net depth 2, balance 3,3:   stem down1 down2 | up2 up1 head
    stage 0 inputs [input]         outputs [s1 (skip, -> stage 1), s2 (skip), x]
    stage 1 inputs [s1, s2, x]     outputs [logits]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["PipelineError", "Slot", "StagePlan", "CarryPlan", "plan_carry", "parse_balance"]

INPUT = -1  # the producer of the model's input


class PipelineError(ValueError):
    """A pipeline request (stages, balance, micro-batches) that does not fit the model or batch."""


@dataclass(frozen=True)
class Slot:
    """One carry entry: ``producer`` pushes it (INPUT = -1 for the model's input), ``consumer``
    pops it (None: it is the model's output)."""

    id: int
    producer: int
    consumer: Optional[int]


@dataclass(frozen=True)
class StagePlan:
    """One stage: ``model.blocks[blocks[0]:blocks[1]]`` maps ``inputs`` to ``outputs`` (bottom to
    top, the order of the local carry list)."""

    stage: int
    blocks: tuple[int, int]
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]

    def recv_slots(self, peer: int) -> tuple[Slot, ...]:
        """The input slots stage ``peer`` sends here, in carry order (one message per batch)."""
        return tuple(s for s in self.inputs if s.producer == peer)

    def send_slots(self, peer: int) -> tuple[Slot, ...]:
        """The output slots this stage sends to stage ``peer``, in carry order."""
        return tuple(s for s in self.outputs if s.consumer == peer)


@dataclass(frozen=True)
class CarryPlan:
    stages: tuple[StagePlan, ...]
    skips: tuple[tuple[int, int], ...]  # (producer, consumer) edges beyond the chain s -> s+1


def parse_balance(balance: str | Sequence[int], num_blocks: Optional[int],
                  stages: Optional[int] = None) -> tuple[int, ...]:
    """``"5,4"`` or ``[5, 4]`` -> (5, 4), checked against the model's blocks and ``stages``
    (each where given)."""
    text = balance if isinstance(balance, str) else ",".join(map(str, balance))
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise PipelineError(f"--balance must be positive integers like 5,4 (blocks per stage); "
                            f"got {text!r}") from None
    if min(parts) < 1:
        raise PipelineError(f"--balance {text}: every stage needs at least one block")
    if stages is not None and len(parts) != stages:
        raise PipelineError(f"--balance {text} names {len(parts)} stage(s) but --stages is "
                            f"{stages}; give one block count per stage")
    if num_blocks is not None and sum(parts) != num_blocks:
        raise PipelineError(f"--balance {text} sums to {sum(parts)} but the model has "
                            f"{num_blocks} blocks; pass block counts that sum to {num_blocks}")
    return parts


def plan_carry(arities: Sequence[Optional[tuple[int, int]]],
               balance: Sequence[int]) -> CarryPlan:
    """Replay the blocks' ``(pops, pushes)`` over stages of ``balance`` blocks each (pure)."""
    balance = parse_balance(list(balance), len(arities))
    checked: list[tuple[int, int]] = []
    for k, ar in enumerate(arities):
        if ar is None or len(ar) != 2 or ar[0] < 1 or ar[1] < 1:
            raise PipelineError(f"block {k} has carry_arity {ar!r}; a pipelined block must "
                                f"declare (pops, pushes), both >= 1")
        checked.append((int(ar[0]), int(ar[1])))
    producer: dict[int, int] = {0: INPUT}
    consumer: dict[int, int] = {}
    stack = [0]
    spans: list[tuple[tuple[int, int], list[int], list[int]]] = []
    start = 0
    for s, count in enumerate(balance):
        entry, low = list(stack), len(stack)
        for k in range(start, start + count):
            pops, pushes = checked[k]
            if pops > len(stack):
                raise PipelineError(f"block {k} pops {pops} carry entries but the carry holds "
                                    f"{len(stack)}")
            for sid in stack[len(stack) - pops:]:
                consumer[sid] = s
            del stack[len(stack) - pops:]
            low = min(low, len(stack))
            for _ in range(pushes):
                producer[len(producer)] = s
                stack.append(len(producer) - 1)
        spans.append(((start, start + count), entry[low:], stack[low:]))
        start += count
    if len(stack) != 1:
        raise PipelineError(f"the blocks leave {len(stack)} carry entries; a model must end with "
                            f"exactly one (its output)")

    def slot(i: int) -> Slot:
        return Slot(i, producer[i], consumer.get(i))

    plans = tuple(StagePlan(s, blocks, tuple(map(slot, ins)), tuple(map(slot, outs)))
                  for s, (blocks, ins, outs) in enumerate(spans))
    skips = sorted({(producer[i], c) for i, c in consumer.items()
                    if producer[i] != INPUT and c > producer[i] + 1})
    return CarryPlan(plans, tuple(skips))
