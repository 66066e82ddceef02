"""Serial layers against spconv and torch references; models' shapes and gradients."""

from __future__ import annotations

import pytest
import torch

import spconv.pytorch as spconv
from helpers import random_cloud
from sparsepipe_hpc.engine.spconv_engine import patch_spconv
from sparsepipe_hpc.nn import (BatchNorm, ConvError, GlobalPool, SparseConv3d,
                               SparseInverseConv3d, SparseResNet, SparseUNet, SubMConv3d,
                               commit_batchnorm, set_deferred_batchnorm)

# spconv reference layers run on CPU tensors: name the Native algorithm, which both of
# spconv's builds run on the CPU (its CUDA build picks implicit GEMM otherwise, CUDA only).
NATIVE = spconv.ConvAlgo.Native
pytestmark = pytest.mark.usefixtures("spconv_like_cuda_build")


@pytest.mark.parametrize("engine", ["torch", "spconv"])
def test_conv_layers_match_spconv_forward_and_backward(gen, engine):
    patch_spconv()
    x = random_cloud(gen, 700, channels=4)
    ours = [SubMConv3d(4, 6, 3, engine=engine), SparseConv3d(6, 8, 2, 2, indice_key="a", engine=engine),
            SparseInverseConv3d(8, 5, 2, indice_key="a", engine=engine)]
    ref = [spconv.SubMConv3d(4, 6, 3, bias=False, algo=NATIVE),
           spconv.SparseConv3d(6, 8, 2, 2, bias=False, indice_key="a", algo=NATIVE),
           spconv.SparseInverseConv3d(8, 5, 2, indice_key="a", bias=False, algo=NATIVE)]
    for a, b in zip(ours, ref):
        a.double()
        b.double()
        b.weight.data.copy_(a.weight.data)
    f1 = x.feats.clone().requires_grad_()
    f2 = x.feats.clone().requires_grad_()
    y1 = x.replace(feats=f1)
    y2 = x.replace(feats=f2).to_spconv()
    for a, b in zip(ours, ref):
        y1, y2 = a(y1), b(y2)
    assert torch.equal(y1.coords, y2.indices)  # the inverse lands on the input's rows, in order
    torch.testing.assert_close(y1.feats, y2.features, rtol=1e-12, atol=1e-12)
    r = torch.randn(y1.feats.shape, generator=gen, dtype=torch.float64)
    (y1.feats * r).sum().backward()
    (y2.features * r).sum().backward()
    torch.testing.assert_close(f1.grad, f2.grad, rtol=1e-11, atol=1e-11)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-11, atol=1e-11)


def test_batchnorm_matches_torch(gen):
    x = random_cloud(gen, 300, channels=5)
    ours = BatchNorm(5).double()
    ref = torch.nn.BatchNorm1d(5).double()
    f1 = x.feats.clone().requires_grad_()
    f2 = x.feats.clone().requires_grad_()
    y1 = ours(x.replace(feats=f1)).feats
    y2 = ref(f2)
    torch.testing.assert_close(y1, y2)
    r = torch.randn(y1.shape, generator=gen, dtype=torch.float64)
    (y1 * r).sum().backward()
    (y2 * r).sum().backward()
    torch.testing.assert_close(f1.grad, f2.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(x).feats, ref(x.feats))


def test_deferred_batchnorm_running_stats_equal_one_layer_over_the_whole_batch(gen):
    """Deferred: micro-batch outputs are normalized per micro-batch (as the default mode), the
    running statistics take one update from all micro-batches = torch's over the whole batch."""
    x = random_cloud(gen, 300, channels=5)
    full = torch.nn.BatchNorm1d(5).double()
    full(x.feats)
    default, deferred = BatchNorm(5).double(), BatchNorm(5, deferred=True).double()
    for rows in torch.tensor_split(torch.arange(len(x.feats)), 3):
        part = x.replace(feats=x.feats[rows], coords=x.coords[rows])
        torch.testing.assert_close(deferred(part).feats, default(part).feats)
    torch.testing.assert_close(deferred.running_mean, torch.zeros(5, dtype=torch.float64))
    assert int(deferred.num_batches_tracked) == 0 and int(default.num_batches_tracked) == 3
    assert commit_batchnorm(deferred) == 1 and not deferred.commit()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(deferred, name), getattr(full, name))
    assert not torch.allclose(default.running_var, full.running_var)
    assert set_deferred_batchnorm(deferred, False) == 1 and not deferred.deferred
    assert "deferred=True" in repr(BatchNorm(2, deferred=True))


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_global_pool(gen, mode):
    x = random_cloud(gen, 200, batch=3, channels=4)
    f = x.feats.clone().requires_grad_()
    y = GlobalPool(mode)(x.replace(feats=f))
    b = x.coords[:, 0].long()
    ref = torch.stack([(f[b == i].mean(0) if mode == "avg" else f[b == i].max(0).values)
                       for i in range(3)])
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    if mode == "avg":
        counts = torch.bincount(b, minlength=3).double()
        torch.testing.assert_close(f.grad, (1 / counts)[b][:, None].expand(-1, 4))
    else:
        assert f.grad.sum().item() == pytest.approx(12.0)  # one winner per sample and channel
    # A sample without voxels pools to zeros either way (max gave -inf: inf and NaN logits)
    empty = x.replace(coords=x.coords[b != 1].contiguous(), feats=f[b != 1].detach())
    assert GlobalPool(mode)(empty)[1].tolist() == [0.0] * 4


