"""ShardedBatches: deterministic order, exact resume, replicas that partition each global batch."""

from __future__ import annotations

import pytest
import torch

from sparsepipe_hpc.data import ShardedBatches

torch.set_num_threads(1)


def run(sampler, epochs):
    """Every (epoch, step, indices) a training loop sees, until ``epochs`` are done."""
    seen = []
    while sampler.epoch < epochs:
        e = sampler.epoch
        for idx in sampler:
            seen.append((e, idx))
    return seen


def test_deterministic_and_epochs_differ():
    a = run(ShardedBatches(50, 8, seed=3), 3)
    b = run(ShardedBatches(50, 8, seed=3), 3)
    assert a == b
    assert len(a) == 3 * 6  # 50 // 8 steps; the ragged tail of 2 is dropped
    epochs = [sorted(i for e, idx in a if e == ep for i in idx) for ep in range(3)]
    assert all(len(set(x)) == 48 for x in epochs)  # no sample twice within an epoch
    orders = [[i for e, idx in a if e == ep for i in idx] for ep in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert run(ShardedBatches(50, 8, seed=4), 1) != a[:6]


def test_order_depends_only_on_seed_and_epoch():
    s = ShardedBatches(20, 4, seed=1)
    assert s.order(5).equal(ShardedBatches(20, 4, seed=1, epoch=2).order(5))
    assert sorted(s.order(0).tolist()) == list(range(20))
    assert ShardedBatches(20, 4, shuffle=False).order(3).tolist() == list(range(20))


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_replicas_partition_the_global_batch(replicas):
    batch = 10
    single = run(ShardedBatches(43, batch, seed=9), 2)
    shards = [run(ShardedBatches(43, batch, replicas=replicas, rank=r, seed=9), 2)
              for r in range(replicas)]
    assert all(len(s) == len(single) for s in shards)
    for step, (epoch, whole) in enumerate(single):
        parts = [s[step][1] for s in shards]
        assert all(s[step][0] == epoch for s in shards)
        assert [i for p in parts for i in p] == whole  # contiguous, in replica order
        assert sum(map(len, parts)) == len(set(i for p in parts for i in p))  # disjoint
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("stop_after", [0, 1, 4, 5, 6, 11])
def test_resume_sees_exactly_the_remaining_samples(stop_after):
    full = run(ShardedBatches(40, 6, replicas=2, rank=1, seed=2), 3)
    s = ShardedBatches(40, 6, replicas=2, rank=1, seed=2)
    seen, state = [], None
    while s.epoch < 3 and len(seen) < stop_after:
        e = s.epoch
        for idx in s:
            seen.append((e, idx))
            state = dict(s.state_dict())  # checkpoint after the step
            if len(seen) == stop_after:
                break
    resumed = ShardedBatches(40, 6, replicas=2, rank=1, seed=2)
    if state is not None:
        resumed.load_state_dict(state)
    assert seen + run(resumed, 3) == full


def test_state_after_last_step_names_next_epoch():
    s = ShardedBatches(12, 4, seed=0)
    it = iter(s)
    for _ in range(3):
        next(it)
    assert s.state_dict() == {"epoch": 1, "step_in_epoch": 0, "micro_batches": 1}
    assert len(s) == 3 and s.steps_per_epoch == 3


def test_len_counts_remaining_steps():
    s = ShardedBatches(30, 4, seed=0)
    s.load_state_dict({"epoch": 2, "step_in_epoch": 5})
    assert len(s) == 2 and len(list(s)) == 2 and s.epoch == 3


def test_no_drop_last_keeps_every_sample():
    shards = [run(ShardedBatches(10, 4, replicas=3, rank=r, shuffle=False, drop_last=False), 1)
              for r in range(3)]
    assert [idx for _, idx in shards[0]] == [[0, 1], [4, 5], [8]]
    assert [idx for _, idx in shards[2]] == [[3], [7], []]  # an empty shard still steps
    assert sorted(i for s in shards for _, idx in s for i in idx) == list(range(10))


def test_errors_name_values():
    with pytest.raises(ValueError, match="smaller than the global batch 8"):
        ShardedBatches(5, 8)
    with pytest.raises(ValueError, match="smaller than replicas 4"):
        ShardedBatches(50, 3, replicas=4, rank=0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ShardedBatches(50, 4, replicas=2, rank=2)
    with pytest.raises(ValueError, match="seed and epoch must be >= 0; got seed -1"):
        ShardedBatches(50, 4, seed=-1)
    s = ShardedBatches(50, 8)
    with pytest.raises(KeyError, match="step_in_epoch"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="out of range"):
        s.load_state_dict({"epoch": 0, "step_in_epoch": 7})


@pytest.mark.parametrize("replicas", [1, 3])
def test_peek_names_the_step_iteration_yields_next(replicas):
    """Across epoch ends, and after a resume mid-epoch: what the prefetcher reads ahead."""
    for rank in range(replicas):
        s = ShardedBatches(10, 3, replicas=replicas, rank=rank, seed=4)
        for _ in range(3):  # three epochs of 3 steps: peek before every step
            for _ in range(len(s)):
                expected = s.peek()
                assert (next(iter(s)), s.epoch) == expected  # iter() resumes where it stopped
        resumed = ShardedBatches(10, 3, replicas=replicas, rank=rank, seed=4)
        resumed.load_state_dict({"epoch": 1, "step_in_epoch": 2})
        assert resumed.peek() == (next(iter(resumed)), 1)
        assert resumed.peek() == (resumed.shard(resumed.global_batch(2, 0)), 2)


@pytest.mark.parametrize("batch_len, replicas, m", [(6, 2, 2), (10, 3, 3), (7, 3, 1), (16, 4, 3),
                                                     (9, 2, 4), (4, 4, 1)])
def test_replicas_share_every_global_micro_batch(batch_len, replicas, m):
    from sparsepipe_hpc.data.sharding import local_micro_bounds, replica_micro_bounds
    from sparsepipe_hpc.pipeline.executor import sample_bounds
    parts = replica_micro_bounds(batch_len, replicas, m)
    # Together, the replicas' micro-batch i is one process's micro-batch i, in replica order.
    for i, (lo, hi) in enumerate(sample_bounds(batch_len, m)):
        assert parts[0][i][0] == lo
        assert all(parts[r][i][1] == parts[r + 1][i][0] for r in range(replicas - 1))
        assert parts[-1][i][1] == hi
    sizes = [sum(b - a for a, b in p) for p in parts]
    assert sum(sizes) == batch_len and max(sizes) - min(sizes) <= 1
    if m == 1:  # the contiguous shards of one micro-batch
        q, rem = divmod(batch_len, replicas)
        assert sizes == [q + (r < rem) for r in range(replicas)]
    for r in range(replicas):
        shard = ShardedBatches(100, batch_len, replicas=replicas, rank=r, shuffle=False,
                               micro_batches=m).shard(list(range(batch_len)))
        local = local_micro_bounds(batch_len, replicas, r, m)
        assert [shard[a:b] for a, b in local] == [list(range(a, b)) for a, b in parts[r]]


def test_a_state_dealt_for_other_micro_batches_is_refused_with_replicas():
    two = ShardedBatches(20, 4, replicas=2, rank=0, micro_batches=2)
    assert two.state_dict()["micro_batches"] == 2
    two.load_state_dict(two.state_dict())
    with pytest.raises(ValueError, match="dealt the replicas' samples for one micro-batch but "
                                         "this run has 2 replicas and 2"):
        two.load_state_dict({"epoch": 0, "step_in_epoch": 1})  # saved before the field existed
    with pytest.raises(ValueError, match="for 1 micro-batches"):
        two.load_state_dict({"epoch": 0, "step_in_epoch": 1, "micro_batches": 1})
    one = ShardedBatches(20, 4, replicas=1, micro_batches=2)   # one replica: dealt alike
    one.load_state_dict({"epoch": 0, "step_in_epoch": 1})
