"""Distributed input under mpirun: each rank holds part of the points; the voxels of its box must
equal the single-process voxelization exactly (coords, features, labels, point->voxel maps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import halo
from sparsepipe_hpc.parallel.spatial import SpatialGroup
from sparsepipe_hpc.parallel.voxelize import distributed_voxelize
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.voxelize import VoxelizeError, voxelize

VOXEL = 0.125  # binary-exact, so that points on voxel faces are exactly on them
ORIGIN = (-0.5, 0.25, -1.0)
SHAPE = (16, 12, 8)
CLASSES = 5


def grids(n):
    out = {(n, 1, 1), (1, n, 1), (1, 1, n)}
    if n == 4:
        out |= {(2, 2, 1), (1, 2, 2)}
    return sorted(out)


ALL_GRIDS = sorted({g for n in (1, 2, 3, 4) for g in grids(n)})


def need(comm, dims):
    if int(np.prod(dims)) != comm.size:
        pytest.skip(f"grid {dims} needs {int(np.prod(dims))} ranks")


def make_cloud(rng, n, corner=False, faces=False):
    """float64 [n, 3] points in the grid, float32 [n, 3] features of wildly mixed magnitudes,
    int64 [n] labels; ``corner``: all in one corner (other boxes empty); ``faces``: points on
    voxel faces (exact multiples of the voxel size) and on the grid's cut planes."""
    lo = np.array(ORIGIN)
    span = np.array(SHAPE) * VOXEL
    if corner:
        pts = lo + rng.uniform(0, 0.24, (n, 3)) * span
    else:
        centres = lo + rng.uniform(0, 1, (6, 3)) * span
        pts = centres[rng.integers(0, 6, n)] + rng.normal(0, 0.15, (n, 3))
        pts = np.clip(pts, lo, lo + span - 1e-4)
    if faces:  # voxel faces: quantization at the boundary itself; half-way planes: cut planes
        m = n // 3
        vox = rng.integers(0, np.array(SHAPE), (m, 3))
        vox[: m // 2, 0] = SHAPE[0] // 2
        vox[m // 2:, 1] = SHAPE[1] // 2
        pts[:m] = lo + vox * VOXEL
    pts = pts.astype(np.float32).astype(np.float64)  # what a file holds
    feats = (rng.standard_normal((n, 3)) * 10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)
    labels = rng.integers(0, CLASSES, n)
    return pts, feats, labels


def serial(samples):
    vox = [voxelize(p, f, VOXEL, ORIGIN, SHAPE, labels=l, num_classes=CLASSES)
           for p, f, l in samples]
    x = SparseTensor.from_voxels(vox, SHAPE)
    offsets = np.cumsum([0] + [len(v.coords) for v in vox])
    return x, torch.cat([v.labels for v in vox]), [v.point_to_voxel for v in vox], offsets


def split(rng, comm, samples, how):
    """This rank's points of every sample: ``contiguous`` index ranges or a ``random`` split."""
    b, pts, fts, lab, idx = [], [], [], [], []
    for s, (p, f, l) in enumerate(samples):
        n = len(p)
        if how == "contiguous":
            r = comm.rank
            mine = np.arange(r * n // comm.size, (r + 1) * n // comm.size)
        else:
            mine = np.nonzero(rng.integers(0, comm.size, n) == comm.rank)[0]
        b.append(np.full(len(mine), s))
        pts.append(p[mine]), fts.append(f[mine]), lab.append(l[mine]), idx.append(mine)
    cat = lambda xs: torch.from_numpy(np.concatenate(xs))  # noqa: E731
    return cat(b), cat(pts), cat(fts), cat(lab), cat(idx)


def check_equal(comm, grid, v, samples, mine_idx, mine_b):
    x, labels, ptv, offsets = serial(samples)
    owned = halo.owner_ranks(grid, v.cuts, x.coords) == grid.rank
    assert torch.equal(v.coords, x.coords[owned])
    assert torch.equal(v.feats, x.feats[owned])  # bit-exact, not allclose
    assert torch.equal(v.labels, labels[owned])
    # Point -> voxel: (owner, row) names the same voxel as the serial map.
    every = comm.allgather(v.coords)
    got = torch.stack([every[int(o)][int(r)] for o, r in zip(v.point_owner, v.point_row)]) \
        if len(mine_idx) else torch.zeros(0, 4, dtype=torch.int32)
    want = torch.stack([x.coords[int(offsets[int(b)]) + int(ptv[int(b)][int(i)])]
                        for b, i in zip(mine_b, mine_idx)]) \
        if len(mine_idx) else torch.zeros(0, 4, dtype=torch.int32)
    assert torch.equal(got, want)
    return x


@pytest.mark.parametrize("dims", ALL_GRIDS)
@pytest.mark.parametrize("how", ["contiguous", "random"])
@pytest.mark.parametrize("mode", ["balanced", "uniform"])
def test_equals_single_process(comm, rng, dims, how, mode, monkeypatch):
    need(comm, dims)
    if how == "random":  # owners located a few keys at a time
        monkeypatch.setattr("sparsepipe_hpc.parallel.voxelize.OWNER_CHUNK", 100)
    grid = halo.ProcessGrid(comm, dims)
    samples = [make_cloud(rng, 1500, faces=True), make_cloud(rng, 700)]
    b, p, f, l, i = split(rng, comm, samples, how)
    v = distributed_voxelize(grid, b, p, f, i, VOXEL, ORIGIN, SHAPE, labels=l,
                             num_classes=CLASSES, batch_size=2, cuts=mode, align=2)
    x = check_equal(comm, grid, v, samples, i, b)
    # The cuts are those decompose() computes from the whole batch: each voxel counted once.
    group = SpatialGroup(comm, dims)
    assert v.cuts == group.decompose(x, align=2, balanced=mode == "balanced").cuts
    assert comm.allreduce(len(v.coords)) == len(x.coords)


@pytest.mark.parametrize("dims", ALL_GRIDS)
def test_empty_boxes_and_empty_ranks(comm, rng, dims):
    need(comm, dims)
    grid = halo.ProcessGrid(comm, dims)
    samples = [make_cloud(rng, 400, corner=True)]
    b, p, f, l, i = split(rng, comm, samples, "random")
    if comm.rank == comm.size - 1 and comm.size > 1:  # a rank that read nothing at all
        b, p, f, l, i = b[:0], p[:0], f[:0], l[:0], i[:0]
    # The last rank's points are dropped from the sample too, so both sides see the same cloud.
    idx = np.sort(np.concatenate(comm.allgather(i.numpy())))
    s = samples[0]
    remap = np.full(400, -1)
    remap[idx] = np.arange(len(idx))
    sub = [(s[0][idx], s[1][idx], s[2][idx])]
    mine = torch.from_numpy(remap[i.numpy()])
    for mode in ("uniform", "balanced"):
        v = distributed_voxelize(grid, b, p, f, mine, VOXEL, ORIGIN, SHAPE, labels=l,
                                 num_classes=CLASSES, cuts=mode)
        check_equal(comm, grid, v, sub, mine, b)
        if mode == "uniform" and comm.size > 1:
            assert comm.allreduce(int(len(v.coords) == 0)) >= 1  # some box is empty


def test_voxel_split_across_every_rank(comm, rng):
    """One voxel whose points are spread over all ranks, with cancelling magnitudes."""
    grid = halo.ProcessGrid(comm)
    n = 40
    p = np.tile(np.array(ORIGIN) + VOXEL * np.array([3.5, 2.5, 1.5]), (n, 1))
    f = np.array([[1e8], [1.0], [-1e8], [3e-3]] * (n // 4), np.float32)
    lab = np.array([1, 2] * (n // 2))  # a tie: the smallest label wins
    samples = [(p, f, lab)]
    mine = np.arange(n)[np.arange(n) % comm.size == comm.rank]
    t = torch.from_numpy
    v = distributed_voxelize(grid, torch.zeros(len(mine), dtype=torch.long), t(p[mine]),
                             t(f[mine]), t(mine), VOXEL, ORIGIN, SHAPE, labels=t(lab[mine]),
                             num_classes=CLASSES, cuts="uniform")
    x = check_equal(comm, grid, v, samples, t(mine), torch.zeros(len(mine), dtype=torch.long))
    assert len(x.coords) == 1
    if len(v.labels):
        assert int(v.labels[0]) == 1


def test_nan_on_one_rank_raises_everywhere(comm, rng):
    grid = halo.ProcessGrid(comm)
    p, f, l = make_cloud(rng, 200)
    p = p.copy()
    r = comm.size - 1
    mine = np.arange(r * 200 // comm.size, (r + 1) * 200 // comm.size) if comm.rank == r else \
        np.arange(comm.rank * 200 // comm.size, (comm.rank + 1) * 200 // comm.size)
    if comm.rank == r:
        p[mine[-1], 1] = np.nan
    t = torch.from_numpy
    with pytest.raises(VoxelizeError, match="NaN or inf coordinates"):
        distributed_voxelize(grid, torch.zeros(len(mine), dtype=torch.long), t(p[mine]),
                             t(f[mine]), t(mine), VOXEL, ORIGIN, SHAPE, labels=t(l[mine]),
                             num_classes=CLASSES)


def test_empty_sample_raises_everywhere(comm, rng):
    grid = halo.ProcessGrid(comm)
    p, f, l = make_cloud(rng, 10)
    t = torch.from_numpy
    with pytest.raises(VoxelizeError, match="sample 1 has no points on any rank"):
        distributed_voxelize(grid, torch.zeros(10, dtype=torch.long), t(p), t(f),
                             torch.arange(10), VOXEL, ORIGIN, SHAPE, batch_size=2)


def test_off_grid_or_disagreeing_ranks_raise_everywhere(comm, rng):
    grid = halo.ProcessGrid(comm)
    p, f, l = make_cloud(rng, 100)
    t = torch.from_numpy
    mine = np.arange(comm.rank * 100 // comm.size, (comm.rank + 1) * 100 // comm.size)
    q = p.copy()
    if comm.rank == 0:
        q[mine[0], 2] = 50.0
    with pytest.raises(VoxelizeError, match="outside the grid"):
        distributed_voxelize(grid, torch.zeros(len(mine), dtype=torch.long), t(q[mine]),
                             t(f[mine]), t(mine), VOXEL, ORIGIN, SHAPE)
    if comm.size > 1:
        c = 3 if comm.rank == 0 else 2
        with pytest.raises(VoxelizeError, match="disagree on feature channels"):
            distributed_voxelize(grid, torch.zeros(len(mine), dtype=torch.long), t(p[mine]),
                                 t(f[mine][:, :c]), t(mine), VOXEL, ORIGIN, SHAPE)


def test_batches_the_voxel_keys_cannot_hold_are_refused_everywhere(comm, rng):
    """Keys hold 9 bits of sample index: batch 512 wrapped onto sample -512 and 1024 onto 0,
    merging samples silently; anything over MAX_BATCH (256) is refused, as SparseTensor does."""
    from halo.kmap import MAX_BATCH, MAX_EXTENT

    grid = halo.ProcessGrid(comm)
    n = 1100 if comm.rank == 0 else 0
    t = torch.from_numpy
    p = np.tile(np.array(ORIGIN) + VOXEL / 2, (n, 1))
    with pytest.raises(VoxelizeError, match=f"batch_size must lie in \\[1, {MAX_BATCH}\\]"):
        distributed_voxelize(grid, torch.arange(n), t(p), torch.ones(n, 1), torch.arange(n),
                             VOXEL, ORIGIN, SHAPE, batch_size=1100)
    with pytest.raises(VoxelizeError, match=f"exceeds {MAX_EXTENT} voxels per axis"):
        distributed_voxelize(grid, torch.zeros(n, dtype=torch.long), t(p), torch.ones(n, 1),
                             torch.arange(n), VOXEL, ORIGIN, (MAX_EXTENT + 1, 4, 4))


# --- the entry point: a file, sample indices, this rank's hyperslab ------------------------------

def scene_file(comm, tmp_path_factory, scenes, name="scenes.h5"):
    """Write ``scenes`` on rank 0 into a directory every rank agrees on; return the path."""
    from sparsepipe_hpc.data.scenes import write_scenes

    path = None
    if comm.rank == 0:
        path = str(tmp_path_factory.mktemp("dist") / name)
        write_scenes(path, scenes, class_names=[f"c{k}" for k in range(CLASSES)])
    path = comm.bcast(path)
    comm.Barrier()
    return path


def room(rng, n):
    centres = rng.uniform([0, 0, 0], [3.0, 2.4, 2.0], (5, 3))
    xyz = centres[rng.integers(0, 5, n)] + rng.normal(0, 0.3, (n, 3))
    xyz = np.clip(xyz, [0, 0, 0], [3.0, 2.4, 2.0])
    rgb = rng.integers(0, 256, (n, 3)).astype(np.uint8)
    return xyz, rgb, rng.integers(0, CLASSES, n)


def layout_ctx(comm, dims, cuts):
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    return ParallelContext(comm, RankLayout(1, 1, dims), cuts=cuts)


@pytest.fixture
def scenes(comm, rng, tmp_path_factory):
    from sparsepipe_hpc.data.scenes import SceneDataset

    rooms = [(f"room_{k}", *room(rng, n)) for k, n in enumerate([3001, 1200, 2500])]
    return SceneDataset(scene_file(comm, tmp_path_factory, rooms))


def test_ranks_reading_other_samples_or_draws_raise_everywhere(comm, scenes):
    """Each rank reads its share of every sample: shares of different samples, or of one
    sample augmented differently, merged into one sample without an error."""
    from sparsepipe_hpc.data.loader import grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.parallel.input import read_distributed

    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    ctx = layout_ctx(comm, (comm.size, 1, 1), "balanced")
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    batches = ShardedBatches(len(scenes), batch_size=2, replicas=1, rank=0, seed=5)
    with pytest.raises(VoxelizeError, match="disagree on samples: rank 0 \\(0,\\), rank 1 "
                                            "\\(1,\\)"):
        read_distributed(ctx, scenes, [min(comm.rank, 1)], 0.1, origin, shape)
    gens = batches.sample_generators([0], 1 + (comm.rank == 0))  # rank 0 draws another epoch's
    with pytest.raises(VoxelizeError, match="disagree on augmentation"):
        read_distributed(ctx, scenes, [0], 0.1, origin, shape, generators=gens)
    read_distributed(ctx, scenes, [0], 0.1, origin, shape)  # still in step afterwards


@pytest.mark.parametrize("bad", ["no samples", "generators", "index"])
def test_arguments_bad_on_one_rank_raise_everywhere(comm, scenes, bad):
    """Checked before the first collective, on the rank that got them alone: the others waited
    for it for ever."""
    from sparsepipe_hpc.data.loader import grid_for
    from sparsepipe_hpc.parallel.input import read_distributed

    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    ctx = layout_ctx(comm, (comm.size, 1, 1), "balanced")
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    idx, gens = [0], [torch.Generator()]
    if comm.rank == 1:
        idx, gens = {"no samples": ([], []), "generators": ([0], gens * 2),
                     "index": ([7], gens)}[bad]
    message = {"no samples": "got no samples", "generators": "2 generators for 1 samples",
               "index": r"sample\(s\) \[7\] of .* are out of range: it has 3"}[bad]
    with pytest.raises(ValueError, match=message):
        read_distributed(ctx, scenes, idx, 0.1, origin, shape, generators=gens)
    read_distributed(ctx, scenes, [0], 0.1, origin, shape)  # still in step afterwards


def test_a_ranks_own_grid_is_shared_by_bound_copies_and_freed_by_close(comm, scenes):
    """Without a spatial group, read_distributed reads over a 1x1x1 grid of the rank's own: one
    per context (bound copies share it), freed with the context, refused after it."""
    from mpi4py import MPI

    from sparsepipe_hpc.data.loader import grid_for
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.input import read_distributed
    from sparsepipe_hpc.parallel.layout import RankLayout

    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))  # replicas only
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    read_distributed(ctx, scenes, [0], 0.1, origin, shape)
    grid = ctx.input_grid()
    read_distributed(ctx.bind(None), scenes, [0], 0.1, origin, shape)
    assert ctx.bind(None).input_grid() is grid and grid.dims == (1, 1, 1)
    ctx.close()
    assert grid.comm == MPI.COMM_NULL
    with pytest.raises(RuntimeError, match="used after close"):
        read_distributed(ctx, scenes, [0], 0.1, origin, shape)


@pytest.mark.parametrize("dims", ALL_GRIDS)
@pytest.mark.parametrize("mode", ["balanced", "uniform"])
def test_read_distributed_equals_distribute(comm, scenes, dims, mode, monkeypatch):
    import sparsepipe_hpc.parallel.input as inp
    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.parallel.input import read_distributed

    need(comm, dims)
    if mode == "uniform":  # several chunks per rank and sample, blocks of jitter across them
        monkeypatch.setattr(inp, "READ_CHUNK", 300)
        monkeypatch.setattr("sparsepipe_hpc.data.loader.NOISE_BLOCK", 64)
    ctx = layout_ctx(comm, dims, mode)
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    batches = ShardedBatches(len(scenes), batch_size=2, replicas=1, rank=0, seed=5)
    idx = [2, 0]
    for augment in (False, True):
        gens = batches.sample_generators(idx, 1) if augment else None
        full = collate([scenes[i] for i in idx], 0.1, origin, shape, augment=augment,
                       generator=batches.sample_generators(idx, 1) if augment else None)
        want_x, want_y = ctx.distribute(full.x, full.labels, align=4)
        got = read_distributed(ctx, scenes, idx, 0.1, origin, shape, generators=gens, align=4)
        assert torch.equal(got.x.coords, want_x.coords)
        assert torch.equal(got.x.feats, want_x.feats)
        assert torch.equal(got.labels, want_y)
        assert got.x.batch_size == 2 and got.x.spatial_shape == tuple(shape)
        if ctx.group is not None:
            assert got.x.context.spatial.cuts == want_x.context.spatial.cuts
        # point -> voxel, against the batch's map
        every = comm.allgather(got.x.coords)
        for b in range(2):
            start = got.point_start[b]
            want = full.x.coords[full.offsets[b] + full.point_to_voxel[b][start:start + len(
                got.point_row[b])]]
            have = torch.stack([every[int(o)][int(r)] for o, r in
                                zip(got.point_owner[b], got.point_row[b])])
            assert torch.equal(have, want)
            assert torch.equal(got.point_labels[b],
                               full.point_labels[b][start:start + len(got.point_row[b])])
        held = comm.allreduce(sum(len(r) for r in got.point_row))
        assert held == sum(scenes.sizes[i] for i in idx)  # every point read exactly once


@pytest.mark.parametrize("mode", ["balanced", "uniform"])
def test_unet_on_distributed_input_equals_serial(comm, scenes, mode):
    import copy

    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.nn import SparseUNet
    from sparsepipe_hpc.parallel.input import read_distributed

    dims = grids(comm.size)[0]
    ctx = layout_ctx(comm, dims, mode)
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    gens = lambda: ShardedBatches(3, 2, seed=1).sample_generators([1, 2], 0)  # noqa: E731
    full = collate([scenes[i] for i in (1, 2)], 0.1, origin, shape, augment=True,
                   generator=gens())
    torch.manual_seed(0)
    serial = SparseUNet(3, CLASSES, width=4, depth=2).double()
    dist = copy.deepcopy(serial)
    x = full.x.replace(feats=full.x.feats.double())
    loss = torch.nn.functional.cross_entropy(serial(x).feats, full.labels)
    loss.backward()
    got = read_distributed(ctx, scenes, [1, 2], 0.1, origin, shape, generators=gens(), align=4)
    out = dist(got.x.replace(feats=got.x.feats.double()))
    share = torch.nn.functional.cross_entropy(out.feats, got.labels, reduction="sum") / \
        ctx.global_count(len(got.labels))
    share.backward()
    total = ctx.allreduce(share.detach().clone())
    torch.testing.assert_close(total, loss.detach(), rtol=1e-9, atol=1e-10)
    ctx.allreduce_gradients(dist)
    for (name, ps), pd in zip(serial.named_parameters(), dist.parameters()):
        torch.testing.assert_close(pd.grad, ps.grad, rtol=1e-9, atol=1e-10,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fault", ["nan", "label"])
def test_corrupt_hyperslab_raises_on_every_rank(comm, rng, tmp_path_factory, fault):
    """The fault sits in the last rank's range only: every rank must raise, none may hang."""
    from sparsepipe_hpc.data.checks import DataFormatError
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.parallel.input import point_range, read_distributed

    xyz, rgb, lab = room(rng, 900)
    start, stop = point_range(900, comm.size - 1, comm.size)
    if fault == "nan":
        xyz[stop - 1, 0] = np.nan
    else:
        lab[start] = CLASSES + 2
    path = scene_file(comm, tmp_path_factory, [("room", xyz, rgb, lab)], f"bad_{fault}.h5")
    ds = SceneDataset(path, check="structure")  # the full scan at open would refuse it
    ctx = layout_ctx(comm, grids(comm.size)[0], "balanced")
    rule = "must be finite" if fault == "nan" else r"must lie in \[0, 4\]"
    where = rf"xyz\[{start}:{stop}\]" if fault == "nan" else rf"label\[{start}:{stop}\]"
    with pytest.raises(DataFormatError, match=rf"{where}.*{rule}"):
        read_distributed(ctx, ds, [0], 0.1, (-0.5, -0.5, -0.5), (48, 40, 32))


def test_ranks_that_read_no_points(comm, rng, tmp_path_factory):
    """A scene of 3 points: at 4 ranks one reads nothing, and most boxes are empty."""
    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.parallel.input import read_distributed

    xyz, rgb, lab = room(rng, 3)
    xyz[:, 2] = np.array([0.0, 2.0, 1.0])  # spread the grid so that it can be cut
    ds = SceneDataset(scene_file(comm, tmp_path_factory, [("tiny", xyz, rgb, lab)], "tiny.h5"))
    ctx = layout_ctx(comm, (1, 1, comm.size), "uniform")
    origin, shape = grid_for(ds, 0.1, multiple=4)
    full = collate([ds[0]], 0.1, origin, shape)
    want_x, want_y = ctx.distribute(full.x, full.labels, align=4)
    got = read_distributed(ctx, ds, [0], 0.1, origin, shape, align=4)
    assert torch.equal(got.x.coords, want_x.coords) and torch.equal(got.x.feats, want_x.feats)
    assert torch.equal(got.labels, want_y)


def spy_jitter_and_reads(monkeypatch, dataset):
    """Record every jitter block drawn, as (key, block), and every range read, as (i, a, z)."""
    import sparsepipe_hpc.data.loader as loader

    drawn, reads = [], []
    block, read = loader.jitter_block, dataset.read_range

    def counting_block(key, k, rows):
        drawn.append((key, k))
        return block(key, k, rows)

    def counting_read(i, a, z):
        reads.append((i, a, z))
        return read(i, a, z)

    monkeypatch.setattr(loader, "jitter_block", counting_block)
    monkeypatch.setattr(dataset, "read_range", counting_read)
    return drawn, reads


def blocks_meeting(reads, keys, block):
    """{(key, k)}: the jitter blocks meeting the ranges read."""
    return {(keys[i], k) for i, a, z in reads if z > a for k in range(a // block, (z - 1) // block + 1)}


@pytest.mark.parametrize("read_chunk", [100, 1 << 16])
def test_ranks_draw_only_the_jitter_blocks_of_their_rows(comm, scenes, monkeypatch, read_chunk):
    # A rank reading rows [a, b) of a sample draws the jitter blocks meeting [a, b), each once,
    # not every row before b (the last rank of 4 reads rows 2250..3001 of a 3001-point sample).
    import sparsepipe_hpc.data.loader as loader
    import sparsepipe_hpc.parallel.input as inp
    from sparsepipe_hpc.data.loader import RangeAugmenter, collate, grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.parallel.input import point_range, read_distributed

    monkeypatch.setattr(loader, "NOISE_BLOCK", 64)
    monkeypatch.setattr(inp, "READ_CHUNK", read_chunk)  # 100: ranges end mid-block
    ctx = layout_ctx(comm, (comm.size, 1, 1), "balanced")
    origin, shape = grid_for(scenes, 0.1, multiple=4)
    batches = ShardedBatches(len(scenes), batch_size=2, replicas=1, rank=0, seed=5)
    idx = [2, 0]
    keys = {i: RangeAugmenter(1, origin, shape, 0.1, g).key
            for i, g in zip(idx, batches.sample_generators(idx, 1))}
    drawn, reads = spy_jitter_and_reads(monkeypatch, scenes)
    got = read_distributed(ctx, scenes, idx, 0.1, origin, shape,
                           generators=batches.sample_generators(idx, 1), align=4)
    for i in idx:  # this rank read exactly its range of each sample
        mine = sorted((a, z) for j, a, z in reads if j == i)
        start, stop = point_range(int(scenes.sizes[i]), comm.rank, comm.size)
        assert mine[0][0] == start and mine[-1][1] == stop
        assert all(z == a2 for (_, z), (a2, _) in zip(mine[:-1], mine[1:]))
    assert len(drawn) == len(set(drawn))  # a block shared by two reads is drawn once
    assert set(drawn) == blocks_meeting(reads, keys, 64)
    # and the result is still the single-process one, cut by the same cuts
    full = collate([scenes[i] for i in idx], 0.1, origin, shape, augment=True,
                   generator=batches.sample_generators(idx, 1))
    cuts = got.x.context.spatial.cuts if ctx.group is not None else None
    want_x, want_y = ctx.distribute(full.x, full.labels, align=4, cuts=cuts)
    assert torch.equal(got.x.coords, want_x.coords)
    assert torch.equal(got.x.feats, want_x.feats)
    assert torch.equal(got.labels, want_y)
