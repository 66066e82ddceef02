"""Mixed precision: the library's layers follow torch.autocast (CPU bf16/fp16 here) within a
tolerance of float32, keep float32 weights and gradients, and change nothing outside autocast."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import random_cloud
from sparsepipe_hpc.nn import (BatchNorm, SparseConv3d, SparseInverseConv3d, SparseUNet,
                               SubMConv3d)
from sparsepipe_hpc.nn.amp import autocast_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error of one layer's output/gradients in the low dtype (8 / 11 mantissa bits).
REL = {"bf16": 2e-2, "fp16": 3e-3}
# Whole-network gradients sum many rounded terms that largely cancel (measured: cosine 0.974
# bf16, 0.995 fp16 for this U-Net); the training test checks that bf16 still learns like fp32.
COS = {"bf16": 0.95, "fp16": 0.99}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def run(net, x, dtype=None):
    """Forward + backward of sum(out * r); returns (out feats, input grad, param grads)."""
    f = x.feats.clone().requires_grad_()
    if dtype is None:
        y = net(x.replace(feats=f, kmaps={}))
    else:
        with torch.autocast("cpu", dtype=dtype):
            y = net(x.replace(feats=f, kmaps={}))
    r = torch.randn(y.feats.shape, generator=torch.Generator().manual_seed(1))
    (y.feats.float() * r).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    return y.feats, f.grad, grads


def test_autocast_inputs_only_under_autocast():
    a, b = torch.ones(2), torch.ones(2, dtype=torch.float64)
    assert autocast_inputs(a, b) == (a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ca, cb = autocast_inputs(a, b)
    assert ca.dtype == torch.bfloat16 and cb.dtype == torch.float64  # float64 stays, as in torch


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("engine", ["torch", "spconv"])
def test_conv_layers_under_autocast_match_fp32(gen, engine, precision):
    dtype = DTYPES[precision]
    x = random_cloud(gen, 1500, shape=(24, 24, 24), channels=8, dtype=torch.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(SubMConv3d(8, 16, 3, engine=engine),
                              SparseConv3d(16, 16, 2, 2, indice_key="d", engine=engine),
                              SparseInverseConv3d(16, 8, 2, indice_key="d", bias=True,
                                                  engine=engine))
    y32, gi32, gw32 = run(net, x)
    y, gi, gw = run(net, x, dtype)
    assert y.dtype == dtype and gi.dtype == torch.float32  # activations low, input grad float32
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert all(g.dtype == torch.float32 for g in gw)  # master weights' gradients
    assert rel_err(y, y32) < REL[precision]
    assert rel_err(gi, gi32) < REL[precision]
    for a, b in zip(gw, gw32):
        assert rel_err(a, b) < REL[precision]
    # and low precision is really used: the result is not bitwise float32's
    assert not torch.equal(y.float(), y32)


@pytest.mark.parametrize("precision", sorted(DTYPES))
def test_batchnorm_under_autocast_keeps_float32_statistics(gen, precision):
    dtype = DTYPES[precision]
    x = random_cloud(gen, 800, channels=6, dtype=torch.float32)
    x = x.replace(feats=x.feats * 3 + 5)
    bn = BatchNorm(6)
    ref = copy.deepcopy(bn)
    low = x.replace(feats=x.feats.to(dtype))
    with torch.autocast("cpu", dtype=dtype):
        y = bn(low)
    y_ref = ref(low.replace(feats=low.feats.float()))  # the same rounded input, in float32
    assert y.feats.dtype == dtype and bn.running_mean.dtype == torch.float32
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.feats.float(), y_ref.feats.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("engine", ["torch", "spconv"])
def test_unet_under_autocast_tracks_fp32(gen, engine, precision):
    dtype = DTYPES[precision]
    x = random_cloud(gen, 3000, shape=(32, 32, 32), channels=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = SparseUNet(3, 5, width=8, depth=3, engine=engine)
    y32, gi32, gw32 = run(net, x)
    y, gi, gw = run(net, x, dtype)
    assert y.dtype == dtype
    a, b = torch.cat([g.flatten() for g in gw]), torch.cat([g.flatten() for g in gw32])
    assert rel_err(y, y32) < 5 * REL[precision]
    assert float(torch.nn.functional.cosine_similarity(a, b, 0)) > COS[precision]
    assert all(torch.isfinite(g).all() for g in gw)


def test_float64_is_untouched_under_autocast(gen):
    """Equivalence tests run in float64: autocast (as torch's own) leaves it exact."""
    x = random_cloud(gen, 500)
    torch.manual_seed(0)
    net = torch.nn.Sequential(SubMConv3d(4, 5, 3), BatchNorm(5)).double()
    y_ref, gi_ref, gw_ref = run(net, x)
    y, gi, gw = run(net, x, torch.bfloat16)
    assert y.dtype == torch.float64
    assert torch.equal(y, y_ref) and torch.equal(gi, gi_ref)
