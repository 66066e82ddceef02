"""The planner benchmark's reading of a plan's inputs (no MPI): what its busiest rank holds."""

from __future__ import annotations

import torch

from sparsepipe_hpc.bench.planner import BATCH, _inputs


def test_inputs_follow_the_trainers_shards_of_each_micro_batch():
    # Samples 0..3 of 1, 2, 3 and 10 voxels, in a row along x.
    sizes = [1, 2, 3, 10]
    assert len(sizes) == BATCH
    coords = torch.tensor([[b, x, 0, 0] for b, n in enumerate(sizes) for x in range(n)])
    shape = (16, 4, 4)
    # 2 replicas x 2 micro-batches: replica 0 holds samples 0 and 2, replica 1 samples 1 and 3
    # (its shard of each global micro-batch [0, 1] and [2, 3]): 13 voxels over 2 samples.
    assert _inputs(coords, shape, (2, 2, (1, 1, 1), 2), 1) == (6.0, 1.0)
    # One micro-batch: contiguous shards, samples 2 and 3 on replica 1.
    assert _inputs(coords, shape, (2, 1, (1, 1, 1), 1), 1) == (6.5, 1.0)
    assert _inputs(coords, shape, (1, 1, (1, 1, 1), 1), 1) == (4.0, 1.0)
