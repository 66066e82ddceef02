"""Deterministic, resumable batch order for data-parallel replicas.

    batches = ShardedBatches(len(ds), batch_size=16, replicas=4, rank=r, seed=0)
    batches.load_state_dict(ckpt["batches"])          # optional: resume mid-epoch
    while batches.epoch < epochs:
        for idx in batches:                           # this replica's 4 sample indices per step
            gens = batches.sample_generators(idx)     # augmentation seeds, one per sample
            ...train on collate([ds[i] for i in idx], ..., augment=True, generator=gens)...
            ckpt["batches"] = batches.state_dict()    # {"epoch": e, "step_in_epoch": k}

Each epoch's order is ``torch.randperm(n)`` from a generator seeded by ``(seed, epoch)`` alone, so
it is the same on every rank and after any restart. Step ``k`` takes the global batch
``perm[k*B : (k+1)*B]``; with one micro-batch (the default) it cuts that into ``replicas``
contiguous shards (the first ``B % replicas`` shards one longer, as ``torch.tensor_split``) and
replica ``r`` gets shard ``r``::

    perm   = [7 2 9 4 0 5 | 8 1 3 6 ...]        B = 6, replicas = 3
    step 0 : r0 [7 2]  r1 [9 4]  r2 [0 5]
    step 1 : r0 [8 1]  r1 [3 6]  ...

With ``micro_batches=M`` (a pipeline's, or gradient accumulation's, micro-batches) the step's
global batch is first cut into ``M`` contiguous global micro-batches, as one process cuts it, and
each of those into ``replicas`` shards: replica ``r``'s micro-batch ``i`` is its shard of global
micro-batch ``i``, so the ranks that normalize micro-batch ``i`` together (BatchNorm over the
replicas) see exactly one process's micro-batch ``i`` (:func:`replica_micro_bounds`). A
micro-batch's remainder samples go to the replicas in turn, so replica batches differ by at most
one sample::

    perm   = [7 2 9 4 0 5 | ...]                B = 6, replicas = 2, M = 2
    global micro-batches [7 2 9] [4 0 5]
    step 0 : r0 [7 2 | 4]  r1 [9 | 0 5]         (micro-batch sizes r0: 2, 1; r1: 1, 2)

The ragged tail (``n % B`` samples) is dropped with ``drop_last=True`` (training: every step then
has the same global batch, which keeps the loss scale fixed; a different tail is dropped each
epoch). With ``drop_last=False`` (evaluation) the last step is short and a replica may get an
empty list, which it must still step through so that collectives stay matched.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

__all__ = ["ShardedBatches", "replica_micro_bounds", "local_micro_bounds"]


def replica_micro_bounds(batch_len: int, replicas: int, micro_batches: int = 1
                         ) -> list[list[tuple[int, int]]]:
    """``[replica][micro-batch] -> (lo, hi)``: the ranges of a global batch of ``batch_len``
    samples each replica takes for each micro-batch (see the module docstring).

    Global micro-batch ``i`` spans one process's ``i``-th contiguous part (sizes differing by at
    most one, the first ones longer); it is cut into ``replicas`` contiguous shards in replica
    order, of sizes differing by at most one, the longer shards going to the replicas in turn
    from where the previous micro-batch's left off. With one micro-batch replica ``r`` gets
    the ``r``-th contiguous shard (the first ``batch_len % replicas`` one longer)."""
    if replicas < 1 or micro_batches < 1:
        raise ValueError(f"need replicas >= 1 and micro_batches >= 1; got {replicas} and "
                         f"{micro_batches}")
    out: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    q, rem = divmod(batch_len, micro_batches)
    lo, turn = 0, 0
    for i in range(micro_batches):
        size = q + (1 if i < rem else 0)
        base, extra = divmod(size, replicas)
        longer = {(turn + j) % replicas for j in range(extra)}
        turn = (turn + extra) % replicas
        for r in range(replicas):
            hi = lo + base + (1 if r in longer else 0)
            out[r].append((lo, hi))
            lo = hi
    return out


def local_micro_bounds(batch_len: int, replicas: int, replica: int, micro_batches: int
                       ) -> list[tuple[int, int]]:
    """Replica ``replica``'s micro-batches as ranges into its own part of the global batch
    (:meth:`ShardedBatches.shard`'s list, its samples renumbered from 0): where a pipeline cuts
    the replica's batch."""
    out, lo = [], 0
    for a, b in replica_micro_bounds(batch_len, replicas, micro_batches)[replica]:
        out.append((lo, lo + b - a))
        lo += b - a
    return out


class ShardedBatches:
    """This replica's sample indices, one list per step; see the module docstring.

    ``state_dict()`` counts the steps handed out so far in the current epoch: save it after the
    step's update, and a run restored from it yields exactly the remaining steps.
    """

    def __init__(self, num_samples: int, batch_size: int, *, replicas: int = 1, rank: int = 0,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 epoch: int = 0, micro_batches: int = 1) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0; got {num_samples}")
        if replicas < 1 or not 0 <= rank < replicas:
            raise ValueError(f"need replicas >= 1 and 0 <= rank < replicas; got rank {rank} of "
                             f"{replicas}")
        if batch_size < replicas:
            raise ValueError(f"global batch_size {batch_size} is smaller than replicas {replicas}: "
                             "some replica would get no sample; use batch_size >= replicas")
        if isinstance(micro_batches, bool) or int(micro_batches) != micro_batches \
                or micro_batches < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1; got {micro_batches!r}")
        if seed < 0 or epoch < 0:  # the generators' seeds (numpy takes no negative entropy)
            raise ValueError(f"seed and epoch must be >= 0; got seed {seed}, epoch {epoch}")
        if drop_last and num_samples < batch_size:
            raise ValueError(f"data set of {num_samples} samples is smaller than the global batch "
                             f"{batch_size}; with drop_last no step would run")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.replicas = int(replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = int(epoch)
        self.micro_batches = int(micro_batches)
        self.step_in_epoch = 0

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """int64 [n]: the global sample order of ``epoch`` (identity without shuffle)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        # SeedSequence mixes (seed, epoch) into well-spread generator states.
        state = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, np.uint64)[0])
        g = torch.Generator().manual_seed(state)
        return torch.randperm(self.num_samples, generator=g)

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """The step's global batch in global order (replicas take their :meth:`shard` of it)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} out of range for {self.steps_per_epoch} steps per epoch")
        return self.order(epoch)[step * self.batch_size:(step + 1) * self.batch_size].tolist()

    def sample_generators(self, indices: Sequence[int], epoch: Optional[int] = None
                          ) -> list[torch.Generator]:
        """One torch generator per sample, seeded by ``(seed, epoch, sample index)`` (``epoch``
        defaults to the current one): augmentation that draws from them is the same whichever
        replica holds the sample and after a resume, with no generator state to checkpoint."""
        e = self.epoch if epoch is None else int(epoch)
        out = []
        for i in indices:
            # The trailing 1 keeps these streams apart from the epoch order's (seed, epoch).
            state = np.random.SeedSequence([self.seed, e, int(i), 1]).generate_state(1, np.uint64)
            out.append(torch.Generator().manual_seed(int(state[0])))
        return out

    def shard(self, batch: list[int]) -> list[int]:
        """This replica's part of a global batch: its shard of each global micro-batch, in
        micro-batch order (:func:`replica_micro_bounds`; one contiguous part for one)."""
        ranges = replica_micro_bounds(len(batch), self.replicas, self.micro_batches)[self.rank]
        return [i for lo, hi in ranges for i in batch[lo:hi]]

    def _normalize(self) -> None:
        if self.step_in_epoch >= self.steps_per_epoch:  # a finished epoch resumes at the next
            self.epoch += 1
            self.step_in_epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining steps of the current epoch; exhausting it moves to the next epoch."""
        self._normalize()
        perm = self.order(self.epoch)
        while self.step_in_epoch < self.steps_per_epoch:
            k = self.step_in_epoch
            batch = perm[k * self.batch_size:(k + 1) * self.batch_size].tolist()
            self.step_in_epoch += 1
            yield self.shard(batch)
        self._normalize()

    def peek(self) -> tuple[list[int], int]:
        """(this replica's indices, epoch) of the step iteration yields next, without taking it:
        the current epoch's next step, or the next epoch's first after its last."""
        epoch, step = self.epoch, self.step_in_epoch
        if step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        return self.shard(self.global_batch(epoch, step)), epoch

    def __len__(self) -> int:
        """Steps the next ``iter()`` yields (fewer than ``steps_per_epoch`` after a resume)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            return self.steps_per_epoch
        return self.steps_per_epoch - self.step_in_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step."""
        self.epoch, self.step_in_epoch = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "step_in_epoch", "micro_batches"}``; after an epoch's last step it
        already names the next epoch's start, so a loop ``while batches.epoch < epochs`` resumes
        without an extra epoch. ``micro_batches``: how the replicas' shards were dealt."""
        if self.step_in_epoch >= self.steps_per_epoch:
            return {"epoch": self.epoch + 1, "step_in_epoch": 0,
                    "micro_batches": self.micro_batches}
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "micro_batches": self.micro_batches}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``. ValueError where its replicas' shards were dealt otherwise:
        another ``micro_batches``, or (a state without one, saved before the shards followed
        the micro-batches) replicas and micro-batches both above one."""
        missing = {"epoch", "step_in_epoch"} - set(state)
        if missing:
            raise KeyError(f"ShardedBatches state lacks {sorted(missing)}; got {dict(state)}")
        dealt = state.get("micro_batches")
        if (dealt is None and self.replicas > 1 and self.micro_batches > 1) or \
                (dealt is not None and int(dealt) != self.micro_batches and self.replicas > 1):
            raise ValueError(f"ShardedBatches state {dict(state)} dealt the replicas' samples for "
                             f"{'one micro-batch' if dealt is None else f'{dealt} micro-batches'}"
                             f" but this run has {self.replicas} replicas and "
                             f"{self.micro_batches}: its steps would take other samples (a "
                             f"state from before the shards followed the micro-batches cannot "
                             f"be continued exactly; start a new run)")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step <= self.steps_per_epoch:
            raise ValueError(f"ShardedBatches state {dict(state)} out of range: need epoch >= 0 "
                             f"and 0 <= step_in_epoch <= {self.steps_per_epoch}")
        self.epoch, self.step_in_epoch = epoch, step
        self._normalize()

    def __repr__(self) -> str:
        return (f"ShardedBatches(n={self.num_samples}, batch={self.batch_size}, replica "
                f"{self.rank}/{self.replicas}, epoch {self.epoch}, step {self.step_in_epoch}/"
                f"{self.steps_per_epoch})")
