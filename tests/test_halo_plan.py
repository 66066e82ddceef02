"""Halo-plan index arithmetic without MPI: radii, send selection, kernel-map split, references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from halo.cuts import uniform_cuts
from halo.kmap import coord_keys, kernel_map
from halo.plan import (HaloPlan, PlanCache, PlanError, boundary_rows, halo_boxes, halo_radius,
                       interior_rows, select_sends)
from halo.reference import reference_halo, reference_neighbours, reference_owner
from halo.synth import boundary_cloud, uniform_cloud, with_batch


def reach(k, s, p, d, transposed):
    """Largest distance (input voxels) from an aligned input box to an input a box output reads."""
    lo_out, hi_out = (4 * s, 8 * s) if transposed else (4, 8)
    lo_in, hi_in = (4, 8) if transposed else (4 * s, 8 * s)
    inputs = []
    for o in range(lo_out, hi_out):
        for kk in range(k):
            if transposed:  # in * s - p + kk * d == o
                num = o + p - kk * d
                if num % s == 0:
                    inputs.append(num // s)
            else:
                inputs.append(o * s - p + kk * d)
    return max(0, lo_in - min(inputs), max(inputs) - (hi_in - 1))


@pytest.mark.parametrize("transposed", [False, True])
def test_halo_radius_is_the_exact_reach(transposed):
    for k, s, p, d in itertools.product((1, 2, 3, 5), (1, 2, 3), (0, 1, 2), (1, 2)):
        assert halo_radius(k, s, p, d, transposed) == reach(k, s, p, d, transposed), (k, s, p, d)
    assert halo_radius(3, padding=1) == 1 and halo_radius(2, 2) == 0
    assert halo_radius((3, 1, 5), 1, (1, 0, 2), 1) == 2  # the largest over the axes
    with pytest.raises(PlanError, match="must be >= 1"):
        halo_radius(0)


def test_halo_radius_covers_misaligned_boxes():
    """A box whose bounds sit m voxels past a multiple of the stride owns the outputs
    [lo // s, hi // s): the radius with ``misalign`` is the largest reach over every m."""
    for k, s, p, d, mis in itertools.product((1, 2, 3, 5), (1, 2, 3, 4), (0, 1, 2), (1, 2),
                                             range(4)):
        worst = 0
        for m_lo, m_hi in itertools.product(range(min(mis, s - 1) + 1), repeat=2):
            lo_in, hi_in = 4 * s + m_lo, 8 * s + m_hi
            inputs = [o * s - p + kk * d for o in range(lo_in // s, hi_in // s)
                      for kk in range(k)]
            worst = max(worst, lo_in - min(inputs), max(inputs) - (hi_in - 1))
        assert halo_radius(k, s, p, d, misalign=mis) == worst, (k, s, p, d, mis)
    with pytest.raises(PlanError, match="misalign"):
        halo_radius(2, 2, transposed=True, misalign=1)


def test_select_sends_matches_the_reference():
    rng = np.random.default_rng(3)
    cuts = uniform_cuts((24, 20, 16), (3, 2, 1), align=2)
    cloud = with_batch(np.unique(np.concatenate([uniform_cloud(rng, 700, cuts.extent),
                                                 boundary_cloud(rng, 300, cuts, 2)]), axis=0))
    owner = reference_owner(cloud[:, 1:].numpy(), cuts)
    me = (1, 0, 0)
    mine = cloud[torch.from_numpy((owner == me).all(1))]
    others = [c for c in itertools.product(range(3), range(2), range(1)) if c != me]
    for radius in (1, 2, 3):
        rows = select_sends(mine, [halo_boxes(cuts, c) for c in others], radius)
        for c, r in zip(others, rows):
            theirs = reference_halo(cloud, cuts, c, radius)
            want = theirs[torch.from_numpy((reference_owner(theirs[:, 1:].numpy(), cuts) ==
                                            me).all(1))]
            assert torch.equal(mine[r], want)  # same voxels, same (key) order


def test_batched_selection_equals_one_per_box():
    """A GPU selects every box's rows at once (one host sync, not one per box): the same rows,
    also with no rows at all."""
    from halo.plan import _rows_inside

    g = torch.Generator().manual_seed(0)
    order = torch.randperm(50, generator=g)
    masks = [torch.rand(50, generator=g) < p for p in (0.0, 0.3, 1.0, 0.5)]
    per_box = _rows_inside(order, masks, batched=False)
    batched = _rows_inside(order, masks, batched=True)
    assert [len(r) for r in per_box] == [len(r) for r in batched] and len(per_box[0]) == 0
    assert all(torch.equal(a, b) for a, b in zip(per_box, batched))
    none = _rows_inside(order[:0], [m[:0] for m in masks], batched=True)
    assert [len(r) for r in none] == [0] * 4


def test_reference_halo_covers_the_neighbour_search():
    rng = np.random.default_rng(4)
    cuts = uniform_cuts((16, 16, 16), (2, 2, 2))
    cloud = with_batch(uniform_cloud(rng, 600, cuts.extent))
    owner = reference_owner(cloud[:, 1:].numpy(), cuts)
    for me in [(0, 0, 0), (1, 0, 1)]:
        is_mine = torch.from_numpy((owner == me).all(1))
        for r in (1, 2):
            box_halo = coord_keys(reference_halo(cloud, cuts, me, r))
            needed = reference_neighbours(cloud, is_mine, r)
            assert bool(torch.isin(coord_keys(needed), box_halo).all())
    # Hand-checked: neighbours of (5, 5, 5) within 1, and another batch is never a neighbour.
    c = torch.tensor([[0, 5, 5, 5], [0, 6, 6, 6], [0, 7, 5, 5], [1, 5, 5, 6], [0, 4, 5, 4]]).int()
    got = reference_neighbours(c, torch.tensor([True, False, False, False, False]), 1)
    assert got.tolist() == [[0, 4, 5, 4], [0, 6, 6, 6]]


def hand_plan():
    """A rank with 6 local voxels on a line and 3 halo voxels beyond its right face (x = 6)."""
    local = torch.tensor([[0, x, 0, 0] for x in range(6)]).int()
    halo = torch.tensor([[0, 6, 0, 0], [0, 7, 0, 0], [0, 6, 1, 0]]).int()
    plan = HaloPlan(send_ranks=[1], send_rows=[torch.tensor([5, 4])], recv_ranks=[1],
                    recv_counts=[3], halo_coords=halo, num_local=6, radius=2)
    return plan, local, halo


def test_kernel_maps_split_local_and_halo_pairs():
    plan, local, halo = hand_plan()
    lm, hm = plan.kernel_maps(local, local, 3, padding=1)
    full = kernel_map(torch.cat([local, halo]), local, 3, padding=1)
    assert lm.n_in == 6 and hm.n_in == 3 and lm.n_out == hm.n_out == 6
    assert lm.num_pairs + hm.num_pairs == full.num_pairs
    for k in range(27):
        fi, fo = full.pairs(k)
        li, lo = lm.pairs(k)
        hi, ho = hm.pairs(k)
        assert torch.equal(torch.cat([li, hi + 6]).sort()[0], fi.sort()[0])
        assert sorted(zip((li).tolist(), lo.tolist())) == sorted(
            (i, o) for i, o in zip(fi.tolist(), fo.tolist()) if i < 6)
    # Only x = 5 touches (6, 0, 0) and (6, 1, 0); (7, 0, 0) is 2 away.
    assert boundary_rows(hm).tolist() == [5]
    assert interior_rows(hm).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(PlanError, match="built for 6 local rows"):
        plan.kernel_maps(local[:5], local, 3, padding=1)
    with pytest.raises(PlanError, match="needs the plan's cuts"):
        plan.owned_outputs(local, 3, 2, 1, 1, (4, 4, 4))


def test_subm_halo_map_looks_up_the_edge_rows_alone():
    """The halo part of a submanifold map from the edge rows' stencils equals the lookup of every
    row's, pair for pair (a plan without edge rows takes that lookup); a kernel reaching past
    the plan's radius is refused: its halo would miss voxels."""
    plan, local, halo = hand_plan()
    full = kernel_map(halo, local, 3, 1, 1, 1)
    for edge in (torch.tensor([4, 5]), None):
        plan.edge_rows = edge
        got = plan.subm_halo_map(local, 3)
        assert torch.equal(got.ptr, full.ptr) and torch.equal(got.in_rows, full.in_rows)
        assert torch.equal(got.out_rows, full.out_rows) and got.out_rows.tolist() == [5, 5]
        assert (got.n_in, got.n_out) == (3, 6)
        far = plan.subm_halo_map(local, 3, dilation=2)  # (6, 0, 0) from x = 4, (7, 0, 0) from 5
        assert far.out_rows.tolist() == [4, 5] and far.in_rows.tolist() == [0, 1]
        assert torch.equal(far.ptr, kernel_map(halo, local, 3, 1, 2, 2).ptr)
    with pytest.raises(PlanError, match=r"reaches 3 voxels; this plan's halo has radius 2"):
        plan.subm_halo_map(local, 7)
    with pytest.raises(PlanError, match="built for 6 local rows"):
        plan.subm_halo_map(local[:5], 3)


def test_plan_offsets_and_counts():
    plan, _, _ = hand_plan()
    assert plan.num_halo == 3 and plan.recv_offsets == [0, 3] and plan.send_counts == [2]


def test_plan_cache_checks_hits():
    built = []

    def builder(grid, cuts, coords, radius, stride, transport):
        built.append(radius)
        return HaloPlan([], [], [], [], torch.zeros(0, 4, dtype=torch.int32), len(coords),
                        stride, radius, (0, 0, 0), cuts)

    from mpi4py import MPI
    from types import SimpleNamespace

    grid = SimpleNamespace(comm=MPI.COMM_SELF, coords=(0, 0, 0))  # one rank agrees alone
    cuts = uniform_cuts((8, 8, 8), (1, 1, 1))
    coords = torch.zeros(3, 4, dtype=torch.int32)
    cache = PlanCache()
    a = cache.get_or_build("k", grid, cuts, coords, 1, builder=builder)
    assert cache.get_or_build("k", grid, cuts, coords, 1, builder=builder) is a and built == [1]
    assert "k" in cache and cache["k"] is a and len(cache) == 1
    with pytest.raises(PlanError, match="key 'k' holds a plan for 3 rows, radius 1, stride 1; "
                                        "asked for 2 rows"):
        cache.get_or_build("k", grid, cuts, coords[:2], 1, builder=builder)
    moved = coords.clone()
    moved[0, 1] = 5  # the same count of other voxels: the old plan exchanged the wrong rows
    with pytest.raises(PlanError, match="asked for 3 rows, radius 1, stride 1, other voxels"):
        cache.get_or_build("k", grid, cuts, moved, 1, builder=builder)
    assert cache.get_or_build("k", grid, cuts, coords.clone(), 1, builder=builder) is a
    cache.clear()
    assert len(cache) == 0


def test_key_batch_reads_the_batch_column_of_a_key():
    from halo.kmap import coord_keys, key_batch

    g = torch.Generator().manual_seed(0)
    coords = torch.cat([torch.randint(0, 256, (50, 1), generator=g),
                        torch.randint(-(1 << 17), 1 << 17, (50, 3), generator=g)], 1).int()
    assert torch.equal(key_batch(coord_keys(coords)), coords[:, 0].long())
