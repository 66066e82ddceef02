"""The local part of a distributed submanifold layer through the engine's own map (spconv's indices
and kernels) equals the explicit-pair path it replaces: forward, input and weight gradients, at
every world size and grid, for layers and the U-Net (float64)."""

from __future__ import annotations

import copy

import pytest
import torch

from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.engine.spconv_subm import SubmMap
from sparsepipe_hpc.nn import SparseUNet, SubMConv3d
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from test_spatial import make_cloud

GRIDS = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 2, 1)], 3: [(3, 1, 1)], 4: [(2, 2, 1), (4, 1, 1)]}
TOL = dict(rtol=1e-12, atol=1e-12)


def forward_backward(net, xl, native: bool, ctx_args):
    comm, grid = ctx_args
    ctx = ParallelContext(comm, RankLayout(1, 1, grid), cuts="balanced", force_spatial=True)
    ctx.group.native_local = native
    x, = ctx.distribute(xl.replace(kmaps={}), align=4)
    f = x.feats.clone().requires_grad_()
    y = net(x.replace(feats=f))
    r = torch.randn(y.feats.shape, generator=torch.Generator().manual_seed(3), dtype=y.feats.dtype)
    (y.feats * r).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    subm = {k: e.extra for k, e in x.kmaps.items() if k.startswith("subm")}
    used = [type(m.local_for(get_engine("spconv"))).__name__ for m in subm.values()]
    return y.feats.detach(), f.grad, grads, used, subm


def same_map(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (torch.equal(a.ptr, b.ptr) and torch.equal(a.in_rows, b.in_rows)
            and torch.equal(a.out_rows, b.out_rows) and (a.n_in, a.n_out) == (b.n_in, b.n_out))


NETS = {
    "subm3": lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3, engine="spconv")),
    "subm3_dil2": lambda: torch.nn.Sequential(SubMConv3d(3, 4, 3, dilation=2, engine="spconv")),
    "subm5": lambda: torch.nn.Sequential(SubMConv3d(3, 4, 5, engine="spconv")),
    "unet": lambda: SparseUNet(3, 5, width=4, depth=2, engine="spconv"),
}


@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("name", sorted(NETS))
def test_native_local_part_equals_explicit_pairs(comm, name, kind):
    x = make_cloud(13, kind)
    for grid in GRIDS.get(comm.size, []):
        torch.manual_seed(0)
        net = NETS[name]().double()
        ref = copy.deepcopy(net)
        y, gi, gw, used, maps = forward_backward(net, x, True, (comm, grid))
        y0, gi0, gw0, used0, maps0 = forward_backward(ref, x, False, (comm, grid))
        # The halo pairs, found by looking up the outputs' stencils among the halo voxels alone,
        # and the explicit local pairs (built only on demand now) are the old split map's.
        assert maps.keys() == maps0.keys()
        for key in maps:
            assert same_map(maps[key].halo, maps0[key].halo), key
            assert same_map(maps[key].local, maps0[key].local), key
        assert used and set(used) == {SubmMap.__name__}, used   # the new path really ran
        assert set(used0) == {"KernelMap"}, used0                # and the old one
        torch.testing.assert_close(y, y0, **TOL)
        torch.testing.assert_close(gi, gi0, **TOL)
        for a, b in zip(gw, gw0):
            torch.testing.assert_close(a, b, **TOL)
