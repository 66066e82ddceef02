"""collate, grid_for and the train-time augmentation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsepipe_hpc.data import (ModelNetDataset, Sample, SceneDataset, collate, grid_for,
                                 synth)
from sparsepipe_hpc.voxelize import VoxelizeError

torch.set_num_threads(1)
VS = 0.1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("loader")
    scenes = synth.generate_scenes(out, 3, 1, seed=1, points=(3000, 5000))
    objects = synth.generate_objects(out, 12, 6, points=128, seed=1)
    return SceneDataset(scenes, "train"), SceneDataset(scenes, "val"), \
        ModelNetDataset(objects, "train")


def seg_sample(points, labels, feats=None, name="s"):
    points = np.asarray(points, dtype=np.float32)
    feats = (np.ones((len(points), 1), np.float32) if feats is None
             else np.asarray(feats, np.float32))
    return Sample(points, feats, np.asarray(labels, dtype=np.int64), None, name)


def test_grid_for(data):
    train, val, objects = data
    origin, shape = grid_for(train, 0.05)
    assert all(s % 16 == 0 for s in shape)
    lo, hi = train.bounds()
    o = np.array(origin)
    assert (o <= lo).all() and (o + np.array(shape) * 0.05 > hi).all()
    assert np.allclose(o / 0.05, np.round(o / 0.05))  # voxel boundaries on the world's lattice
    # Both splits on one grid; it holds the union of their bounds.
    o2, shape2 = grid_for([train, val], 0.05)
    assert (np.array(o2) <= np.minimum(lo, val.bounds()[0])).all()
    assert grid_for([train, val], 0.05) == (o2, shape2)
    oc, shc = grid_for(objects, 0.05, multiple=8)
    assert all(s % 8 == 0 for s in shc) and oc[0] <= -0.95
    with pytest.raises(ValueError, match="voxel_size"):
        grid_for(train, 0.0)


def test_collate_segmentation_shapes(data):
    train, _, _ = data
    origin, shape = grid_for(train, VS)
    samples = [train[i] for i in range(3)]
    b = collate(samples, VS, origin, shape)
    n = b.x.num_voxels
    assert b.x.coords.dtype == torch.int32 and b.x.coords.shape == (n, 4)
    assert b.x.feats.dtype == torch.float32 and b.x.feats.shape == (n, train.in_channels)
    assert b.labels.dtype == torch.int64 and b.labels.shape == (n,)
    assert b.offsets.tolist()[0] == 0 and b.offsets.tolist()[-1] == n and len(b.offsets) == 4
    assert b.x.spatial_shape == tuple(shape) and b.batch_size == 3
    assert b.names == [s.name for s in samples]
    b.x.validate()
    for k, s in enumerate(samples):
        rows = slice(int(b.offsets[k]), int(b.offsets[k + 1]))
        assert (b.x.coords[rows, 0] == k).all()
        p2v = b.point_to_voxel[k]
        assert p2v.dtype == torch.int64 and p2v.shape == (s.num_points,) and (p2v >= 0).all()
        # Each point's voxel (global row offsets[k] + p2v) is where its coordinates quantize to.
        expect = np.floor((s.points.astype(np.float64) - origin) / VS).astype(np.int32)
        got = b.x.coords[b.offsets[k] + p2v, 1:].numpy()
        np.testing.assert_array_equal(got, expect)
        np.testing.assert_array_equal(b.point_labels[k].numpy(), s.labels)
        # Voxel labels are the majority of their points' labels (ties: the smallest).
        votes = np.zeros((rows.stop - rows.start, train.num_classes), np.int64)
        np.add.at(votes, (p2v.numpy(), s.labels), 1)
        np.testing.assert_array_equal(b.labels[rows].numpy(), votes.argmax(1))


def test_voxel_label_majority_by_hand():
    # Voxel (0,0,0): labels 2, 2, 1 -> 2.  Voxel (1,0,0): 1, 3 tie -> 1.  Voxel (0,0,1): 4.
    pts = [[0.01, 0.01, 0.01], [0.05, 0.05, 0.05], [0.09, 0.02, 0.03],
           [0.15, 0.05, 0.05], [0.12, 0.01, 0.02], [0.05, 0.05, 0.15]]
    feats = [[1.0], [2.0], [3.0], [10.0], [20.0], [7.0]]
    b = collate([seg_sample(pts, [2, 2, 1, 3, 1, 4], feats)], VS, (0, 0, 0), (16, 16, 16))
    got = {tuple(c[1:].tolist()): (int(lab), float(f)) for c, lab, f in
           zip(b.x.coords, b.labels, b.x.feats[:, 0])}
    assert got == {(0, 0, 0): (2, 2.0), (1, 0, 0): (1, 15.0), (0, 0, 1): (4, 7.0)}


def test_collate_classification(data):
    _, _, objects = data
    origin, shape = grid_for(objects, 0.05)
    samples = [objects[i] for i in range(5)]
    b = collate(samples, 0.05, origin, shape)
    assert b.labels.tolist() == [s.label for s in samples] and b.labels.dtype == torch.int64
    assert b.point_labels == [] and len(b.point_to_voxel) == 5
    assert b.x.feats.shape[1] == 1 and (b.x.feats == 1).all()
    assert b.to("cpu").x.coords.equal(b.x.coords)


def test_collate_rejects_bad_batches(data):
    train, _, objects = data
    origin, shape = grid_for(train, VS)
    with pytest.raises(ValueError, match="no samples"):
        collate([], VS, origin, shape)
    with pytest.raises(ValueError, match="one kind"):
        collate([train[0], objects[0]], VS, origin, shape)
    with pytest.raises(ValueError, match="expected"):
        collate([train[0], seg_sample([[1, 1, 1]], [0])], VS, origin, shape)
    far = seg_sample([[1, 1, 1], [100, 1, 1]], [0, 1], name="far")
    with pytest.raises(VoxelizeError, match="far"):
        collate([far], VS, origin, shape)
    b = collate([far], VS, origin, shape, clip=True)
    assert b.point_to_voxel[0].tolist()[1] == -1


def test_voxelize_takes_a_feature_row_per_point():
    from sparsepipe_hpc.voxelize import voxelize

    pts = np.array([[0.1, 0.1, 0.1], [0.1, 0.15, 0.1], [0.9, 0.9, 0.9]])
    one = voxelize(pts, np.array([1.0, 3.0, 5.0]), 0.5, (0, 0, 0), (2, 2, 2))  # [P]: one channel
    assert one.feats.tolist() == [[2.0], [5.0]]
    with pytest.raises(VoxelizeError, match=r"features of points have shape \[2, 3\]; "
                                            r"expected \[3, C\], a row per point"):
        voxelize(pts, np.ones((2, 3)), 0.5, (0, 0, 0), (2, 2, 2))  # [C, P]: not reshaped


def test_voxelize_refuses_labels_that_are_not_an_integer_per_point_and_odd_voxel_sizes():
    from sparsepipe_hpc.voxelize import voxelize

    pts = np.array([[0.1, 0.1, 0.1], [0.9, 0.9, 0.9], [0.6, 0.1, 0.1]])
    with pytest.raises(VoxelizeError, match=r"labels of points are int64 of shape \[2\]; "
                                            r"expected integers of shape \[3\]"):
        voxelize(pts, None, 0.5, (0, 0, 0), (2, 2, 2), labels=np.array([0, 1]))
    with pytest.raises(VoxelizeError, match=r"labels of points are float64"):  # not truncated
        voxelize(pts, None, 0.5, (0, 0, 0), (2, 2, 2), labels=np.array([0.9, 1.9, 2.7]))
    for size in (float("inf"), float("nan"), 0.0):
        with pytest.raises(VoxelizeError, match="positive, finite"):
            voxelize(pts, None, size, (0, 0, 0), (2, 2, 2))


def test_a_grid_without_margin_holds_points_a_rounded_origin_moves_by_a_voxel():
    """The grid's origin is rounded to 1e-9 m; a point on a voxel face could land one voxel past
    the end (here z = -1.7 + 4.8 = 3.0999999999999996 at 1 cm: voxel 480 of 480 before)."""
    from sparsepipe_hpc.voxelize import voxelize

    class Bounds:
        def __init__(self, lo, hi):
            self.lo, self.hi = np.array(lo), np.array(hi)

        def bounds(self):
            return self.lo, self.hi

    rng = np.random.default_rng(0)
    cases = [([0.0, 0.0, -1.7], [0.5, 0.5, -1.7 + 4.8], 0.01)]
    for _ in range(2000):
        lo = np.round(rng.uniform(-50, 50, 3), int(rng.integers(1, 4)))
        hi = lo + np.round(rng.uniform(0, 5, 3), int(rng.integers(1, 4)))
        cases.append((lo, hi, float(rng.choice([0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.3]))))
    for lo, hi, vs in cases:
        origin, shape = grid_for(Bounds(lo, hi), vs, multiple=1, margin=0.0)
        voxelize(np.array([lo, hi], dtype=np.float64), None, vs, origin, shape)  # both inside


def test_a_grid_the_rounded_origin_widens_past_the_limit_is_refused_by_name():
    """65,536 voxels on x by the count of floor(p / voxel), 65,552 once padded and placed
    against the rounded origin: refused with the smallest voxel that fits, not left to fail
    in the sparse tensor."""
    from sparsepipe_hpc.data.loader import GridSizeError

    class Bounds:
        def bounds(self):
            return np.array([-2.5, 0.0, 0.0]), np.array([4585.0, 1.0, 1.0])

    with pytest.raises(GridSizeError, match=r"65552x16x16 voxels.*at least 0\.0707 m"):
        grid_for(Bounds(), 0.07, multiple=16, margin=0.0)
    assert grid_for(Bounds(), 0.0707, multiple=16, margin=0.0)[1][0] <= 65536


def symmetries(coords, n):
    """The x-y images of a voxel set under flips about the grid centre and the x-y swap."""
    out = []
    for fx in (False, True):
        for fy in (False, True):
            c = coords.copy()
            if fx:
                c[:, 0] = n[0] - 1 - c[:, 0]
            if fy:
                c[:, 1] = n[1] - 1 - c[:, 1]
            out.append(c)
            out.append(c[:, [1, 0, 2]])
    return [set(map(tuple, c.tolist())) for c in out]


def test_augmentation_is_a_grid_symmetry_and_seeded():
    rng = np.random.default_rng(0)
    origin, shape = (-0.8, -0.8, 0.0), (16, 16, 16)
    # Points well inside their voxels, so a flip cannot round them across a boundary.
    idx = rng.integers(0, 16, (200, 3))
    pts = (np.array(origin) + (idx + rng.uniform(0.3, 0.7, (200, 3))) * VS).astype(np.float32)
    s = seg_sample(pts, rng.integers(0, 3, 200))
    plain = collate([s], VS, origin, shape).x.coords[:, 1:].numpy()
    images = symmetries(plain, shape)
    seen = set()
    for seed in range(16):
        b = collate([s], VS, origin, shape, augment=True,
                    generator=torch.Generator().manual_seed(seed), jitter=0.0)
        got = set(map(tuple, b.x.coords[:, 1:].tolist()))
        assert got in images
        seen.add(images.index(got))
        # The same generator state gives the same batch, jitter included.
        b1 = collate([s], VS, origin, shape, augment=True,
                     generator=torch.Generator().manual_seed(seed))
        b2 = collate([s], VS, origin, shape, augment=True,
                     generator=torch.Generator().manual_seed(seed))
        assert b1.x.coords.equal(b2.x.coords) and b1.x.feats.equal(b2.x.feats)
    assert len(seen) >= 5  # the draws do vary


def test_augmented_rooms_stay_in_the_grid(data):
    train, _, _ = data
    origin, shape = grid_for(train, 0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        b = collate([train[0], train[1]], 0.05, origin, shape, augment=True, generator=g)
        b.x.validate()
        assert all(bool((p >= 0).all()) for p in b.point_to_voxel)  # no point dropped


def test_per_sample_generators_make_shards_match_the_whole_batch(data):
    from sparsepipe_hpc.data import ShardedBatches

    train, _, _ = data
    origin, shape = grid_for(train, VS)
    whole = ShardedBatches(len(train), 3, seed=5)
    idx = next(iter(whole))
    ref = collate([train[i] for i in idx], VS, origin, shape, augment=True,
                  generator=whole.sample_generators(idx))
    for replicas in (2, 3):
        rows = []
        for r in range(replicas):
            part = ShardedBatches(len(train), 3, replicas=replicas, rank=r, seed=5)
            pidx = next(iter(part))
            b = collate([train[i] for i in pidx], VS, origin, shape, augment=True,
                        generator=part.sample_generators(pidx))
            for k in range(len(pidx)):
                lo, hi = int(b.offsets[k]), int(b.offsets[k + 1])
                rows.append((b.x.coords[lo:hi, 1:], b.x.feats[lo:hi]))
        assert len(rows) == len(idx)
        for k, (c, f) in enumerate(rows):
            assert c.equal(ref.x.coords[ref.offsets[k]:ref.offsets[k + 1], 1:])
            assert f.equal(ref.x.feats[ref.offsets[k]:ref.offsets[k + 1]])
    with pytest.raises(ValueError, match="2 generators for 3 samples"):
        collate([train[i] for i in idx], VS, origin, shape, augment=True,
                generator=whole.sample_generators(idx)[:2])


def test_float64_coordinates_far_from_the_origin_keep_their_voxels(tmp_path):
    """Scenes stored in float64 at a UTM-like offset (5e6 m, where a float32 step is 0.5 m) give
    the same voxels as the same scenes at the origin: nothing is rounded to float32 before the
    grid's origin is subtracted (write_scenes keeps float64, a sample hands it out)."""
    from sparsepipe_hpc.data.scenes import write_scenes

    rng = np.random.default_rng(0)
    xyz = rng.uniform(0, 2, (3000, 3))
    label = rng.integers(0, 2, 3000)
    counts = []
    for offset in (0.0, 5e6):
        path = write_scenes(tmp_path / f"s{offset:.0f}.h5",
                            [("a", xyz + [offset, offset, 0.0], None, label)], ["x", "y"])
        ds = SceneDataset(path, None)
        s = ds[0]
        assert s.points.dtype == np.float64
        origin, shape = grid_for(ds, 0.05)
        b = collate([s], 0.05, origin, shape)
        counts.append(b.x.num_voxels)
    assert counts[0] == counts[1] > 1000