def test_max_pool_ties_go_to_smallest_coordinate():
    from sparsepipe_hpc.sparse import SparseTensor

    coords = torch.tensor([[0, 3, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0]], dtype=torch.int32)
    f = torch.zeros(3, 1, requires_grad=True)
    GlobalPool("max")(SparseTensor(coords, f, (4, 4, 4), 1)).sum().backward()
    assert f.grad[:, 0].tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("engine", ["torch", "spconv"])
def test_models_forward_backward_shapes(gen, engine):
    x = random_cloud(gen, 1500, shape=(32, 32, 32), batch=2, channels=3, dtype=torch.float32)
    unet = SparseUNet(3, 7, width=8, depth=3, engine=engine)
    assert unet.total_stride == 8
    y = unet(x)
    assert y.feats.shape == (x.num_voxels, 7) and torch.equal(y.coords, x.coords)
    y.feats.sum().backward()
    assert all(p.grad is not None for p in unet.parameters())
    net = SparseResNet(3, 5, width=8, depth=2, engine=engine)
    logits = net(x)
    assert logits.shape == (2, 5)
    logits.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_conv_errors_name_the_problem(gen):
    x = random_cloud(gen, 50, channels=4, dtype=torch.float32)
    with pytest.raises(ConvError, match="expects 3 input channels"):
        SubMConv3d(3, 4)(x)
    with pytest.raises(ConvError, match="odd kernel_size"):
        SubMConv3d(3, 4, kernel_size=2)
    with pytest.raises(ConvError, match="indice_key"):
        SparseInverseConv3d(4, 4, 2, indice_key="nowhere")(x)
    with pytest.raises(ConvError, match="padding must be >= 0; got -1"):
        SparseConv3d(3, 4, 3, padding=-1)
    # A reach past 2**16 voxels wrapped lookups into the next axis of the voxel keys: a
    # SubMConv3d of dilation 2**18 paired voxels that are not neighbours.
    with pytest.raises(ConvError, match="dilation \\* \\(kernel_size - 1\\) \\+ padding is "
                                        "524288 voxels; at most 65536"):
        SubMConv3d(3, 4, 3, dilation=1 << 18)
    SparseConv3d(3, 4, 3, padding=1 << 15, dilation=1 << 14)  # within reach
    with pytest.raises(ValueError, match="momentum must be a number in \\[0, 1\\]; got None"):
        BatchNorm(4, momentum=None)  # type: ignore[arg-type]


def test_a_layer_refuses_an_input_that_breaks_the_tensor_contract():
    """Repeated voxels (summed twice by a submanifold layer) and coordinates outside the grid or
    the batch (dropped by a strided one) were taken without a word: the first layer a tensor
    meets checks it, naming the rows."""
    from sparsepipe_hpc.sparse import SparseTensor, SparseTensorError

    c = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2], [0, 1, 1, 1]], dtype=torch.int32)
    x = SparseTensor(c, torch.ones(3, 2), (4, 4, 4), 1)
    with pytest.raises(SparseTensorError, match=r"SubMConv3d input: 1 row\(s\) repeat a voxel "
                                                r"\(rows \[0, 2\] are all \[0, 1, 1, 1\]\)"):
        SubMConv3d(2, 3)(x)
    for bad, rule in (([0, 9, 1, 1], r"coordinate x spans \[1, 9\] but must lie in \[0, 3\]"),
                      ([1, 1, 1, 1], r"coordinate batch spans \[0, 1\] but must lie in \[0, 0\]"),
                      ([0, -1, 1, 1], r"coordinate x spans \[-1, 2\]")):
        c2 = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2], bad], dtype=torch.int32)
        with pytest.raises(SparseTensorError, match=rule):
            SparseConv3d(2, 3, 2, 2)(SparseTensor(c2, torch.ones(3, 2), (4, 4, 4), 1))
    ok = SparseTensor(c[:2], torch.ones(2, 2), (4, 4, 4), 1)
    assert SubMConv3d(2, 3)(ok).feats.shape == (2, 3)


