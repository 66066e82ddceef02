"""Kernel maps and both engines against spconv's own layers, and CPU thread safety."""

from __future__ import annotations

import itertools

import pytest
import torch

import spconv.pytorch as spconv
from halo.kmap import coord_keys, decode_keys, kernel_map, output_coords, strided_map
from helpers import random_cloud
from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.engine.spconv_engine import patch_spconv

ENGINES = ["torch", "spconv"]

# spconv reference layers run on CPU tensors: name the Native algorithm, which both of
# spconv's builds run on the CPU (its CUDA build picks implicit GEMM otherwise, CUDA only).
NATIVE = spconv.ConvAlgo.Native
pytestmark = pytest.mark.usefixtures("spconv_like_cuda_build")


def spconv_rows(ref_coords: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """Permutation p with ref_coords[p] == ours."""
    order = torch.argsort(coord_keys(ref_coords))
    pos = torch.searchsorted(coord_keys(ref_coords)[order], coord_keys(ours))
    return order[pos]


def test_keys_round_trip(gen):
    c = torch.cat([torch.randint(0, 300, (100, 1), generator=gen),
                   torch.randint(-1000, 100000, (100, 3), generator=gen)], 1).int()
    assert torch.equal(decode_keys(coord_keys(c)), c)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k,d", [(3, 1), (3, 2), (5, 1), (1, 1)])
def test_submanifold_matches_spconv(gen, engine, k, d):
    patch_spconv()
    x = random_cloud(gen, 600)
    ref = spconv.SubMConv3d(4, 5, k, dilation=d, bias=False, algo=NATIVE).double()
    y_ref = ref(x.to_spconv()).features
    km = kernel_map(x.coords, x.coords, k, 1, d * (k // 2), d)
    w = ref.weight.detach().reshape(5, k ** 3, 4)
    if k == 1:  # spconv's 1x1 path reads the same storage as [C_in, C_out] (see nn/conv.py)
        w = ref.weight.detach().view(4, 5).t().reshape(5, 1, 4)
    y = get_engine(engine).forward(x.feats, w, km)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 0), (2, 1, 0)])
def test_strided_and_inverse_match_spconv(gen, engine, k, s, p):
    patch_spconv()
    x = random_cloud(gen, 500)
    eng = get_engine(engine)
    down = spconv.SparseConv3d(4, 6, k, stride=s, padding=p, bias=False, indice_key="d",
                                algo=NATIVE).double()
    inv = spconv.SparseInverseConv3d(6, 4, k, indice_key="d", bias=False, algo=NATIVE).double()
    mid = down(x.to_spconv())
    out_shape = mid.spatial_shape
    oc = output_coords(x.coords, k, s, p, 1, out_shape)
    assert len(oc) == len(mid.indices)
    perm = spconv_rows(mid.indices, oc)
    assert torch.equal(mid.indices[perm], oc)
    km = kernel_map(x.coords, oc, k, s, p, 1)
    y = eng.forward(x.feats, down.weight.detach().reshape(6, k ** 3, 4), km)
    torch.testing.assert_close(y, mid.features[perm], rtol=1e-12, atol=1e-12)
    z_ref = inv(mid).features
    z = eng.forward(mid.features[perm].detach(), inv.weight.detach().reshape(4, k ** 3, 6),
                    km.transpose())
    torch.testing.assert_close(z, z_ref, rtol=1e-12, atol=1e-12)


def test_engines_agree_on_gradients(gen):
    x = random_cloud(gen, 800, channels=7)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    w = torch.randn(9, 27, 7, generator=gen, dtype=torch.float64)
    g = torch.randn(km.n_out, 9, generator=gen, dtype=torch.float64)
    a = get_engine("torch").backward(x.feats, w, g, km)
    b = get_engine("spconv").backward(x.feats, w, g, km)
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a[1], b[1], rtol=1e-12, atol=1e-12)


