"""Splits must agree (classes, features, voxel size); stale bounds; grids too big; no drops."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from sparsepipe_hpc.data import (DataFormatError, GridSizeError, ModelNetDataset, Sample,
                                 SceneDataset, augment_margin, check_splits, collate, grid_for,
                                 write_modelnet, write_scenes)
from sparsepipe_hpc.sparse import MAX_EXTENT

torch.set_num_threads(1)
CLASSES = ["floor", "wall", "box"]


def scene(n=40, seed=0, rgb=True, scale=4.0):
    rng = np.random.default_rng(seed)
    return (rng.random((n, 3)).astype(np.float32) * scale,
            rng.integers(0, 256, (n, 3), dtype=np.uint8) if rgb else None,
            rng.integers(0, 3, n).astype(np.int64))


def scenes(path, classes=CLASSES, rgb=True, attrs=None, n=2):
    return write_scenes(path, [(f"room_{i}", *scene(seed=i, rgb=rgb)) for i in range(n)],
                        classes, attrs)


def disagree(train, val, *words):
    with pytest.raises(DataFormatError) as info:
        check_splits(train, val)
    msg = str(info.value)
    assert str(train.path) in msg and str(val.path) in msg, msg  # both files named
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


def test_matching_splits_pass(tmp_path):
    check_splits(SceneDataset(scenes(tmp_path / "train.h5")),
                 SceneDataset(scenes(tmp_path / "val.h5")))


def test_swapped_class_names(tmp_path):
    train = SceneDataset(scenes(tmp_path / "train.h5"))
    val = SceneDataset(scenes(tmp_path / "val.h5", ["floor", "box", "wall"]))
    disagree(train, val, "'class_names'", "another order", "class 1 is 'wall' in train but 'box' "
             "in val")


def test_extra_and_missing_class_names(tmp_path):
    train = SceneDataset(scenes(tmp_path / "train.h5"))
    val = SceneDataset(scenes(tmp_path / "val.h5", CLASSES + ["door"]))
    disagree(train, val, "3 classes in train, 4 in val", "only in val: ['door']")
    val = SceneDataset(scenes(tmp_path / "val2.h5", ["floor", "wall", "chair"]))
    disagree(train, val, "only in train: ['box']", "only in val: ['chair']")


def test_feature_layout_must_agree(tmp_path):
    train = SceneDataset(scenes(tmp_path / "train.h5"))
    val = SceneDataset(scenes(tmp_path / "val.h5", rgb=False))
    disagree(train, val, "point features", "3 channel(s), rgb in train",
             "1 channel(s), no rgb: a constant feature in val")


def test_voxel_size_attribute_must_agree(tmp_path):
    train = SceneDataset(scenes(tmp_path / "train.h5", attrs={"voxel_size": 0.02}))
    val = SceneDataset(scenes(tmp_path / "val.h5", attrs={"voxel_size": 0.05}))
    assert train.voxel_size == 0.02
    disagree(train, val, "'voxel_size': 0.02 m in train, 0.05 m in val")
    check_splits(train, SceneDataset(scenes(tmp_path / "v.h5")))  # recorded in one file only
    with pytest.raises(DataFormatError, match="'voxel_size' must be one number > 0"):
        SceneDataset(scenes(tmp_path / "bad.h5", attrs={"voxel_size": -1.0}))


def test_modelnet_splits(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((6, 16, 3))
    a = write_modelnet(tmp_path / "train0.h5", data, np.arange(6) % 3, ["a", "b", "c"])
    b = write_modelnet(tmp_path / "test0.h5", data, np.arange(6) % 3, ["a", "c", "b"])
    c = write_modelnet(tmp_path / "test1.h5", data, np.arange(6) % 3)  # no names: ModelNet40's
    train = ModelNetDataset([a])
    check_splits(train, ModelNetDataset([a]))
    with pytest.raises(DataFormatError, match=r"class 1 is 'b' in train but 'c' in test") as info:
        check_splits(train, ModelNetDataset([b]), "train", "test")
    assert str(a) in str(info.value) and str(b) in str(info.value)
    with pytest.raises(DataFormatError, match=r"3 classes in train, 40 in test.*ModelNet40 "
                                              r"default"):
        check_splits(train, ModelNetDataset([c]), "train", "test")
    with pytest.raises(DataFormatError, match="on the layout: SceneDataset vs ModelNetDataset"):
        check_splits(SceneDataset(scenes(tmp_path / "s.h5")), train)


# --- stale bounds attributes ----------------------------------------------------------------------
def test_stale_bounds_attribute_is_refused(tmp_path):
    path = scenes(tmp_path / "train.h5")
    with h5py.File(path, "r+") as f:
        hi = f.attrs["bounds_max"]
        hi[0] -= 0.5  # a point was added (or moved) after the attributes were written
        f.attrs["bounds_max"] = hi
    with pytest.raises(DataFormatError, match=r"train.h5: dataset '/scenes/room_0/xyz' has \d+ "
                                              r"point\(s\) outside .*bounds_max.*stale") as info:
        SceneDataset(path)
    assert "delete them" in str(info.value)
    ds = SceneDataset(path, check="structure")  # values checked when read: still refused
    with pytest.raises(DataFormatError, match="stale"):
        ds[0]


# --- grid size ------------------------------------------------------------------------------------
def test_outlier_beyond_the_key_limit_is_named(tmp_path):
    xyz, rgb, lab = scene(seed=3)
    xyz[7] = (5000.0, 1.0, 1.0)  # a stray point 5 km away
    write_scenes(tmp_path / "train.h5", [("room_0", *scene(seed=0)), ("room_far", xyz, rgb, lab)],
                 CLASSES)
    train = SceneDataset(tmp_path / "train.h5")
    val = SceneDataset(scenes(tmp_path / "val.h5"))
    with pytest.raises(GridSizeError) as info:
        grid_for([train, val], 0.05)
    msg = str(info.value)
    assert f"at most {MAX_EXTENT} voxels per axis" in msg
    assert "highest: x = 5000 m in scene 'room_far' of" in msg and str(train.path) in msg
    assert "--voxel-size" in msg
    # The suggested voxel size does fit.
    suggested = float(msg.split("voxels of at least ")[1].split(" m")[0])
    _, shape = grid_for([train, val], suggested)
    assert max(shape) <= MAX_EXTENT
    assert grid_for([train, val], 0.1)[1][0] <= MAX_EXTENT  # 5 km at 0.1 m fits


def test_tiny_voxel_size_is_refused_with_the_smallest_that_fits(tmp_path):
    train = SceneDataset(scenes(tmp_path / "train.h5"))
    with pytest.raises(GridSizeError, match=r"voxels of 5e-05 m, but a sparse tensor holds at "
                                            r"most 65536 .*use voxels of at least 6\.\d+e-05 m"):
        grid_for(train, 0.00005)


def test_modelnet_outlier_is_named(tmp_path):
    data = np.random.default_rng(0).standard_normal((6, 16, 3))
    data[4, 3] = (-9000.0, 0, 0)
    path = write_modelnet(tmp_path / "train0.h5", data, np.arange(6) % 3, ["a", "b", "c"])
    with pytest.raises(GridSizeError, match=r"Lowest: x = -9000 m in object 4 \(row 4 of .*"
                                            r"train0.h5\)"):
        grid_for(ModelNetDataset([path]), 0.1)


# --- augmentation never drops a point -------------------------------------------------------------
def test_augmented_points_on_the_data_edge_stay_on_the_grid():
    """Points exactly on the data's bounding box: flips put them on the far edge and jitter pushes
    them out, unless the grid has the augmentation margin. Nothing may be dropped silently."""
    corners = np.array([[x, y, z] for x in (0.0, 1.55) for y in (0.0, 1.55) for z in (0.0, 0.75)],
                       dtype=np.float32)
    pts = np.concatenate([corners, np.random.default_rng(0).random((40, 3)) * [1.55, 1.55, 0.75]])
    s = Sample(pts.astype(np.float32), np.ones((len(pts), 1), np.float32),
               np.zeros(len(pts), np.int64), None, "edge")

    class Bounds:
        def bounds(self):
            return pts.min(0).astype(np.float64), pts.max(0).astype(np.float64)

    origin, shape = grid_for(Bounds(), 0.1)
    assert (np.array(origin) <= -augment_margin() + 1e-9).all()
    for seed in range(32):
        b = collate([s], 0.1, origin, shape, augment=True,
                    generator=torch.Generator().manual_seed(seed))
        assert (b.point_to_voxel[0] >= 0).all(), seed
        b.x.validate()
