"""Process grids and halo plans under mpirun: halos equal a serial brute-force neighbour search.

Every rank builds the same global cloud from the test's seed, keeps the voxels it owns, and
checks its own plan against the serial reference (so no rank needs another's answer).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import halo
from halo.kmap import MAX_BATCH, MAX_EXTENT, coord_keys, kernel_map, output_coords
from halo.reference import reference_halo, reference_neighbours, reference_owner
from halo.synth import boundary_cloud, clustered_cloud, with_batch

GRIDS = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1)]
EXTENT = (40, 36, 32)


def make_grid(comm, dims):
    if dims is not None and int(np.prod(dims)) != comm.size:
        pytest.skip(f"grid {dims} needs {int(np.prod(dims))} ranks")
    return halo.ProcessGrid(comm, dims)


def global_cloud(rng, cuts, radius, empty_box=True):
    """Clustered voxels + voxels on faces/edges/corners, 2 batches, one box emptied."""
    xyz = np.unique(np.concatenate([clustered_cloud(rng, 1500, EXTENT, clusters=2, spread=0.1),
                                    boundary_cloud(rng, 800, cuts, radius=radius + 1)]), axis=0)
    coords = torch.cat([with_batch(xyz, 0), with_batch(xyz[::3], 1)])
    if empty_box and int(np.prod(cuts.dims)) > 1:
        victim = rng.integers(0, 3, size=3) % np.array(cuts.dims)
        keep = ~(reference_owner(coords[:, 1:].numpy(), cuts) == victim).all(1)
        coords = coords[torch.from_numpy(keep)]
    return coords[torch.sort(coord_keys(coords))[1]]


def owned(grid, cuts, coords, stride=1):
    return coords[halo.owner_ranks(grid, cuts, coords, stride) == grid.rank]


def keyset(coords):
    return torch.sort(coord_keys(coords))[0]


@pytest.mark.parametrize("dims", GRIDS + [None])
def test_grid(comm, dims):
    grid = make_grid(comm, dims)
    assert int(np.prod(grid.dims)) == comm.size
    assert tuple(grid.comm.Get_coords(grid.rank)) == grid.coords
    for c in itertools.product(*(range(d) for d in grid.dims)):
        assert grid.rank_of(c) == grid.comm.Get_cart_rank(list(c))
        assert grid.coords_of(grid.rank_of(c)) == c
    nbrs = grid.neighbours()
    expect = np.prod([1 + (c > 0) + (c < d - 1) for c, d in zip(grid.coords, grid.dims)]) - 1
    assert len(nbrs) == expect
    for r, d in nbrs:
        assert grid.coords_of(r) == tuple(a + b for a, b in zip(grid.coords, d))


def test_grid_error_on_every_rank(comm):
    with pytest.raises(halo.GridError, match=f"has {comm.size + 1} ranks but the communicator "
                                             f"has {comm.size}"):
        halo.ProcessGrid(comm, (comm.size + 1, 1, 1))


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("radius", [1, 2])
@pytest.mark.parametrize("dims", GRIDS)
def test_halo_equals_brute_force(comm, rng, dims, radius, balanced):
    grid = make_grid(comm, dims)
    cuts = halo.uniform_cuts(EXTENT, grid.dims, align=2)
    cloud = global_cloud(rng, cuts, radius)
    if balanced:  # each rank contributes a strided share; the cuts must not depend on the split
        cuts = halo.balanced_cuts(grid.comm, cloud[grid.rank::grid.size, 1:], EXTENT, grid.dims,
                                  align=2, min_width=max(2, radius))
    mine = owned(grid, cuts, cloud)
    plan = halo.build_plan(grid, cuts, mine, radius)

    expect = reference_halo(cloud, cuts, grid.coords, radius)
    assert torch.equal(keyset(plan.halo_coords), keyset(expect))
    # The halo holds every voxel a radius-r stencil of an owned voxel touches.
    is_mine = halo.owner_ranks(grid, cuts, cloud) == grid.rank
    needed = reference_neighbours(cloud, is_mine, radius)
    assert bool(torch.isin(coord_keys(needed), coord_keys(plan.halo_coords)).all())
    # Block structure: ascending ranks, each block from its owner and sorted by key.
    assert plan.recv_ranks == sorted(plan.recv_ranks) and 0 not in plan.recv_counts
    offs = plan.recv_offsets
    for i, r in enumerate(plan.recv_ranks):
        block = plan.halo_coords[offs[i]:offs[i + 1]]
        assert bool((halo.owner_ranks(grid, cuts, block) == r).all())
        k = coord_keys(block)
        assert bool((k[1:] > k[:-1]).all())
    # Send blocks that are a run of rows (a slice), read with the counts: as read on their own.
    assert plan.send_runs is not None and len(plan.send_runs) == len(plan.send_rows)
    for run, rows in zip(plan.send_runs, plan.send_rows):
        consecutive = bool((rows[1:] - rows[:-1] == 1).all())
        assert run == ((int(rows[0]), int(rows[0]) + len(rows)) if consecutive else None)
    # What I send rank j is what the reference says j receives from me, in j's order.
    for r, rows in zip(plan.send_ranks, plan.send_rows):
        theirs = reference_halo(cloud, cuts, grid.coords_of(r), radius)
        from_me = theirs[halo.owner_ranks(grid, cuts, theirs) == grid.rank]
        assert torch.equal(mine[rows], from_me)
    assert plan.num_local == len(mine)


CONVS = [  # kernel, stride, padding, dilation
    (3, 1, 1, 1),   # submanifold 3x3x3
    (3, 1, 2, 2),   # submanifold, dilated
    (3, 2, 1, 1),   # strided, padded
    (2, 2, 0, 1),   # down-sampling: no halo at all when cuts are stride-aligned
]


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("dims", GRIDS)
def test_kernel_maps_match_serial(comm, rng, dims, conv):
    """local pairs + halo pairs == the serial kernel map restricted to this rank's outputs."""
    k, s, p, d = conv
    grid = make_grid(comm, dims)
    cuts = halo.uniform_cuts(EXTENT, grid.dims, align=2)
    radius = halo.halo_radius(k, s, p, d)
    cloud = global_cloud(rng, cuts, radius)
    mine = owned(grid, cuts, cloud)
    plan = halo.build_plan(grid, cuts, mine, radius)
    out_shape = [(e + 2 * p - d * (k - 1) - 1) // s + 1 for e in EXTENT]
    if s == 1:
        g_out, my_out = cloud, mine  # submanifold: outputs are the inputs
    else:
        g_out = output_coords(cloud, k, s, p, d, out_shape)
        my_out = plan.owned_outputs(mine, k, s, p, d, out_shape)
        assert torch.equal(my_out, owned(grid, cuts, g_out, stride=s))
    local_map, halo_map = plan.kernel_maps(mine, my_out, k, s, p, d)

    def triples(km, in_coords, out_coords):
        ks = torch.repeat_interleave(torch.arange(km.num_offsets), km.ptr[1:] - km.ptr[:-1])
        t = torch.stack([coord_keys(in_coords[km.in_rows]), coord_keys(out_coords[km.out_rows]),
                         ks], 1)
        return t[torch.from_numpy(np.lexsort(t.numpy().T[::-1].copy()))] if len(t) else t

    got = torch.cat([triples(local_map, mine, my_out),
                     triples(halo_map, plan.halo_coords, my_out)])
    got = got[torch.from_numpy(np.lexsort(got.numpy().T[::-1].copy()))]
    serial = kernel_map(cloud, g_out, k, s, p, d)
    full = triples(serial, cloud, g_out)
    full = full[torch.isin(full[:, 1], coord_keys(my_out))]
    assert torch.equal(got, full)
    if s == 2 and k == 2:
        assert halo_map.num_pairs == 0
    if s == 1:  # the edge rows' stencils alone give the same halo part, pair for pair
        edge = plan.subm_halo_map(mine, k, d)
        assert torch.equal(edge.ptr, halo_map.ptr) and torch.equal(edge.in_rows, halo_map.in_rows)
        assert torch.equal(edge.out_rows, halo_map.out_rows)
        assert (edge.n_in, edge.n_out) == (halo_map.n_in, halo_map.n_out)
        assert torch.equal(plan.edge_rows, torch.unique(torch.cat([mine.new_zeros(0).long(),
                                                                   *plan.send_rows])))
    # Boundary rows are exactly the outputs with an input owned elsewhere.
    boundary = halo.boundary_rows(halo_map)
    interior = halo.interior_rows(halo_map)
    assert len(boundary) + len(interior) == len(my_out)
    remote_in = ~torch.isin(full[:, 0], coord_keys(mine))
    want = torch.unique(full[remote_in, 1])
    assert torch.equal(torch.sort(coord_keys(my_out[boundary]))[0], want)


@pytest.mark.parametrize("dims", GRIDS)
def test_empty_ranks(comm, rng, dims):
    """All voxels in one corner box: the other ranks own nothing, yet plans work."""
    grid = make_grid(comm, dims)
    cuts = halo.uniform_cuts(EXTENT, grid.dims, align=2)
    lo, hi = cuts.box((0, 0, 0))
    xyz = np.unique(rng.integers(lo, hi, size=(300, 3)), axis=0)
    cloud = with_batch(xyz)
    mine = owned(grid, cuts, cloud)
    assert len(mine) == (len(cloud) if grid.rank == 0 else 0)
    plan = halo.build_plan(grid, cuts, mine, 1)
    assert torch.equal(keyset(plan.halo_coords), keyset(reference_halo(cloud, cuts, grid.coords, 1)))
    if grid.rank == 0:
        assert plan.num_halo == 0


def test_thin_box_error_on_every_rank(comm):
    if comm.size < 3:
        pytest.skip("needs an interior box: 3 or more ranks")
    grid = halo.ProcessGrid(comm, (comm.size, 1, 1))
    x = [0] + [2 * (i + 1) for i in range(comm.size - 1)] + [40]  # interior boxes 2 voxels thick
    cuts = halo.Cuts((np.array(x), np.array([0, 8]), np.array([0, 8])), align=2)
    with pytest.raises(halo.CutError, match="box 1 along axis x is \\[2, 4\\), 2 voxels thick"):
        halo.build_plan(grid, cuts, torch.zeros(0, 4, dtype=torch.int32), radius=3)
    halo.build_plan(grid, cuts, owned(grid, cuts, with_batch(np.array([[1, 1, 1]]))), radius=2)


def test_foreign_rows_error_on_every_rank(comm):
    grid = halo.ProcessGrid(comm, (comm.size, 1, 1))
    cuts = halo.uniform_cuts(EXTENT, grid.dims)
    coords = owned(grid, cuts, with_batch(np.array([[1, 1, 1], [39, 2, 2]])))
    if grid.rank == 0:
        coords = with_batch(np.array([[39, 2, 2]]))  # rank 0 claims a voxel of the last box
    if comm.size == 1:
        coords = with_batch(np.array([[40, 2, 2]]))  # outside the extent: still the last box's
        halo.build_plan(grid, cuts, coords, 1)
        return
    with pytest.raises(halo.PlanError, match="rank 0: coords row 0|another rank passed bad"):
        halo.build_plan(grid, cuts, coords, 1)


def test_ranks_passing_different_cuts_radius_or_stride_raise_everywhere(comm):
    """Each rank would plan with its own arguments: exchanges that do not match, or (a thin box
    in one rank's cuts only) one rank raising alone while the others wait."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    grid = halo.ProcessGrid(comm, (comm.size, 1, 1))
    cuts = halo.uniform_cuts(EXTENT, grid.dims, align=4)
    none = torch.zeros(0, 4, dtype=torch.int32)
    # Rank 0's cuts: boxes 1 voxel thick from 3 ranks on (thinner than the radius), else moved.
    x = [0, *range(1, comm.size), 40] if comm.size > 2 else [0, 12, 40]
    other = halo.Cuts((np.array(x), np.array([0, 36]), np.array([0, 32])))
    for args in [dict(cuts=other if grid.rank == 0 else cuts, radius=2),
                 dict(cuts=cuts, radius=2 if grid.rank == 0 else 1),
                 dict(cuts=cuts, radius=1, stride=2 if grid.rank == 0 else 1)]:
        with pytest.raises(halo.PlanError, match="ranks passed different arguments; here cuts"):
            halo.build_plan(grid, coords=none, **args)
    plan = halo.build_plan(grid, cuts, none, 1)  # still in step afterwards
    assert plan.num_halo == 0


def test_rows_the_voxel_keys_cannot_hold_raise_everywhere(comm):
    grid = halo.ProcessGrid(comm, (comm.size, 1, 1))
    cuts = halo.uniform_cuts(EXTENT, grid.dims)
    mine = owned(grid, cuts, with_batch(np.array([[1, 1, 1], [39, 2, 2]])))
    for row in ([MAX_BATCH, 1, 1, 1], [0, 1, 1, -MAX_EXTENT - 1]):
        coords = torch.tensor([row], dtype=torch.int32) if grid.rank == 0 else mine
        with pytest.raises(halo.PlanError, match="rank 0: coords row 0 is .*: batch indices "
                           "must lie in \\[0, 256\\)|another rank passed bad"):
            halo.build_plan(grid, cuts, coords, 1)


def test_plan_cache(comm, rng):
    grid = halo.ProcessGrid(comm)
    cuts = halo.uniform_cuts(EXTENT, grid.dims)
    cloud = global_cloud(rng, cuts, 1, empty_box=False)
    mine = owned(grid, cuts, cloud)
    cache = halo.PlanCache()
    p1 = cache.get_or_build("subm1", grid, cuts, mine, radius=1)
    assert cache.get_or_build("subm1", grid, cuts, mine, radius=1) is p1  # a hit: no rebuild
    p2 = cache.get_or_build("subm2", grid, cuts, mine, radius=2)
    assert len(cache) == 2 and p2 is not p1 and p2.num_halo >= p1.num_halo
    with pytest.raises(halo.PlanError, match="key 'subm1' holds a plan for"):
        cache.get_or_build("subm1", grid, cuts, mine, radius=2)
    if comm.size > 1:  # the last rank's rows changed alone: it raised, the others waited
        fewer = mine[:-1] if comm.rank == comm.size - 1 and len(mine) else mine
        if comm.allreduce(int(len(fewer) != len(mine))):
            with pytest.raises(halo.PlanError, match="holds a plan for|another rank's request"):
                cache.get_or_build("subm1", grid, cuts, fewer, radius=1)
        if comm.rank == 0:
            cache.clear()  # rank 0 misses where the others hit
        with pytest.raises(halo.PlanError, match="use the plan cache differently"):
            cache.get_or_build("subm2", grid, cuts, mine, radius=2)
