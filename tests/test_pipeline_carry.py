"""The pure parts of the pipeline engine: carry plans, balances and micro-batch splits."""

from __future__ import annotations

import pytest
import torch

from sparsepipe_hpc.nn import SparseResNet, SparseUNet
from sparsepipe_hpc.pipeline.carry import INPUT, PipelineError, parse_balance, plan_carry
from sparsepipe_hpc.pipeline.executor import sample_bounds, split_batch
from sparsepipe_hpc.sparse import SparseTensor


def arities(model):
    return [b.carry_arity for b in model.blocks]


def test_unet_skips_go_straight_to_their_decoder_stage():
    net = SparseUNet(3, 4, width=4, depth=2)  # stem down1 down2 up2 up1 head
    plan = plan_carry(arities(net), [2, 2, 2])
    assert plan.skips == ((0, 2),)
    s0, s1, s2 = plan.stages
    assert [s.producer for s in s0.inputs] == [INPUT]
    assert [s.consumer for s in s0.outputs] == [2, 1]  # stem output kept as down1's skip
    assert [s.producer for s in s2.inputs] == [0, 1]   # the skip is not relayed through stage 1
    assert s2.outputs[0].consumer is None
    assert s1.recv_slots(0) == s1.inputs and s0.send_slots(2) == s0.outputs[:1]


def test_every_slot_has_one_producer_and_one_consumer():
    net = SparseUNet(3, 4, width=4, depth=3)
    n = len(net.blocks)
    for cut in range(1, n):
        plan = plan_carry(arities(net), [cut, n - cut])
        sent = {s.id for s in plan.stages[0].outputs}
        got = {s.id for s in plan.stages[1].inputs}
        assert sent == got and plan.skips == ()


def test_resnet_has_no_skips():
    net = SparseResNet(3, 4, width=4, depth=2)
    plan = plan_carry(arities(net), [1, 1, 1, 1])
    assert plan.skips == ()
    assert all(len(s.inputs) == 1 and len(s.outputs) == 1 for s in plan.stages)


@pytest.mark.parametrize("balance, fragment", [
    ("2,3", "sums to 5 but the model has 6 blocks"),
    ("3,0,3", "at least one block"),
    ("3,x", "positive integers"),
])
def test_bad_balance_is_named(balance, fragment):
    with pytest.raises(PipelineError, match=fragment):
        parse_balance(balance, 6)


def test_balance_must_match_stages():
    with pytest.raises(PipelineError, match="names 2 stage"):
        parse_balance("3,3", 6, stages=3)


def test_block_without_arity_is_refused():
    with pytest.raises(PipelineError, match="block 1 has carry_arity None"):
        plan_carry([(1, 1), None], [1, 1])


def test_sample_bounds_and_split():
    assert sample_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(PipelineError, match="micro-batches <= 2"):
        sample_bounds(2, 3)
    coords = torch.tensor([[0, 1, 1, 1], [2, 0, 0, 0], [1, 3, 3, 3], [2, 1, 0, 0]],
                          dtype=torch.int32)
    x = SparseTensor(coords, torch.arange(4.0)[:, None], (4, 4, 4), 3)
    labels = torch.tensor([10, 12, 11, 13])
    parts = split_batch(x, 2, labels)
    assert [p[0].batch_size for p in parts] == [2, 1]
    assert parts[0][0].coords[:, 0].tolist() == [0, 1]
    assert parts[1][0].coords[:, 0].tolist() == [0, 0]
    assert parts[1][1].tolist() == [12, 13]
    assert parts[1][0].feats[:, 0].tolist() == [1.0, 3.0]