@pytest.mark.parametrize("key", [None, "s"])
def test_coords_written_in_place_after_a_layer_met_them_are_refused(gen, key):
    """The maps cached on the tensor were reused for the moved voxels (0.5 off, silently); a new
    tensor on the new coordinates builds its own."""
    from sparsepipe_hpc.sparse import SparseTensor

    x = random_cloud(gen, 60, channels=2, dtype=torch.float32)
    conv = SubMConv3d(2, 3, 3, indice_key=key)
    conv(x)
    conv(x)  # unchanged: the cached maps serve
    x.coords[:, 1] = x.spatial_shape[0] - 1 - x.coords[:, 1]  # mirrored in place
    with pytest.raises(ConvError, match="coords were written in place after a layer built kernel "
                                        "maps for them"):
        conv(x)
    fresh = SparseTensor(x.coords.clone(), x.feats, x.spatial_shape, x.batch_size)
    assert conv(fresh).feats.shape == (len(x.coords), 3)


def test_maps_do_not_cross_between_serial_and_distributed_tensors(gen):
    """A kernel map cached by a single-process layer has no split maps, and a distributed one
    no serial use: a tensor that shares another's ``kmaps`` across that line is refused."""
    from mpi4py import MPI

    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    x = random_cloud(gen, 60, channels=3, dtype=torch.float32)
    down = SparseConv3d(3, 4, 2, 2, indice_key="d")
    with ParallelContext(MPI.COMM_SELF, RankLayout.from_world(1, grid=(1, 1, 1)),
                         force_spatial=True) as ctx:
        xl, = ctx.distribute(x, align=2)
        down(x)  # a serial map under "d"
        with pytest.raises(ConvError, match="without a spatial context"):
            down(xl.replace(kmaps=x.kmaps))
        down(xl)  # a distributed one
        with pytest.raises(ConvError, match="no spatial context"):
            down(x.replace(kmaps=xl.kmaps))
        with pytest.raises(ConvError, match=rf"another voxel set \({len(xl.coords)} voxels"):
            down(xl.replace(coords=xl.coords[:10], feats=xl.feats[:10]))


@pytest.mark.parametrize("engine", ["torch", "spconv"])
def test_a_new_voxel_set_at_the_same_stride_gets_its_own_maps(gen, engine):
    """A non-submanifold stride-1 convolution (new voxels at the same stride) and
    ``replace(coords=...)`` keep the input's kmaps; the next layers use maps of their own voxels
    (they ran the input's, returning its coordinates, where the counts happened to match)."""
    from sparsepipe_hpc.sparse import SparseTensor

    x = random_cloud(gen, 80, shape=(8, 8, 8), channels=3, dtype=torch.float64)
    torch.manual_seed(0)
    subm, grow, subm2 = (SubMConv3d(3, 3, 3, engine=engine), SparseConv3d(3, 3, 3, 1, 1,
                         engine=engine), SubMConv3d(3, 3, 3, engine=engine))
    subm, grow, subm2 = subm.double(), grow.double(), subm2.double()
    y = grow(subm(x))
    fresh = SparseTensor(y.coords.clone(), y.feats, y.spatial_shape, y.batch_size)
    got, want = subm2(y), subm2(fresh)
    assert torch.equal(got.coords, want.coords) and torch.allclose(got.feats, want.feats)
    moved = x.replace(coords=x.coords.flip(0).contiguous())  # the same count, other rows
    again = SparseTensor(moved.coords.clone(), x.feats, x.spatial_shape, x.batch_size)
    got, want = subm(moved), subm(again)
    assert torch.equal(got.coords, want.coords) and torch.allclose(got.feats, want.feats)


