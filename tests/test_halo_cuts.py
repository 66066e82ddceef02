"""Cuts without MPI: contract checks, uniform and quantile cuts, alignment, locate, thickness."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from halo.cuts import CutError, Cuts, axis_histograms, cuts_from_histograms, uniform_cuts
from halo.reference import reference_owner
from halo.synth import clustered_cloud


def test_uniform_cuts_are_aligned_and_cover_the_extent():
    c = uniform_cuts((100, 64, 9), (3, 2, 1), align=8)
    assert [b.tolist() for b in c.bounds] == [[0, 32, 64, 100], [0, 32, 64], [0, 9]]
    assert c.dims == (3, 2, 1) and c.extent == (100, 64, 9) and c.align == 8
    for d in range(1, 13):
        b = uniform_cuts((97, 97, 97), (d, 1, 1), align=4).bounds[0]
        assert b[0] == 0 and b[-1] == 97 and np.all(b[1:-1] % 4 == 0) and np.all(np.diff(b) > 0)


def test_uniform_cuts_refuse_more_boxes_than_units():
    with pytest.raises(CutError, match="axis y: extent 20 voxels is 3 unit\\(s\\) of align 8, "
                                       "too few for 4 boxes"):
        uniform_cuts((64, 20, 8), (1, 4, 1), align=8)


@pytest.mark.parametrize("bounds, msg", [
    (([0, 4, 2, 8], [0, 8], [0, 8]), "must not decrease"),
    (([1, 8], [0, 8], [0, 8]), "must run from 0"),
    (([0, 3, 8], [0, 8], [0, 8]), "multiples of align=2"),
    (([0, 8], [0, 8]), "needs 3"),
    (([0, 2, 65538], [0, 8], [0, 8]), "has an axis of 65538 voxels; at most 65536 per axis"),
])
def test_cuts_contract(bounds, msg):
    with pytest.raises(CutError, match=msg):
        Cuts(tuple(np.array(b) for b in bounds), align=2)


def test_cuts_are_frozen_hashable_and_comparable():
    a = uniform_cuts((16, 16, 16), (2, 2, 1), 4)
    b = Cuts(tuple(np.array(x) for x in ([0, 8, 16], [0, 8, 16], [0, 16])), 4)
    assert a == b and hash(a) == hash(b) and a != uniform_cuts((16, 16, 16), (2, 2, 1), 2)
    with pytest.raises(ValueError):
        a.bounds[0][1] = 4


def test_box_at_strides():
    c = Cuts((np.array([0, 8, 16, 21]), np.array([0, 21]), np.array([0, 4])), align=8)
    assert [v.tolist() for v in c.box((1, 0, 0))] == [[8, 0, 0], [16, 21, 4]]
    assert [v.tolist() for v in c.box((2, 0, 0), stride=4)] == [[4, 0, 0], [6, 6, 1]]  # ceil
    with pytest.raises(CutError, match="outside the cuts' grid"):
        c.box((3, 0, 0))


def test_locate_matches_box_scan_numpy_and_torch():
    rng = np.random.default_rng(0)
    c = Cuts((np.array([0, 4, 4, 12, 20]), np.array([0, 6, 20]), np.array([0, 20])), align=2)
    xyz = rng.integers(-3, 24, size=(500, 3))  # outside the extent too: clamped to edge boxes
    got = c.locate(xyz)
    assert got.dtype == np.int64 and np.array_equal(got, reference_owner(xyz, c))
    assert 1 not in got[:, 0]  # the zero-width box [4, 4) owns nothing
    t = c.locate(torch.from_numpy(xyz).int())
    assert t.dtype == torch.int64 and np.array_equal(t.numpy(), got)
    for s in (2, 4):
        np.testing.assert_array_equal(c.locate(xyz // s, stride=s), reference_owner(xyz // s, c, s))
    with pytest.raises(CutError, match="pass coords\\[:, 1:\\]"):
        c.locate(np.zeros((3, 4), np.int64))


def test_count():
    c = uniform_cuts((8, 8, 8), (2, 2, 2))
    xyz = np.array([[0, 0, 0], [7, 7, 7], [7, 7, 6], [3, 4, 0]])
    n = c.count(xyz)
    assert n.shape == (2, 2, 2) and n[0, 0, 0] == 1 and n[1, 1, 1] == 2 and n[0, 1, 0] == 1


def test_misalignment():
    cuts = Cuts(([0, 9, 16], [0, 16], [0, 4, 12, 16]))
    assert cuts.misalignment(2) == 1           # 9 is odd
    assert cuts.misalignment(4) == 1           # 9 % 4
    assert cuts.misalignment(8) == 4           # 12 % 8 is the worst
    assert cuts.misalignment(2, stride=2) == 0  # at stride 2 the cuts are 4, 2, 6
    assert cuts.misalignment(4, stride=2) == 2
    assert Cuts(([0, 5], [0, 5], [0, 5])).misalignment(2) == 0  # no interior cut
    assert uniform_cuts((64, 64, 64), (3, 2, 1), align=8).misalignment(8) == 0
    with pytest.raises(CutError, match="factor 0"):
        cuts.misalignment(0)


@pytest.mark.parametrize("s,stride", [(2, 1), (2, 2), (3, 1), (2, 4)])
def test_tiling_windows_from_aligned_cuts_keep_their_outputs_in_the_box(s, stride):
    """What lets a distributed k2s2 layer on aligned cuts skip its ownership test (a device
    sync): with interior cuts multiples of ``stride * s``, the outputs of a box's inputs under
    windows of size and stride ``s`` (no padding) all lie in that box, at the output stride."""
    from halo.kmap import strided_map

    gen = torch.Generator().manual_seed(s * 10 + stride)
    shape = (24, 30, 18)  # voxels at ``stride``
    cuts = Cuts(tuple(np.array([0, *sorted(set(int(v) * stride * s for v in
                                                   torch.randint(1, n // s, (2,), generator=gen))),
                                n * stride]) for n in shape), align=stride * s)
    assert cuts.misalignment(s, stride) == 0
    coords = torch.cat([torch.randint(0, 2, (3000, 1), generator=gen),
                        torch.stack([torch.randint(0, n, (3000,), generator=gen) for n in shape],
                                    1)], 1).unique(dim=0).int()
    where = cuts.locate(coords[:, 1:], stride=stride)
    for box in {tuple(w) for w in where.tolist()}:
        mine = coords[(where == torch.tensor(box)).all(1)]
        out, _ = strided_map(mine, s, s, 0, 1, [n // s for n in shape])
        assert len(out) and (cuts.locate(out[:, 1:], stride=stride * s) == torch.tensor(box)).all()


def test_thickness_rule():
    # x: boxes 2, 6, 1, 7 thick; y: 3, 3; z: one box of 8.
    c = Cuts((np.array([0, 2, 8, 10, 16]), np.array([0, 2, 4]), np.array([0, 8])), align=2)
    c.check_thickness(1)
    with pytest.raises(CutError, match="box 2 along axis x is \\[8, 10\\), 2 voxels thick at "
                                       "stride 1 .* thinner than the halo radius 3"):
        c.check_thickness(3)  # box 0 (2 thick) is fine: nothing lies beyond it
    c.check_thickness(2)
    with pytest.raises(CutError, match="box 2 along axis x is \\[4, 5\\), 1 voxels thick at stride 2"):
        c.check_thickness(2, stride=2)
    c.check_thickness(0)
    edge = Cuts((np.array([0, 0, 8, 8]), np.array([0, 8]), np.array([0, 8])), align=2)
    edge.check_thickness(5)  # empty first and last boxes are harmless
    mid = Cuts((np.array([0, 4, 4, 8]), np.array([0, 8]), np.array([0, 8])), align=2)
    with pytest.raises(CutError, match="box 1 along axis x is \\[4, 4\\), 0 voxels thick"):
        mid.check_thickness(1)  # an empty interior box would need a two-hop exchange
    mid.check_thickness(0)


def test_histograms_and_range_errors():
    xyz = np.array([[0, 0, 0], [5, 1, 9], [9, 2, 9]])
    h = axis_histograms(xyz, (10, 3, 10), align=4)
    assert [x.tolist() for x in h] == [[1, 1, 1], [3], [1, 0, 2]]
    with pytest.raises(CutError, match="row 1 is \\[5, 3, 9\\], outside the extent \\(10, 3, 10\\)"):
        axis_histograms(np.array([[0, 0, 0], [5, 3, 9]]), (10, 3, 10))
    with pytest.raises(CutError, match="expected \\[N, 3\\]"):
        axis_histograms(np.zeros((2, 4)), (10, 3, 10))


@pytest.mark.parametrize("bad", [[5, 3, 9], [-1, 0, 0], [0, 0, 10]])
def test_histograms_of_a_tensor_are_counted_where_it_lives_and_equal_numpys(bad):
    rng = np.random.default_rng(0)
    xyz = rng.integers(0, (37, 3, 20), size=(400, 3))
    for align, axes in [(1, (0, 1, 2)), (4, (0, 1, 2)), (4, (0, 2)), (3, ())]:
        ours = axis_histograms(torch.from_numpy(xyz).int(), (37, 3, 20), align, axes)
        ref = axis_histograms(xyz, (37, 3, 20), align)
        for a in range(3):  # an axis left out comes back as zeros of its length
            assert ours[a].tolist() == (ref[a] if a in axes else 0 * ref[a]).tolist(), (align, a)
    # Outside the extent: the same error as the host path's, naming the first such row.
    with pytest.raises(CutError, match=re.escape(f"row 1 is {bad}, outside the extent")):
        axis_histograms(torch.tensor([[0, 0, 0], bad, [1, 1, 1]]), (10, 3, 10))


def _imbalance(cuts, xyz):
    n = cuts.count(xyz)
    return n.max() / n.mean()


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_quantile_slabs_balance_a_clustered_cloud(n):
    rng = np.random.default_rng(n)
    extent = (1024, 64, 64)
    xyz = clustered_cloud(rng, 50000, (600, 64, 64), clusters=3, spread=0.05)
    hist = axis_histograms(xyz, extent, align=2)
    bal = cuts_from_histograms(hist, extent, (n, 1, 1), align=2)
    slice_share = hist[0].max() / (len(xyz) / n)
    assert _imbalance(uniform_cuts(extent, (n, 1, 1), 2), xyz) > 1.5
    assert _imbalance(bal, xyz) <= 1 + slice_share
    assert _imbalance(bal, xyz) <= 1.10


def test_quantile_cuts_respect_min_width_and_split_empty_space():
    hist = [np.array([0] * 10 + [100] + [0] * 9), np.ones(4, np.int64), np.ones(1, np.int64)]
    c = cuts_from_histograms(hist, (80, 16, 4), (3, 2, 1), align=4, min_width=8)
    b = c.bounds[0]
    assert np.all(np.diff(b) >= 8) and np.all(b % 4 == 0)
    # One dense unit at [40, 44): it cannot be split, so the cuts share out the empty space.
    assert b.tolist() == [0, 20, 60, 80]
    assert c.bounds[1].tolist() == [0, 8, 16]
    # No voxels at all: uniform cuts.
    empty = [np.zeros(20, np.int64), np.zeros(4, np.int64), np.zeros(1, np.int64)]
    assert cuts_from_histograms(empty, (80, 16, 4), (4, 1, 1), 4) == uniform_cuts((80, 16, 4),
                                                                                  (4, 1, 1), 4)
    # Two voxel groups far apart: the cut lands mid-way through the empty space between them.
    gap = [np.array([5, 0, 0, 0, 0, 0, 0, 5]), np.ones(1, np.int64), np.ones(1, np.int64)]
    assert cuts_from_histograms(gap, (8, 1, 1), (2, 1, 1)).bounds[0].tolist() == [0, 4, 8]
    with pytest.raises(CutError, match="too few for 3 boxes of at least 32 voxels"):
        cuts_from_histograms(hist, (80, 16, 4), (3, 1, 1), align=4, min_width=32)


def test_weighted_cuts_give_shares_proportional_to_the_weights():
    # 120 voxels, one per unit of x: weights 2 : 1 cut at 80 (2/3), weights 1 : 1 : 2 at 30, 60.
    hists = [np.ones(120, np.int64), np.array([120]), np.array([120])]
    c = cuts_from_histograms(hists, (120, 1, 1), (2, 1, 1), weights=[[2, 1], None, None])
    assert c.bounds[0].tolist() == [0, 80, 120]
    c = cuts_from_histograms(hists, (120, 1, 1), (3, 1, 1), weights=[[1.0, 1.0, 2.0], None, None])
    assert c.bounds[0].tolist() == [0, 30, 60, 120]
    # Equal weights are the unweighted cuts, on a lumpy cloud too.
    xyz = np.random.default_rng(3).integers(0, (64, 48, 32), size=(3000, 3)) ** 2 // (64, 48, 32)
    h = axis_histograms(xyz, (64, 48, 32), 4)
    plain = cuts_from_histograms(h, (64, 48, 32), (4, 3, 2), 4)
    same = cuts_from_histograms(h, (64, 48, 32), (4, 3, 2), 4, weights=[[3] * 4, [1] * 3, None])
    assert all(np.array_equal(p, q) for p, q in zip(plain.bounds, same.bounds))


def test_weighted_cuts_respect_alignment_and_min_width():
    hists = [np.ones(16, np.int64), np.array([8]), np.array([8])]   # 16 units of 8 voxels
    c = cuts_from_histograms(hists, (128, 8, 8), (2, 1, 1), 8, weights=[[1000, 1], None, None])
    assert c.bounds[0].tolist() == [0, 120, 128]   # the light box keeps its one unit


@pytest.mark.parametrize("weights, msg", [
    ([[1, 1]], "weights has 1 entries; give one per axis"),
    ([[1, 1, 1], None, None], r"weights\[0\] \(x\) is \[1, 1, 1\]; it must hold 2 finite"),
    ([None, [0.0], None], r"weights\[1\] \(y\) is \[0.0\]; it must hold 1 finite numbers > 0"),
    ([[1, float("nan")], None, None], "finite numbers > 0"),
])
def test_weighted_cuts_refuse_bad_weights(weights, msg):
    hists = [np.ones(16, np.int64), np.array([8]), np.array([8])]
    with pytest.raises(CutError, match=msg):
        cuts_from_histograms(hists, (16, 8, 8), (2, 1, 1), weights=weights)
