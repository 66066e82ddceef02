"""Distributed input from the chunked scene layout under mpirun: each rank reads only the chunks
that meet its box, and the voxels of its box equal the single-process voxelization exactly
(coords, mean features, label votes, point->voxel maps); corrupt chunks fail on every rank."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

CLASSES = 5
VOXEL = 0.125  # binary-exact: points on voxel faces (and chunk faces) sit exactly on them


def grids(n):
    out = {(n, 1, 1), (1, n, 1), (1, 1, n)}
    if n == 4:
        out |= {(2, 2, 1), (1, 2, 2)}
    return sorted(out)


ALL_GRIDS = sorted({g for n in (1, 2, 3, 4) for g in grids(n)})


def need(comm, dims):
    if int(np.prod(dims)) != comm.size:
        pytest.skip(f"grid {dims} needs {int(np.prod(dims))} ranks")


def room(rng, n, faces=False, corner=False):
    """A room of ``n`` points, 3 x 2.5 x 2 m; ``faces``: a third of them exactly on voxel faces
    (multiples of VOXEL), which with chunk sizes that are multiples of VOXEL are chunk faces too;
    ``corner``: every point in a 0.5 m corner (most boxes empty)."""
    span = np.array([3.0, 2.5, 2.0])
    if corner:
        xyz = rng.uniform(0, 0.5, (n, 3))
    else:
        centres = rng.uniform(0, 1, (5, 3)) * span
        xyz = np.clip(centres[rng.integers(0, 5, n)] + rng.normal(0, 0.4, (n, 3)), 0, span)
    if faces:
        m = n // 3
        xyz[:m] = rng.integers(0, (span / VOXEL).astype(int), (m, 3)) * VOXEL
    rgb = rng.integers(0, 256, (n, 3)).astype(np.uint8)
    return xyz, rgb, rng.integers(0, CLASSES, n)


def scene_file(comm, tmp_path_factory, scenes, chunk_size, name="chunked.h5"):
    from sparsepipe_hpc.data.scenes import write_scenes

    path = None
    if comm.rank == 0:
        path = str(tmp_path_factory.mktemp("chunked") / name)
        write_scenes(path, scenes, class_names=[f"c{k}" for k in range(CLASSES)],
                     chunk_size=chunk_size)
    path = comm.bcast(path)
    comm.Barrier()
    return path


def layout_ctx(comm, dims, cuts):
    from sparsepipe_hpc.parallel.context import ParallelContext
    from sparsepipe_hpc.parallel.layout import RankLayout

    return ParallelContext(comm, RankLayout(1, 1, dims), cuts=cuts)


@pytest.fixture(params=[0.25, 0.3], ids=["chunk-faces-on-voxel-faces", "voxels-across-chunks"])
def scenes(request, comm, rng, tmp_path_factory):
    from sparsepipe_hpc.data.scenes import SceneDataset

    rooms = [(f"room_{k}", *room(rng, n, faces=k == 0)) for k, n in enumerate([3001, 1200, 2500])]
    return SceneDataset(scene_file(comm, tmp_path_factory, rooms, request.param))


def check_batch(comm, ctx, got, full, sizes, align):
    """``got`` (read_distributed) against ``full`` (collate of the whole samples) cut by the same
    cuts: bit-exact voxels, labels and point->voxel maps; every point held exactly once."""
    cuts = got.x.context.spatial.cuts if ctx.group is not None else None
    want_x, want_y = ctx.distribute(full.x, full.labels, align=align, cuts=cuts)
    assert torch.equal(got.x.coords, want_x.coords)
    assert torch.equal(got.x.feats, want_x.feats)  # bit-exact, not allclose
    assert torch.equal(got.labels, want_y)
    assert got.x.batch_size == len(sizes) and got.x.spatial_shape == full.x.spatial_shape
    every = comm.allgather(got.x.coords)
    for b in range(len(sizes)):
        idx = got.point_index[b]
        assert bool((idx[1:] > idx[:-1]).all())
        want = full.x.coords[full.offsets[b] + full.point_to_voxel[b][idx]]
        have = torch.stack([every[int(o)][int(r)] for o, r in
                            zip(got.point_owner[b], got.point_row[b])]) if len(idx) else want
        assert torch.equal(have, want)
        assert torch.equal(got.point_labels[b], full.point_labels[b][idx])
        held = np.sort(np.concatenate(comm.allgather(idx.numpy())))
        assert np.array_equal(held, np.arange(sizes[b]))  # every point held exactly once
    assert got.points_read >= sum(len(i) for i in got.point_index)


@pytest.mark.parametrize("dims", ALL_GRIDS)
@pytest.mark.parametrize("mode", ["balanced", "uniform"])
def test_chunked_read_equals_single_process(comm, scenes, dims, mode, monkeypatch):
    import sparsepipe_hpc.parallel.input as inp
    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.parallel.chunked import chunk_cuts, chunk_voxels
    from sparsepipe_hpc.parallel.input import read_distributed

    need(comm, dims)
    if mode == "uniform":  # several pieces per rank and sample, jitter in small blocks
        monkeypatch.setattr(inp, "READ_CHUNK", 300)
        monkeypatch.setattr("sparsepipe_hpc.data.loader.NOISE_BLOCK", 64)
    ctx = layout_ctx(comm, dims, mode)
    origin, shape = grid_for(scenes, VOXEL, multiple=2)
    batches = ShardedBatches(len(scenes), batch_size=2, replicas=1, rank=0, seed=5)
    idx = [2, 0]
    sizes = [int(scenes.sizes[i]) for i in idx]
    for augment in (False, True):
        gens = (lambda: batches.sample_generators(idx, 1)) if augment else (lambda: None)
        full = collate([scenes[i] for i in idx], VOXEL, origin, shape, augment=augment,
                       generator=gens())
        got = read_distributed(ctx, scenes, idx, VOXEL, origin, shape, generators=gens(),
                               align=2)
        check_batch(comm, ctx, got, full, sizes, 2)
        if ctx.group is None:
            assert got.points_read == sum(sizes)
            continue
        cuts = got.x.context.spatial.cuts
        if mode == "balanced" and not augment:  # the cuts come from the tables alone
            tabs = [scenes.chunk_table(i) for i in idx]
            want = chunk_cuts([(*chunk_voxels(t.lo, t.hi, origin, VOXEL, shape), t.count)
                               for t in tabs], shape, dims, 2)
            assert cuts == want
        # Reading only nearby chunks: no rank reads the whole batch when the boxes split it.
        assert max(comm.allgather(got.points_read)) < sum(sizes)


@pytest.mark.parametrize("dims", ALL_GRIDS)
def test_empty_boxes_and_ranks_that_read_nothing(comm, rng, tmp_path_factory, dims):
    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.parallel.input import read_distributed

    need(comm, dims)
    xyz, rgb, lab = room(rng, 600, corner=True)
    xyz[0] = [3.0, 2.5, 2.0]  # one far point: the grid spans the room, the points the corner
    ds = SceneDataset(scene_file(comm, tmp_path_factory, [("corner", xyz, rgb, lab)], 0.25,
                                 "corner.h5"))
    ctx = layout_ctx(comm, dims, "uniform")
    origin, shape = grid_for(ds, VOXEL, multiple=2)
    full = collate([ds[0]], VOXEL, origin, shape)
    got = read_distributed(ctx, ds, [0], VOXEL, origin, shape, align=2)
    check_batch(comm, ctx, got, full, [600], 2)
    if comm.size > 2:  # boxes away from both corners hold nothing and read nothing
        assert comm.allreduce(int(got.points_read == 0)) >= 1
        assert comm.allreduce(int(got.x.num_voxels == 0)) >= 1


def test_one_voxel_across_chunks_and_ranks(comm, rng, tmp_path_factory):
    """Points of one voxel in 8 chunks (a voxel on the corner where 8 chunks meet), with
    cancelling magnitudes: the owner merges them in sample order, bit for bit."""
    from sparsepipe_hpc.data.loader import collate, grid_for
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.parallel.input import read_distributed

    n = 64
    corner = np.array([1.0, 1.0, 1.0])
    xyz = corner + rng.choice([-0.01, 0.01], (n, 3))  # 8 chunks of 0.5 m meet at (1, 1, 1)
    xyz = np.concatenate([xyz, [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]])
    rgb = rng.integers(0, 256, (n + 2, 3)).astype(np.uint8)
    lab = np.array([1, 2] * (n // 2) + [0, 0])
    ds = SceneDataset(scene_file(comm, tmp_path_factory, [("v", xyz, rgb, lab)], 0.5, "v.h5"))
    assert len(ds.chunk_table(0)) >= 9
    voxel = 0.25  # (1, 1, 1) +- 0.01 falls in voxels 3 and 4 on each axis
    for dims in grids(comm.size):
        ctx = layout_ctx(comm, dims, "uniform")
        origin, shape = grid_for(ds, voxel, multiple=1)
        full = collate([ds[0]], voxel, origin, shape)
        got = read_distributed(ctx, ds, [0], voxel, origin, shape, align=1)
        check_batch(comm, ctx, got, full, [n + 2], 1)


# --- corrupt or missing chunks: a clear error on every rank, no hang ----------------------------

def damaged(comm, rng, tmp_path_factory, fault):
    """A chunked room whose chunk ``k`` is damaged (``fault``); returns (path, k, rows)."""
    from sparsepipe_hpc.data.chunks import chunk_order

    xyz, rgb, lab = room(rng, 1500)
    path = scene_file(comm, tmp_path_factory, [("room", xyz, rgb, lab)], 0.5, f"bad_{fault}.h5")
    _, t = chunk_order(xyz.astype(np.float32), 0.5)
    k = int(np.argmax(t.count))  # the largest chunk
    a, n = int(t.offset[k]), int(t.count[k])
    if comm.rank == 0:
        with h5py.File(path, "r+") as f:
            g = f["scenes/room"]
            if fault == "box":  # the table's box lies: half the chunk's points are outside it
                hi = g["chunks/bbox_max"][...]
                hi[k] = (t.lo[k] + t.hi[k]) / 2
                g["chunks/bbox_max"][...] = hi
            elif fault == "checksum":  # a point moved inside its box: only the CRC sees it
                g["xyz"][a + 1] = (g["xyz"][a + 1] + t.lo[k].astype(np.float32)) / 2
            elif fault == "nan":
                p = g["xyz"][a + n - 1]
                p[0] = np.nan
                g["xyz"][a + n - 1] = p
            elif fault == "count":
                c = g["chunks/count"][...]
                c[k] += 1
                g["chunks/count"][...] = c
            elif fault == "missing":
                del g["chunks/offset"]
    comm.Barrier()
    return path, k, (a, a + n)


@pytest.mark.parametrize("fault", ["box", "checksum", "nan"])
def test_corrupt_chunk_raises_on_every_rank(comm, rng, tmp_path_factory, fault):
    """Only the ranks whose box meets the damaged chunk can see the fault: every rank raises."""
    from sparsepipe_hpc.data.checks import DataFormatError
    from sparsepipe_hpc.data.loader import grid_for
    from sparsepipe_hpc.data.scenes import SceneDataset
    from sparsepipe_hpc.parallel.input import read_distributed

    path, k, (a, z) = damaged(comm, rng, tmp_path_factory, fault)
    ds = SceneDataset(path, check="structure")  # the full check at open would refuse it
    origin, shape = grid_for(ds, 0.1, multiple=2)
    rule = {"box": rf"chunk {k} \(rows {a}..{z - 1}\) has points outside its box",
            "checksum": rf"chunk {k} \(rows {a}..{z - 1}\) fails its checksum",
            "nan": r"xyz\[\d+:\d+\]' must be finite"}[fault]
    for dims in grids(comm.size):
        ctx = layout_ctx(comm, dims, "balanced")
        with pytest.raises(DataFormatError, match=rule) as e:
            read_distributed(ctx, ds, [0], 0.1, origin, shape, align=2)
        seen = comm.allgather(str(e.value).startswith("rank "))
        assert not all(seen)  # some rank found it itself; the others name that rank


@pytest.mark.parametrize("fault,rule", [
    ("count", r"'/scenes/room/chunks'/count sums to 1501 points but the scene has 1500"),
    ("missing", r"missing dataset 'offset' \(under /scenes/room/chunks"),
])
def test_bad_or_missing_table_is_refused_on_every_rank(comm, rng, tmp_path_factory, fault, rule):
    from sparsepipe_hpc.data.checks import DataFormatError
    from sparsepipe_hpc.data.scenes import SceneDataset

    path, _, _ = damaged(comm, rng, tmp_path_factory, fault)
    with pytest.raises(DataFormatError, match=rule):
        SceneDataset(path, check="structure")


@pytest.mark.parametrize("dims", ALL_GRIDS)
def test_ranks_draw_only_the_jitter_blocks_of_the_chunks_they_read(comm, scenes, dims,
                                                                    monkeypatch):
    # Rows sorted by chunk: a rank reads runs of rows far into the sample; it must draw only the
    # jitter blocks meeting the rows it reads, each once (not every row up to its last one).
    import sparsepipe_hpc.data.loader as loader
    import sparsepipe_hpc.parallel.input as inp
    from sparsepipe_hpc.data.loader import RangeAugmenter, collate, grid_for
    from sparsepipe_hpc.data.sharding import ShardedBatches
    from sparsepipe_hpc.parallel.input import read_distributed

    need(comm, dims)
    monkeypatch.setattr(loader, "NOISE_BLOCK", 64)
    monkeypatch.setattr(inp, "READ_CHUNK", 100)
    ctx = layout_ctx(comm, dims, "balanced")
    origin, shape = grid_for(scenes, VOXEL, multiple=2)
    batches = ShardedBatches(len(scenes), batch_size=2, replicas=1, rank=0, seed=5)
    idx = [2, 0]
    sizes = [int(scenes.sizes[i]) for i in idx]
    keys = {i: RangeAugmenter(1, origin, shape, VOXEL, g).key
            for i, g in zip(idx, batches.sample_generators(idx, 1))}
    drawn, reads = [], []
    block, read = loader.jitter_block, scenes.read_range

    def counting_block(key, k, rows):
        drawn.append((key, k))
        return block(key, k, rows)

    def counting_read(i, a, z):
        reads.append((i, a, z))
        return read(i, a, z)

    monkeypatch.setattr(loader, "jitter_block", counting_block)
    monkeypatch.setattr(scenes, "read_range", counting_read)
    got = read_distributed(ctx, scenes, idx, VOXEL, origin, shape,
                           generators=batches.sample_generators(idx, 1), align=2)
    assert sum(z - a for _, a, z in reads) == got.points_read
    meeting = {(keys[i], k) for i, a, z in reads if z > a
               for k in range(a // 64, (z - 1) // 64 + 1)}
    assert len(drawn) == len(set(drawn)) and set(drawn) == meeting
    full = collate([scenes[i] for i in idx], VOXEL, origin, shape, augment=True,
                   generator=batches.sample_generators(idx, 1))
    check_batch(comm, ctx, got, full, sizes, 2)