@pytest.mark.parametrize("case", ["tiny voxel", "far outlier"])
def test_grids_too_large_to_count_in_int64_are_refused_by_name(tmp_path, case):
    """A voxel of 1e-300 m, or an outlier at 1e18 m (a fill value), needs more voxels than an
    int64 holds: the extent is counted in floats, so the error names the span, the sample that
    holds the extreme point and a voxel size that fits, instead of a wrapped-around grid."""
    from sparsepipe_hpc.data.loader import GridSizeError
    from sparsepipe_hpc.data.scenes import write_scenes

    rng = np.random.default_rng(0)
    xyz = rng.uniform(0, 2, (100, 3))
    far = xyz.copy()
    if case == "far outlier":
        far[7, 0] = 1e18
    path = write_scenes(tmp_path / "s.h5", [("a", xyz, None, np.zeros(100, int)),
                                            ("b", far, None, np.zeros(100, int))], ["x"])
    ds = SceneDataset(path, None)
    voxel = 1e-300 if case == "tiny voxel" else 0.05
    with pytest.raises(GridSizeError, match=r"voxels of .* m, but a sparse tensor holds at most "
                                            r"65536 voxels per axis.*use voxels of at least"):
        grid_for(ds, voxel)
    if case == "far outlier":
        with pytest.raises(GridSizeError, match=r"highest: x = 1e\+18 m in .*'b'"):
            grid_for(ds, voxel)