def test_an_indice_key_names_one_convolution(gen):
    x = random_cloud(gen, 80, shape=(8, 8, 8), channels=3, dtype=torch.float32)
    SparseConv3d(3, 4, 2, 2, indice_key="k")(x)
    with pytest.raises(ConvError, match="indice_key 'k' names a convolution of kernel_size 2, "
                                        "stride 2, padding 0, dilation 1; this layer has 3, 2, 1"):
        SparseConv3d(3, 4, 3, 2, 1, indice_key="k")(x)
    other = x.replace(coords=x.coords[:40], feats=x.feats[:40])
    with pytest.raises(ConvError, match=rf"another voxel set \({len(x.coords)} voxels; this "
                                        r"input has 40\)"):
        SparseConv3d(3, 4, 2, 2, indice_key="k")(other)


def test_a_map_serves_only_the_grid_it_was_built_on(gen):
    """``x.replace(spatial_shape=...)`` shares coords and maps: a strided layer reused the map of
    the smaller grid, dropping the outputs past its face and keeping its shape. Now an automatic
    key rebuilds, and an indice_key is refused."""
    from sparsepipe_hpc.sparse import SparseTensor

    coords = torch.tensor([[0, 15, 15, 15]], dtype=torch.int32)
    x16 = SparseTensor(coords, torch.ones(1, 1), (16, 16, 16), 1)
    conv = SparseConv3d(1, 1, 3, 1, 1)
    conv(x16)
    y = conv(x16.replace(spatial_shape=(20, 20, 20)))
    assert y.num_voxels == 27 and y.spatial_shape == (20, 20, 20)
    keyed = SparseConv3d(1, 1, 3, 1, 1, indice_key="k")
    keyed(x16)
    with pytest.raises(ConvError, match=r"indice_key 'k' names a map built on a grid of shape "
                                        r"\(16, 16, 16\) at stride 1 with batch size 1; this "
                                        r"input has \(20, 20, 20\), 1, 1"):
        keyed(x16.replace(spatial_shape=(20, 20, 20)))


def test_a_unet_builds_each_kernel_map_once(gen, monkeypatch):
    """The layers hand the same coords tensor along, so no map is built twice in a step."""
    import sparsepipe_hpc.kmaps as kmaps

    built = []

    class Counted(kmaps.ConvEntry):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.spec)
    monkeypatch.setattr(kmaps, "ConvEntry", Counted)
    x = random_cloud(gen, 400, shape=(16, 16, 16), batch=2, channels=3, dtype=torch.float32)
    SparseUNet(3, 5, width=4, depth=3)(x).feats.sum().backward()
    assert len(built) == len(x.kmaps) == 7  # subm at strides 1, 2, 4, 8; three down-samplings


def test_sparse_tensor_contract_errors():
    from sparsepipe_hpc.sparse import SparseTensor, SparseTensorError

    c = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    f = torch.zeros(1, 2)
    with pytest.raises(SparseTensorError, match="int32"):
        SparseTensor(c.long(), f, (4, 4, 4), 1)
    with pytest.raises(SparseTensorError, match=r"N = len\(coords\) = 1"):
        SparseTensor(c, torch.zeros(2, 2), (4, 4, 4), 1)
    with pytest.raises(SparseTensorError, match="at most"):
        SparseTensor(c, f, (1 << 17, 4, 4), 1)
    with pytest.raises(SparseTensorError, match=r"coordinate z spans \[3, 3\] but must lie in \[0, 2\]"):
        SparseTensor(c, f, (4, 4, 3), 1).validate()
    # from_voxels cast to int32 first: 2**32 + 5 became 5, a voxel validate() accepted
    from types import SimpleNamespace
    for coords, shown in (([[2 ** 32 + 5, 1, 1]], "int64 in \\[1, 4294967301\\]"),
                          ([[1.5, 1.0, 1.0]], "float")):
        with pytest.raises(SparseTensorError, match=f"coords of sample 0 must be integers within "
                                                    f"int32; got torch.{shown}"):
            SparseTensor.from_voxels([SimpleNamespace(coords=coords, feats=[[1.0]])], (8, 8, 8))
    empty = SimpleNamespace(coords=torch.zeros(0, 3), feats=torch.zeros(0, 1))  # float, no rows
    one = SimpleNamespace(coords=[[1, 2, 3]], feats=[[1.0]])
    assert SparseTensor.from_voxels([empty, one], (8, 8, 8)).coords.tolist() == [[1, 1, 2, 3]]


