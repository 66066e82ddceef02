"""Profiler: block-by-block backward equals the model's, bytes by hand, fits, JSON round trip."""

from __future__ import annotations

import pytest
import torch

from sparsepipe_hpc.nn import build_model
from sparsepipe_hpc.plan.profile import (Fit, ModelProfile, ProfileError, _run_once, fit_linear,
                                         profile_model, synthetic_batch)
from sparsepipe_hpc.sparse import SparseTensor


def _net(name="unet", width=8, depth=2):
    torch.manual_seed(0)
    return build_model(name, 3, 5, width=width, depth=depth, engine="torch")


@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_cut_after_every_block_gives_the_models_gradients(name):
    net = _net(name)
    x = synthetic_batch(600, 3, batch_size=2, multiple=net.total_stride, seed=1)
    out = net(x.replace(kmaps={}))
    (out.feats if isinstance(out, SparseTensor) else out).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    res = _run_once(list(net.blocks), x, params)
    for (n, p), w in zip(net.named_parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6, msg=n)
    assert len(res["forward"]) == len(net.blocks) and min(res["forward"]) > 0


def test_bytes_by_hand():
    net = _net("unet", width=8, depth=2)
    x = synthetic_batch(600, 3, multiple=net.total_stride)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    res = _run_once(list(net.blocks), x, params)
    # Replay the carry: the bytes after each block are every entry alive there (skips included).
    carry = [x.replace(kmaps={})]
    with torch.no_grad():
        for k, blk in enumerate(net.blocks):
            carry = blk(carry)
            nbytes = sum(e.coords.numel() * 4 + e.feats.numel() * 4 for e in carry)
            assert res["out_bytes"][k] == nbytes
    assert len(carry) == 1   # the head's output only
    # The head is one Linear: it keeps its input features [N, width] for backward.
    n = carry[0].num_voxels
    assert res["act_bytes"][-1] == n * 8 * 4
    assert all(a > 0 for a in res["act_bytes"])


def test_profile_fits_halo_and_json_round_trip():
    net = _net("unet", width=8, depth=2)
    before = [p.detach().clone() for p in net.parameters()]
    batches = [synthetic_batch(v, 3, multiple=net.total_stride) for v in (500, 1000)]
    prof = profile_model(net, batches, repeats=2, warmup=0, name="unet")
    for p, w in zip(net.parameters(), before):   # profiling leaves the weights as they were
        assert torch.equal(p, w) and p.grad is None
    assert len(prof.blocks) == len(net.blocks)
    assert prof.sizes == tuple(b.num_voxels for b in batches)
    assert prof.total_stride == 4 and prof.extent == batches[0].spatial_shape
    # Stem: SubM3 (3 -> 8) + a residual unit of two SubM3 (8 -> 8) at the input's stride:
    # radius 1 * channels * 4 bytes each, on every axis.
    assert prof.blocks[0].halo == pytest.approx((4 * (3 + 8 + 8),) * 3)
    assert prof.blocks[0].exchanges == 3 and prof.blocks[-1].exchanges == 0
    assert prof.blocks[0].param_bytes == sum(p.numel() * 4 for p in net.blocks[0].parameters())
    for b in prof.blocks:   # the fits go through the measured medians (two sizes: exactly)
        for m in b.measured:
            assert b.forward(m["voxels"]) == pytest.approx(max(0.0, m["forward"]), abs=1e-12)
            assert b.out_bytes(m["voxels"]) == pytest.approx(m["out_bytes"])
    assert prof.blocks[0].update > 0   # an AdamW step over the block's parameters
    assert prof.blocks[0].update_sgd > 0  # and an SGD step
    assert ModelProfile.from_json(prof.to_json()) == prof
    with pytest.raises(ProfileError, match="not a model profile"):
        ModelProfile.from_json('{"name": "x"}')


def test_fit_linear():
    f = fit_linear([100, 200, 400], [1.5, 2.5, 4.5])
    assert f.a == pytest.approx(0.5) and f.b == pytest.approx(0.01)
    assert fit_linear([100, 100], [2.0, 4.0]) == Fit(0.0, 0.03)   # one size: proportional
    assert Fit(-5.0, 1.0)(2.0) == 0.0                               # clamped at 0
    with pytest.raises(ProfileError):
        fit_linear([], [])


def test_bad_inputs():
    net = _net()
    with pytest.raises(ProfileError, match="batches is empty"):
        profile_model(net, [])
    with pytest.raises(ProfileError, match="repeats"):
        profile_model(net, [synthetic_batch(100, 3)], repeats=0)
    with pytest.raises(ValueError, match="voxels >= 12"):
        synthetic_batch(3, 3)


def test_kernel_maps_creators_and_users():
    net = _net("unet", width=8, depth=2)
    x = synthetic_batch(600, 3, multiple=net.total_stride)
    prof = profile_model(net, [x], repeats=1, warmup=0)
    maps = {k.key: k for k in prof.kmaps}
    # blocks: 0 stem, 1 down1, 2 down2, 3 up2, 4 up1, 5 head
    assert maps["down1"].creator == 1 and maps["down1"].users == (4,)
    assert maps["down2"].creator == 2 and maps["down2"].users == (3,)
    assert maps["subm:k3:d1:s1"].creator == 0 and maps["subm:k3:d1:s1"].users == (4,)
    assert all(k.build(x.num_voxels) >= 0 for k in prof.kmaps)
    assert ModelProfile.from_json(prof.to_json()) == prof


def test_a_mixed_precision_profile_measures_under_autocast():
    # A bf16 run keeps bf16 activations: the profile must see them, not float32 ones.
    net = _net("unet", width=8, depth=2)
    batches = [synthetic_batch(v, 3, multiple=net.total_stride) for v in (500, 1000)]
    fp32 = profile_model(net, batches, repeats=1, warmup=0, split_grids=())
    bf16 = profile_model(net, batches, repeats=1, warmup=0, split_grids=(),
                         autocast=torch.bfloat16)
    assert fp32.notes["autocast"] is None and bf16.notes["autocast"] == "bfloat16"
    # The head keeps its input features, bf16 under autocast: half the float32 bytes (and
    # autocast's bf16 copy of its weight, 8 x 5 x 2 bytes).
    assert bf16.blocks[-1].act_bytes(1000) == pytest.approx(fp32.blocks[-1].act_bytes(1000) / 2
                                                            + 80)
    assert bf16.blocks[-1].out_bytes(1000) < fp32.blocks[-1].out_bytes(1000)
    with pytest.raises(ProfileError, match="autocast must be None"):
        profile_model(net, batches, repeats=1, autocast=torch.float64)