def _operands(gen, m, k3: int, c_in: int, c_out: int) -> tuple[torch.Tensor, ...]:
    """float64 (feats [N_in, C_in], weight [C_out, K, C_in], grad_out [N_out, C_out], an input
    gradient to accumulate into [N_in, C_in]) for map ``m``."""
    return (torch.randn(m.n_in, c_in, generator=gen, dtype=torch.float64),
            torch.randn(c_out, k3, c_in, generator=gen, dtype=torch.float64),
            torch.randn(m.n_out, c_out, generator=gen, dtype=torch.float64),
            torch.randn(m.n_in, c_in, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_spconv_split_backward_equals_its_own(gen, monkeypatch, k, s, p):
    """The backward CUDA takes (spconv's own allocates per offset there: SPLIT_BACKWARD), run on
    the CPU: the same input and weight gradients as spconv's indice_conv_backward, for a strided
    map and its transpose, whole and in pieces between progress calls, accumulating into a given
    input gradient and leaving the input gradient out when not asked for."""
    import sparsepipe_hpc.engine.spconv_engine as se

    x = random_cloud(gen, 700, channels=5)
    shape = tuple(int(v) + 1 for v in x.coords[:, 1:].max(0).values)
    out_shape = tuple((n + 2 * p - k) // s + 1 for n in shape)
    oc = output_coords(x.coords, k, s, p, 1, out_shape)
    km = kernel_map(x.coords, oc, k, s, p, 1)
    eng = get_engine("spconv")
    for m, c_in, c_out in ((km, 5, 3), (km.transpose(), 3, 5)):
        feats, w, g, acc = _operands(gen, m, k ** 3, c_in, c_out)
        ref = [eng.backward(feats, w, g, m), eng.backward(feats, w, g, m, need_input_grad=False),
               eng.backward(feats, w, g, m, grad_in=acc.clone())]
        monkeypatch.setattr(se, "SPLIT_BACKWARD", ("cpu", "cuda"))
        calls: list = []
        got = [eng.backward(feats, w, g, m, progress=lambda: calls.append(1)),
               eng.backward(feats, w, g, m, need_input_grad=False),
               eng.backward(feats, w, g, m, grad_in=acc.clone())]
        monkeypatch.undo()
        assert calls and got[1][0] is None and ref[1][0] is None
        for (gi, gw), (ri, rw) in zip(got, ref):
            if ri is not None:
                torch.testing.assert_close(gi, ri, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)


def _maps(gen):
    """Explicit maps of every kind a layer runs: k2s2 (tiling) and its transpose, k3s2p1, a
    submanifold k3 map and one narrowed by select (rows without pairs)."""
    x = random_cloud(gen, 400, channels=3)
    _, k2 = strided_map(x.coords, 2, 2, 0, 1, (8, 8, 8))
    _, k3 = strided_map(x.coords, 3, 2, 1, 1, (9, 9, 9))
    subm = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    return {"k2s2": k2, "k2s2_inverse": k2.transpose(), "k3s2p1": k3, "subm": subm,
            "selected": subm.select(subm.in_rows % 3 != 0)}


@pytest.mark.parametrize("case", ["k2s2", "k2s2_inverse", "k3s2p1", "subm", "selected"])
def test_implicit_gemm_tables_say_what_the_map_says(gen, case):
    """spconv's implicit-GEMM tables built from a KernelMap (engine.spconv_igemm; its kernels
    need CUDA, tests/test_gpu.py runs them): every pair in both tables, -1 elsewhere, masks
    sorted with their rows' argsort; read as the kernels read them, they give the explicit
    forward in float64, and the backward tables give the transposed one."""
    from sparsepipe_hpc.engine import spconv_igemm

    m = _maps(gen)[case]
    t = spconv_igemm.tables(m)
    k = m.num_offsets
    offsets = m.pair_offsets()
    assert t.pair_fwd.shape == (k, m.n_out) and t.pair_bwd.shape == (k, m.n_in)
    assert int((t.pair_fwd >= 0).sum()) == int((t.pair_bwd >= 0).sum()) == m.num_pairs
    assert torch.equal(t.pair_fwd[offsets, m.out_rows].long(), m.in_rows)
    assert torch.equal(t.pair_bwd[offsets, m.in_rows].long(), m.out_rows)
    for mask, order, pair in ((t.mask_fwd, t.argsort_fwd, t.pair_fwd),
                              (t.mask_bwd, t.argsort_bwd, t.pair_bwd)):
        assert mask.dtype == order.dtype == pair.dtype == torch.int32
        assert bool((mask[1:] >= mask[:-1]).all())
        assert torch.equal(order.sort().values.long(), torch.arange(pair.shape[1]))
        bits = ((pair[:, order.long()] >= 0).long() << torch.arange(k)[:, None]).sum(0)
        assert torch.equal(bits, mask.long())
    f = torch.randn(m.n_in, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(5, k, 4, generator=gen, dtype=torch.float64)
    ref = get_engine("torch")
    torch.testing.assert_close(spconv_igemm.reference_forward(f, w, m), ref.forward(f, w, m),
                               rtol=1e-12, atol=1e-12)
    g = torch.randn(m.n_out, 4, generator=gen, dtype=torch.float64)
    w_t = torch.randn(5, k, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(spconv_igemm.reference_forward(g, w_t, m.transpose()),
                               ref.forward(g, w_t, m.transpose()), rtol=1e-12, atol=1e-12)


def test_implicit_gemm_tables_are_built_once_per_map_and_transpose(gen, monkeypatch):
    """A map and its transpose share one build (the roles swapped), whichever comes first; the
    path is never taken on the CPU, even when listed (spconv's implicit GEMM is CUDA only)."""
    from sparsepipe_hpc.engine import spconv_igemm

    builds = []
    side = spconv_igemm._side
    monkeypatch.setattr(spconv_igemm, "_side", lambda *a: builds.append(1) or side(*a))
    m = _maps(gen)["k2s2"]
    t = spconv_igemm.tables(m)
    assert spconv_igemm.tables(m) is t
    t_inv = spconv_igemm.tables(m.transpose())
    assert len(builds) == 2  # the forward and backward sides of one map, once
    assert t_inv.pair_fwd is t.pair_bwd and t_inv.argsort_bwd is t.argsort_fwd
    m2 = _maps(gen)["k3s2p1"]
    inv2 = m2.transpose()  # made before the tables: they reach it all the same
    spconv_igemm.tables(m2)
    assert spconv_igemm.tables(inv2).pair_bwd is m2._igemm.pair_fwd and len(builds) == 4
    x, w = torch.zeros(m.n_in, 2), torch.zeros(3, 8, 2)
    assert not spconv_igemm.applies(m, x, w)
    monkeypatch.setattr(spconv_igemm, "DEVICES", ("cpu",))
    assert not spconv_igemm.applies(m, x, w)
    with pytest.raises(ValueError, match="at most 32 kernel offsets"):
        spconv_igemm.tables(kernel_map(m.in_rows.new_zeros(1, 4).int(),
                                       m.in_rows.new_zeros(1, 4).int(), 5, 1, 2, 1))


def test_implicit_gemm_takes_maps_dense_enough_for_its_tables(gen):
    """Strided maps, their transposes, one whose grid edge drops inputs and a submanifold map
    are worth the tables (K x rows); a halo part's few pairs into many rows are not."""
    from sparsepipe_hpc.engine import spconv_igemm

    maps = _maps(gen)
    for name in ("k2s2", "k2s2_inverse", "k3s2p1", "subm", "selected"):
        assert spconv_igemm.dense_enough(maps[name]), name
    x = random_cloud(gen, 400, channels=3)
    shape = tuple(int(v) + 1 for v in x.coords[:, 1:].max(0).values)
    _, edge = strided_map(x.coords, 2, 2, 0, 1, tuple(n // 2 - 1 for n in shape))
    assert 0 < edge.num_pairs < edge.n_in and spconv_igemm.dense_enough(edge)
    subm = maps["subm"]
    halo_part = subm.select(subm.out_rows < 10)
    assert not spconv_igemm.dense_enough(halo_part)
    assert not spconv_igemm.dense_enough(subm.select(torch.zeros_like(subm.in_rows, dtype=bool)))


def test_torch_engine_gradient_is_adjoint(gen):
    """<conv(x), r> == <x, conv^T(r)>: the input gradient is the exact adjoint of the forward."""
    x = random_cloud(gen, 300, channels=3)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    w = torch.randn(2, 27, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    feats = x.feats.clone().requires_grad_()
    from sparsepipe_hpc.nn.functional import sparse_conv

    y = sparse_conv(feats, w, km, get_engine("torch"))
    r = torch.randn_like(y)
    (y * r).sum().backward()
    lhs = (y * r).sum()
    rhs = (feats.grad * feats).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("engine", ENGINES)
def test_correct_with_two_threads(gen, engine):
    """spconv's CPU kernels race with >1 thread; the project's paths must stay exact at 2."""
    x = random_cloud(gen, 4000, shape=(24, 24, 24), channels=16)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    w = torch.randn(16, 27, 16, generator=gen, dtype=torch.float64)
    g = torch.randn(km.n_out, 16, generator=gen, dtype=torch.float64)
    eng = get_engine(engine)
    ref_y = get_engine("torch").forward(x.feats, w, km)
    ref_g = get_engine("torch").backward(x.feats, w, g, km)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            torch.testing.assert_close(eng.forward(x.feats, w, km), ref_y, rtol=1e-10, atol=1e-10)
            gi, gw = eng.backward(x.feats, w, g, km)
            torch.testing.assert_close(gi, ref_g[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(gw, ref_g[1], rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads


def test_spconv_engine_in_pieces_with_progress_equals_whole(gen):
    """With a progress callback spconv runs in pieces of kernel offsets; the sum is unchanged."""
    x = random_cloud(gen, 500, channels=4)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    w = torch.randn(5, 27, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(km.n_out, 5, generator=gen, dtype=torch.float64)
    eng = get_engine("spconv")
    calls = []
    y = eng.forward(x.feats, w, km, progress=lambda: calls.append(1))
    torch.testing.assert_close(y, eng.forward(x.feats, w, km), rtol=1e-12, atol=1e-12)
    gi, gw = eng.backward(x.feats, w, g, km, progress=lambda: calls.append(1))
    ri, rw = eng.backward(x.feats, w, g, km)
    torch.testing.assert_close(gi, ri, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)
    assert len(calls) == 8


def test_spconv_gets_its_pair_counts_on_the_host(gen):
    """spconv reads the per-offset counts on the host (it copies device ones back at every call,
    a device sync per convolution on a GPU): ours stay there whatever the rows' device (here
    "meta", a device without data, standing in for CUDA)."""
    from halo.kmap import KernelMap

    x = random_cloud(gen, 300)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    on_device = KernelMap(km.in_rows.to("meta"), km.out_rows.to("meta"), km.ptr, km.n_in,
                          km.n_out)
    pairs, counts = on_device.spconv_pairs()
    assert pairs.device.type == "meta" and counts.device.type == "cpu"
    assert torch.equal(counts, km.spconv_pairs()[1]) and counts.dtype == torch.int32


def test_a_transposed_map_takes_its_spconv_layout_from_the_map(gen):
    """A U-Net's inverse layer transposes its down layer's map after that layer has run: its
    spconv layout is the same table with the rows swapped, equal to one built afresh."""
    from halo.kmap import KernelMap

    x = random_cloud(gen, 400)
    km = strided_map(x.coords, 2, 2, 0, 1, (4, 4, 4))[1]
    km.spconv_pairs()
    pairs, counts = km.transpose().spconv_pairs()
    fresh, fresh_counts = KernelMap(km.out_rows, km.in_rows, km.ptr, km.n_out,
                                    km.n_in).spconv_pairs()
    assert torch.equal(pairs, fresh) and torch.equal(counts, fresh_counts)
    assert pairs.is_contiguous() and pairs.dtype == torch.int32


def test_spconv_subm_in_pieces_when_only_the_first_piece_has_pairs():
    """Voxels that meet only 2 apart along x (offsets (-2, 0, 0), in the first quarter of a
    5x5x5 kernel, and its mirror): the second piece has no pair at all, and spconv's CUDA kernels
    assert on a plain call with none (its CPU ones skip it), so the map runs as one submanifold
    call; the result is unchanged."""
    from sparsepipe_hpc.engine.spconv_subm import _native_pieces

    coords = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 8], [0, 8, 8, 8]], dtype=torch.int32)
    coords = torch.cat([coords, coords + torch.tensor([0, 2, 0, 0], dtype=torch.int32)])
    eng = get_engine("spconv")
    m = eng.subm_map(coords, (16, 16, 16), 1, 5, 1)
    assert len(_native_pieces(m, lambda: None)) == 1
    km = kernel_map(coords, coords, 5, 1, 2, 1)
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(6, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(4, 125, 3, dtype=torch.float64, generator=gen)
    calls = []
    y = eng.forward(f, w, m, progress=lambda: calls.append(1))
    torch.testing.assert_close(y, get_engine("torch").forward(f, w, km), rtol=1e-12, atol=1e-12)
    assert calls == [1]


@pytest.mark.parametrize("args", [(3, 1, 1, 1), (3, 1, 2, 2), (2, 2, 0, 1), (3, 2, 1, 1)])
def test_kernel_map_is_the_same_for_any_offsets_per_pass(gen, args):
    """The GPU's batched lookup (many offsets per pass, no host sync per offset) equals the
    CPU's offset-at-a-time one, pair for pair and in the same CSR order."""
    x = random_cloud(gen, 700)
    out = x.coords if args[1] == 1 else output_coords(x.coords, *args, (8, 8, 8))
    ref = kernel_map(x.coords, out, *args, offsets_per_pass=1)
    for per_pass in (2, 5, 27, 1000):
        km = kernel_map(x.coords, out, *args, offsets_per_pass=per_pass)
        assert torch.equal(km.ptr, ref.ptr) and torch.equal(km.in_rows, ref.in_rows)
        assert torch.equal(km.out_rows, ref.out_rows)
    empty = kernel_map(x.coords[:0], out, *args, offsets_per_pass=5)
    assert empty.num_pairs == 0 and empty.num_offsets == args[0] ** 3
    if args[1] > 1:  # the strided outputs too: the same set for any grouping of offsets
        for per_pass in (2, 5, 1000):
            assert torch.equal(output_coords(x.coords, *args, (8, 8, 8),
                                             offsets_per_pass=per_pass), out)
        assert output_coords(x.coords[:0], *args, (8, 8, 8), offsets_per_pass=5).shape == (0, 4)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (2, 2, 1), (3, 3, 0), (3, 3, 2), (1, 1, 0),
                                   ((2, 1, 3), (2, 1, 3), (1, 0, 0))])
def test_tiling_windows_take_one_lookup_per_input_with_the_same_result(gen, monkeypatch, k, s, p):
    """Kernel = stride (a U-Net's k2s2): outputs and pairs from each input's one window equal the
    general per-offset search's, in the same CSR order; the grid's extent is not a multiple of
    the stride, so without padding inputs in the last partial window reach no output."""
    import halo.kmap as kmap_module

    shape = (15, 16, 13)
    x = random_cloud(gen, 900, shape=shape, batch=3)
    x = x.replace(coords=x.coords[torch.randperm(len(x.coords), generator=gen)])  # any row order
    ks, ss, ps = (v if isinstance(v, tuple) else (v,) * 3 for v in (k, s, p))
    out_shape = tuple((n + 2 * pa - ka) // sa + 1 for n, ka, sa, pa in zip(shape, ks, ss, ps))
    fast_out = output_coords(x.coords, k, s, p, 1, out_shape)
    fast = kernel_map(x.coords, fast_out, k, s, p, 1)
    monkeypatch.setattr(kmap_module, "windows_tile", lambda *a: False)
    ref_out = output_coords(x.coords, k, s, p, 1, out_shape)
    ref = kernel_map(x.coords, ref_out, k, s, p, 1)
    assert torch.equal(fast_out, ref_out) and ref.num_pairs > 0
    assert torch.equal(fast.ptr, ref.ptr) and torch.equal(fast.in_rows, ref.in_rows)
    assert torch.equal(fast.out_rows, ref.out_rows)
    assert (fast.n_in, fast.n_out) == (ref.n_in, ref.n_out)
    if ks != (1, 1, 1) and ps == (0, 0, 0):
        assert ref.num_pairs < len(x.coords)  # some inputs fall in no full window
    sub = fast_out[::3]  # outputs given (a rank's own box): only their pairs
    ref_sub = kernel_map(x.coords, sub, k, s, p, 1)
    monkeypatch.undo()
    fast_sub = kernel_map(x.coords, sub, k, s, p, 1)
    assert torch.equal(fast_sub.ptr, ref_sub.ptr) and torch.equal(fast_sub.in_rows, ref_sub.in_rows)
    assert torch.equal(fast_sub.out_rows, ref_sub.out_rows)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (2, 2, 1), (3, 3, 2), ((2, 1, 3), (2, 1, 3), (1, 0, 0)),
                                   (3, 2, 1), (2, 1, 0)])
@pytest.mark.parametrize("n", [0, 1, 900])
def test_strided_map_equals_output_coords_then_kernel_map(gen, k, s, p, n):
    """One pass for tiling windows (the sort that finds the outputs numbers them), the two calls
    otherwise: the same outputs and the same pairs in the same CSR order, also where inputs fall
    in no full window, where none is left, and with no inputs; with the batch size given (int32
    keys, in the same order) as without."""
    shape = (15, 16, 13)
    x = random_cloud(gen, max(n, 1), shape=shape, batch=3)
    coords = x.coords[torch.randperm(len(x.coords), generator=gen)][:n]
    ks, ss, ps = (v if isinstance(v, tuple) else (v,) * 3 for v in (k, s, p))
    out_shape = tuple((m + 2 * pa - ka) // sa + 1 for m, ka, sa, pa in zip(shape, ks, ss, ps))
    edge = coords[(coords[:, 1:] >= 14).any(1)]  # edge voxels alone
    for c, batch_size in itertools.product((coords, edge), (None, 3)):
        out, km = strided_map(c, k, s, p, 1, out_shape, batch_size)
        ref_out = output_coords(c, k, s, p, 1, out_shape)
        ref = kernel_map(c, ref_out, k, s, p, 1)
        assert torch.equal(out, ref_out) and out.dtype == ref_out.dtype
        assert torch.equal(km.ptr, ref.ptr) and torch.equal(km.in_rows, ref.in_rows)
        assert torch.equal(km.out_rows, ref.out_rows) and km.in_rows.dtype == ref.in_rows.dtype
        assert (km.n_in, km.n_out) == (ref.n_in, ref.n_out)
        # Each pair's offset, which tiling windows keep from their sort, is the CSR's (its
        # transpose's too), int64 as repeat_interleave over ptr gives it.
        for m in (km, km.transpose()):
            offsets = m.pair_offsets()
            assert offsets.dtype == torch.int64
            assert torch.equal(offsets, torch.repeat_interleave(torch.arange(m.num_offsets),
                                                                m.ptr.diff()))


def test_strided_map_checks_the_batch_size_it_is_given(gen):
    """The batch size bounds the batch indices: a row beyond it is an error, not a key that
    wraps into another voxel's; a batch too large for int32 keys takes the int64 ones."""
    x = random_cloud(gen, 300, shape=(16, 16, 16), batch=2)
    with pytest.raises(ValueError, match=rf"1 of {len(x.coords)} input rows have a batch index "
                                         r"outside \[0, batch_size=2\)"):
        strided_map(torch.cat([x.coords[1:], x.coords.new_tensor([[2, 0, 0, 0]])]), 2, 2, 0, 1,
                    (8, 8, 8), batch_size=2)
    ref = strided_map(x.coords, 2, 2, 0, 1, (8, 8, 8))
    for batch_size in (2, 2**31 // 8**3):  # int32 keys; beyond them
        out, km = strided_map(x.coords, 2, 2, 0, 1, (8, 8, 8), batch_size=batch_size)
        assert torch.equal(out, ref[0]) and torch.equal(km.in_rows, ref[1].in_rows)
        assert torch.equal(km.out_rows, ref[1].out_rows) and torch.equal(km.ptr, ref[1].ptr)


def test_select_keeps_csr_by_offset(gen):
    x = random_cloud(gen, 500)
    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    keep = km.in_rows % 3 == 0
    sel = km.select(keep)
    for k in range(km.num_offsets):
        i, o = km.pairs(k)
        si, so = sel.pairs(k)
        m = i % 3 == 0
        assert torch.equal(si, i[m]) and torch.equal(so, o[m])


@pytest.mark.parametrize("k,d", [(3, 1), (3, 2), (5, 1)])
@pytest.mark.parametrize("pieces", [False, True])
def test_spconv_subm_map_equals_explicit_pairs(gen, k, d, pieces):
    """spconv's own submanifold indices and kernels (the new local path) against our kernel map,
    whole and in the two pieces an exchange's progress calls split it into (float64)."""
    from sparsepipe_hpc.engine.spconv_subm import SubmMap

    x = random_cloud(gen, 900)
    eng = get_engine("spconv")
    m = eng.subm_map(x.coords, x.spatial_shape, x.batch_size, k, d)
    assert isinstance(m, SubmMap) and not m.implicit_gemm and (m.n_in, m.n_out) == (m.n, m.n)
    km = kernel_map(x.coords, x.coords, k, 1, d * (k // 2), d)
    w = torch.randn(5, k ** 3, 4, dtype=torch.float64, generator=gen)
    g = torch.randn(km.n_out, 5, dtype=torch.float64, generator=gen)
    calls = []
    progress = (lambda: calls.append(1)) if pieces else None
    y = eng.forward(x.feats, w, m, progress)
    gi, gw = eng.backward(x.feats, w, g, m, progress)
    ref = get_engine("torch")
    torch.testing.assert_close(y, ref.forward(x.feats, w, km), rtol=1e-12, atol=1e-12)
    rgi, rgw = ref.backward(x.feats, w, g, km)
    torch.testing.assert_close(gi, rgi, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rgw, rtol=1e-12, atol=1e-12)
    assert len(calls) == (4 if pieces else 0)  # two pieces forward, two backward
    out = torch.ones_like(y)
    torch.testing.assert_close(eng.forward(x.feats, w, m, out=out), y + 1)
    acc = torch.ones_like(gi)
    gi2, _ = eng.backward(x.feats, w, g, m, grad_in=acc)
    torch.testing.assert_close(gi2, gi + 1)
    assert eng.subm_map(x.coords, x.spatial_shape, x.batch_size, 1, 1) is None  # 1x1: own map
    assert get_engine("torch").subm_map(x.coords, x.spatial_shape, x.batch_size, 3, 1) is None


@pytest.mark.parametrize("depth", [63, 256])
def test_a_subm_layer_on_a_grid_past_spconvs_cpu_index_equals_the_torch_engine(depth):
    """Two samples, the same 8 x 8 patch of a 4096 x 4096 x ``depth`` grid: at 256 the linear
    indices of the samples' voxels lie 2**32 apart, and spconv's CPU hash (int32) read sample 1's
    neighbours from sample 0 (0.52 off); the layer takes our own map from 2**31 on (63: below)."""
    from sparsepipe_hpc.nn.conv import SubMConv3d
    from sparsepipe_hpc.sparse import SparseTensor

    xs, ys = torch.meshgrid(torch.arange(100, 108), torch.arange(200, 208), indexing="ij")
    patch = torch.stack([xs.flatten(), ys.flatten(), torch.full((64,), 3)], 1)
    coords = torch.cat([torch.cat([torch.full((64, 1), b), patch], 1) for b in (0, 1)]).int()
    feats = torch.cat([torch.zeros(64, 4), torch.ones(64, 4)]).double()
    out = {}
    for engine in ENGINES:
        torch.manual_seed(1)
        conv = SubMConv3d(4, 2, 3, engine=engine).double()
        out[engine] = conv(SparseTensor(coords, feats, (4096, 4096, depth), 2)).feats
    torch.testing.assert_close(out["spconv"], out["torch"], rtol=1e-12, atol=1e-12)
    eng = get_engine("spconv")
    assert (eng.subm_map(coords, (4096, 4096, depth), 2, 3, 1) is None) == (depth > 63)


@pytest.mark.parametrize("k,d", [(3, 1), (3, 2), (5, 1)])
def test_spconv_subm_split_backward_equals_explicit_pairs(gen, monkeypatch, k, d):
    """The Native submanifold backward CUDA takes (SPLIT_BACKWARD: spconv's own allocates per
    offset there), run on the CPU against the torch engine on our kernel map (float64)."""
    import sparsepipe_hpc.engine.spconv_engine as se

    monkeypatch.setattr(se, "SPLIT_BACKWARD", ("cpu", "cuda"))
    x = random_cloud(gen, 900)
    eng = get_engine("spconv")
    m = eng.subm_map(x.coords, x.spatial_shape, x.batch_size, k, d)
    km = kernel_map(x.coords, x.coords, k, 1, d * (k // 2), d)
    w = torch.randn(5, k ** 3, 4, dtype=torch.float64, generator=gen)
    g = torch.randn(km.n_out, 5, dtype=torch.float64, generator=gen)
    calls: list = []
    gi, gw = eng.backward(x.feats, w, g, m, progress=lambda: calls.append(1))
    rgi, rgw = get_engine("torch").backward(x.feats, w, g, km)
    torch.testing.assert_close(gi, rgi, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rgw, rtol=1e-12, atol=1e-12)
    assert calls == [1]
    none, gw2 = eng.backward(x.feats, w, g, m, need_input_grad=False)
    assert none is None
    torch.testing.assert_close(gw2, rgw, rtol=1e-12, atol=1e-12)


def test_spconv_gets_bfloat16_as_float32_on_every_device():
    """spconv 2.3.8 has no bfloat16 (a CUDA bf16 tensor would raise KeyError in its dtype
    table), so bfloat16 calls compute in float32 on CUDA too; when spconv adds it, this says so."""
    from spconv.pytorch.cppcore import _TORCH_DTYPE_TO_TV

    from sparsepipe_hpc.engine.spconv_engine import native_dtype

    assert torch.bfloat16 not in _TORCH_DTYPE_TO_TV  # if this fails, spconv grew bf16: use it
    for dev in ("cpu", "cuda"):
        assert native_dtype(torch.bfloat16, torch.device(dev)) == torch.float32
        assert native_dtype(torch.float16, torch.device(dev)) == torch.float16
        assert native_dtype(torch.float32, torch.device(dev)) == torch.float32


def test_spconv_gathers_in_fp16_only_on_channels_its_cuda_kernels_take():
    """On CUDA, spconv's fp16 gather-GEMM-scatter takes channel counts that are multiples of 8
    (4 raised 'misaligned contiguous dim' on an H100): such calls compute in float32 there. Its
    implicit GEMM (no channels passed) and the CPU keep fp16."""
    from sparsepipe_hpc.engine.spconv_engine import native_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for channels, work in [((8, 16), torch.float16), ((4, 8), torch.float32),
                           ((32, 13), torch.float32), ((), torch.float16)]:
        assert native_dtype(torch.float16, cuda, channels) == work, channels
        assert native_dtype(torch.float16, cpu, channels) == torch.float16, channels
    assert native_dtype(torch.float32, cuda, (4, 3)) == torch.float32


def test_spconv_float64_on_cuda_is_a_clear_error():
    """spconv's CUDA build has no float64 GEMM kernels (its CPU path computes float64 in torch):
    a clear error naming the remedy instead of one from inside spconv's tuner."""
    from sparsepipe_hpc.engine.spconv_engine import SpconvDtypeError, native_dtype

    assert native_dtype(torch.float64, torch.device("cpu")) == torch.float64
    with pytest.raises(SpconvDtypeError, match=r"no float64 kernels on CUDA .* engine='torch'"):
        native_dtype(torch.float64, torch.device("cuda"))


def test_spconv_call_turns_autocast_off_and_takes_one_thread_on_the_cpu():
    """Around spconv's kernels autocast is off (it is on again after) and the CPU has one thread
    (restored after); outside autocast the block changes nothing else."""
    from sparsepipe_hpc.engine.spconv_engine import spconv_call

    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                with spconv_call(cpu):
                    assert not torch.is_autocast_enabled("cpu")
                    assert torch.get_num_threads() == 1
                assert torch.is_autocast_enabled("cpu") == autocast
                assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