def test_sparse_tensor_to_another_device_leaves_its_kernel_maps_behind(gen):
    x = random_cloud(gen, 100, dtype=torch.float32)
    x.kmaps["k"] = object()  # built for coordinates on the old device
    assert x.to("cpu") is x and x.kmaps
    meta = x.to(torch.device("meta"), non_blocking=True)
    assert (meta.coords.device.type, meta.feats.device.type, meta.kmaps) == ("meta", "meta", {})
    assert (meta.feats.shape, meta.spatial_shape, meta.batch_size) == (
        x.feats.shape, x.spatial_shape, x.batch_size)


def test_batchnorm_of_fewer_than_two_voxels_is_an_error_naming_the_count():
    from sparsepipe_hpc.nn.functional import BatchNormError, batch_norm

    c = 3
    args = (torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c), True, 0.1, 1e-5)
    for n in (0, 1):
        with pytest.raises(BatchNormError, match=f"BatchNorm in training needs at least 2 voxels "
                                                 f"over its group to take batch statistics; "
                                                 f"got {n}"):
            batch_norm(torch.randn(n, c), *args)
    assert batch_norm(torch.randn(2, c), *args).shape == (2, c)


def test_batchnorm_backward_through_torch_sync_kernels_equals_the_elementwise_form(gen,
                                                                                 monkeypatch):
    """The CUDA backward's wiring (torch's SyncBatchNorm kernels: which sums it reduces, the
    count it hands on), on the CPU with the two kernels stood in for by their formulas
    (aten/src/ATen/native/cuda/Normalization.cuh); tests/test_gpu.py runs the real ones."""
    import sparsepipe_hpc.nn.functional as fn

    def reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        dy_xmu = (dy * (x - mean)).sum(0)
        return dy.sum(0), dy_xmu, dy_xmu * invstd, dy.sum(0)

    def elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        assert count.dtype == torch.int32 and count.shape == (1,)
        n = count.sum()
        return (dy - sum_dy / n - (x - mean) * invstd ** 2 * sum_dy_xmu / n) * invstd * weight

    x = random_cloud(gen, 400, channels=5)
    g = torch.randn(x.feats.shape, generator=gen, dtype=torch.float64)
    bn = BatchNorm(5, deferred=True).double()  # deferred: the group form on one rank too
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(fn, "_fused_backward", lambda t, fused=fused: fused and len(t) > 0)
        monkeypatch.setattr(torch, "batch_norm_backward_reduce", reduce)
        monkeypatch.setattr(torch, "batch_norm_backward_elemt", elemt)
        bn.zero_grad()
        f = x.feats.clone().requires_grad_()
        bn(x.replace(feats=f)).feats.backward(g)
        results.append((f.grad, bn.weight.grad.clone(), bn.bias.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_batchnorm_in_float32_keeps_float64_accuracy_on_many_voxels():
    """Mean 100, spread 1, 200k voxels: outputs and gradients within 2e-5 of float64 (relative to
    the largest value). torch's CPU kernel errs by 9e-5 in the outputs here and 5e-4 in the
    weight gradient, which is why the CPU does not use it. (Gradients of mean zero: with a mean
    g, the weight gradient also takes the float32 rounding of the mean times N * g, as on a GPU.)"""
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(200_000, 4, generator=gen, dtype=torch.float64) + 100
    dy64 = torch.randn(200_000, 4, generator=gen, dtype=torch.float64)
    w64 = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5

    def run(dtype):
        bn = BatchNorm(4).to(dtype)
        with torch.no_grad():
            bn.weight.copy_(w64)
        f = x64.to(dtype).requires_grad_()
        y = bn(random_cloud(gen, 1).replace(coords=torch.zeros(len(f), 4, dtype=torch.int32),
                                            feats=f)).feats
        y.backward(dy64.to(dtype))
        return y, f.grad, bn.weight.grad, bn.bias.grad, bn.running_var

    for got, ref in zip(run(torch.float32), run(torch.float64)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-5, err


def test_model_sizes_must_be_positive_integers():
    """depth 0 or -1, a float width, no classes: a named error, not an IndexError or torch's."""
    from sparsepipe_hpc.nn import build_model

    for name, kw, bad in (("resnet", dict(depth=-1), "depth must be an integer >= 1; got -1"),
                          ("unet", dict(depth=0), "depth must be an integer >= 1; got 0"),
                          ("unet", dict(width=1.5), "width must be an integer >= 1; got 1.5")):
        with pytest.raises(ValueError, match=bad):
            build_model(name, 3, 8, **kw)
    with pytest.raises(ValueError, match="SparseUNet: num_classes must be an integer >= 1"):
        build_model("unet", 3, 0)
