"""Corrupt or mis-shaped files raise DataFormatError naming the file, the dataset and the rule."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from sparsepipe_hpc.data import (DataFormatError, ModelNetDataset, SceneDataset, write_modelnet,
                                 write_scenes)

torch.set_num_threads(1)

CLASSES = ["floor", "wall", "box"]


def scene(n=50, seed=0, rgb=True):
    rng = np.random.default_rng(seed)
    return (rng.random((n, 3)).astype(np.float32) * 4,
            rng.integers(0, 256, (n, 3), dtype=np.uint8) if rgb else None,
            rng.integers(0, 3, n).astype(np.int64))


@pytest.fixture
def scenes_file(tmp_path):
    path = tmp_path / "train.h5"
    write_scenes(path, [(f"s{i}", *scene(seed=i)) for i in range(3)], CLASSES)
    return path


@pytest.fixture
def modelnet_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "train0.h5"
    write_modelnet(path, rng.standard_normal((10, 32, 3)), np.arange(10) % 4,
                   ["a", "b", "c", "d"])
    return path


def edit(path, fn):
    with h5py.File(path, "r+") as f:
        fn(f)


def replace(f, name, data):
    del f[name]
    f.create_dataset(name, data=data)


def expect(make, path, *words):
    with pytest.raises(DataFormatError) as info:
        make()
    msg = str(info.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


# --- scene layout --------------------------------------------------------------------------------
def test_valid_scene_file_loads(scenes_file):
    ds = SceneDataset(scenes_file)
    assert len(ds) == 3 and ds.num_classes == 3 and ds.in_channels == 3
    s = ds[1]
    assert s.feats.dtype == np.float32 and s.feats.max() <= 1.0
    np.testing.assert_array_equal(s.labels, scene(seed=1)[2])


def test_scene_float_rgb_and_no_rgb(tmp_path):
    xyz, rgb, lab = scene()
    write_scenes(tmp_path / "f.h5", [("a", xyz, rgb / 255.0, lab)], CLASSES)
    np.testing.assert_allclose(SceneDataset(tmp_path / "f.h5")[0].feats, rgb / 255.0, rtol=1e-6)
    write_scenes(tmp_path / "n.h5", [("a", xyz, None, lab)], CLASSES)
    ds = SceneDataset(tmp_path / "n.h5")
    assert ds.in_channels == 1 and (ds[0].feats == 1).all() and ds[0].feats.shape == (50, 1)


@pytest.mark.parametrize("check", ["full", "structure"])
def test_truncated_scene_file(scenes_file, check):
    data = scenes_file.read_bytes()
    scenes_file.write_bytes(data[: len(data) // 2])
    expect(lambda: SceneDataset(scenes_file, check=check), scenes_file, "truncated")


def test_not_hdf5(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("this is not HDF5\n" * 100)
    expect(lambda: SceneDataset(path), path, "not an HDF5 file")
    expect(lambda: ModelNetDataset(path), path, "not an HDF5 file")
    expect(lambda: SceneDataset(tmp_path / "missing.h5"), tmp_path / "missing.h5", "no such file")


@pytest.mark.parametrize("name, words", [
    ("scenes/s1/xyz", ["missing dataset 'xyz'", "/scenes/s1"]),
    ("scenes/s2/label", ["missing dataset 'label'", "/scenes/s2"]),
])
def test_scene_missing_dataset(scenes_file, name, words):
    edit(scenes_file, lambda f: f.__delitem__(name))
    expect(lambda: SceneDataset(scenes_file), scenes_file, *words)


def test_scene_missing_attrs_and_groups(scenes_file):
    edit(scenes_file, lambda f: f.attrs.__setitem__("format", "something-else"))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "'format' must be 'sparsepipe-scenes'")
    edit(scenes_file, lambda f: f.attrs.__setitem__("format", "sparsepipe-scenes"))
    edit(scenes_file, lambda f: f.attrs.__setitem__("version", 2))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "'version' must be 1", "2")
    edit(scenes_file, lambda f: f.attrs.__setitem__("version", 1))
    edit(scenes_file, lambda f: f.attrs.__delitem__("class_names"))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "missing attribute 'class_names'")
    edit(scenes_file, lambda f: f.attrs.__setitem__("class_names", CLASSES))
    SceneDataset(scenes_file)
    edit(scenes_file, lambda f: f.__delitem__("scenes"))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "missing group 'scenes'")


@pytest.mark.parametrize("name, data, words", [
    ("scenes/s0/xyz", np.zeros((50, 2), np.float32), ["/scenes/s0/xyz", "[P, 3]", "(50, 2)"]),
    ("scenes/s0/label", np.zeros(49, np.int64), ["/scenes/s0/label", "P = 50", "(49,)"]),
    ("scenes/s0/rgb", np.zeros((50, 4), np.uint8), ["/scenes/s0/rgb", "[P, 3]", "(50, 4)"]),
    ("scenes/s1/xyz", np.zeros((0, 3), np.float32), ["s1", "empty"]),
])
def test_scene_wrong_shape(scenes_file, name, data, words):
    edit(scenes_file, lambda f: replace(f, name, data))
    expect(lambda: SceneDataset(scenes_file), scenes_file, *words)


@pytest.mark.parametrize("name, data, words", [
    ("scenes/s0/xyz", np.zeros((50, 3), np.int32), ["/scenes/s0/xyz", "floating point", "int32"]),
    ("scenes/s0/label", np.zeros(50, np.float32), ["/scenes/s0/label", "integer", "float32"]),
    ("scenes/s0/rgb", np.zeros((50, 3), np.int16), ["/scenes/s0/rgb", "uint8", "int16"]),
])
def test_scene_wrong_dtype(scenes_file, name, data, words):
    edit(scenes_file, lambda f: replace(f, name, data))
    expect(lambda: SceneDataset(scenes_file), scenes_file, *words)


def test_scene_nan(scenes_file):
    xyz = scene(seed=2)[0]
    xyz[7, 1] = np.nan
    edit(scenes_file, lambda f: replace(f, "scenes/s2/xyz", xyz))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "/scenes/s2/xyz", "finite", "(7, 1)")
    # The structure-only check defers the value scan to the read of that scene.
    ds = SceneDataset(scenes_file, check="structure")
    ds[0]
    expect(lambda: ds[2], scenes_file, "/scenes/s2/xyz", "finite")


def test_the_full_check_reads_scenes_in_blocks(scenes_file, monkeypatch):
    """Its memory does not grow with a scene: blocks of CHECK_BLOCK points, every value checked
    and the bounds the same as from whole scenes."""
    import sparsepipe_hpc.data.scenes as scenes

    whole = SceneDataset(scenes_file)
    reads = []
    real = scenes.read
    monkeypatch.setattr(scenes, "CHECK_BLOCK", 16)
    monkeypatch.setattr(scenes, "read", lambda p, ds, sel=(): reads.append(sel) or
                        real(p, ds, sel))
    blocked = SceneDataset(scenes_file)
    assert all(isinstance(sel, slice) and sel.stop - sel.start <= 16 for sel in reads)
    assert all(np.array_equal(a, b) for a, b in zip(blocked.bounds(), whole.bounds()))
    assert blocked.digest == whole.digest is not None  # the content's, not the blocks'
    xyz = scene(seed=2)[0]
    xyz[37, 1] = np.nan  # in the third block
    edit(scenes_file, lambda f: replace(f, "scenes/s2/xyz", xyz))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "/scenes/s2/xyz[32:48]", "finite",
           "(37, 1)")


@pytest.mark.parametrize("bad", [3, -1, 200])
def test_scene_label_out_of_range(scenes_file, bad):
    label = scene(seed=0)[2]
    label[5] = bad
    edit(scenes_file, lambda f: replace(f, "scenes/s0/label", label))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "/scenes/s0/label", "[0, 2]",
           "3 classes", f"first offender {bad}")


def test_scene_float_rgb_out_of_range(scenes_file):
    edit(scenes_file, lambda f: replace(f, "scenes/s0/rgb", np.full((50, 3), 2.0)))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "/scenes/s0/rgb", "[0.0, 1.0]")


def test_scene_rgb_in_some_scenes_only(scenes_file):
    edit(scenes_file, lambda f: f.__delitem__("scenes/s1/rgb"))
    expect(lambda: SceneDataset(scenes_file), scenes_file, "'s1' lacks 'rgb'", "every scene")


def test_scene_directory_needs_split(scenes_file):
    expect(lambda: SceneDataset(scenes_file.parent), scenes_file.parent, "split=")
    assert len(SceneDataset(scenes_file.parent, "train")) == 3


def test_modelnet_file_is_not_a_scene_file(modelnet_file):
    expect(lambda: SceneDataset(modelnet_file), modelnet_file, "'format'", "ModelNetDataset")


# --- ModelNet layout -----------------------------------------------------------------------------
def test_valid_modelnet_file_loads(modelnet_file):
    ds = ModelNetDataset(modelnet_file)
    assert len(ds) == 10 and ds.num_classes == 4 and ds.class_names == ["a", "b", "c", "d"]
    assert ds[5].label == 1 and ds[-1].label == 1
    with pytest.raises(IndexError):
        ds[10]


def test_modelnet_label_dtypes_and_shapes(tmp_path):
    rng = np.random.default_rng(0)
    for dtype, shape in [(np.uint8, (6, 1)), (np.int64, (6, 1)), (np.int32, (6,)),
                         (np.uint16, (6,))]:
        path = tmp_path / f"train_{np.dtype(dtype).name}.h5"
        with h5py.File(path, "w") as f:
            f["data"] = rng.standard_normal((6, 16, 3)).astype(np.float32)
            f["label"] = (np.arange(6) * 5).astype(dtype).reshape(shape)
        ds = ModelNetDataset([path])  # no names anywhere: ModelNet40's 40 classes
        assert ds.num_classes == 40 and [ds[i].label for i in range(6)] == [0, 5, 10, 15, 20, 25]


def test_modelnet_names_from_shape_names_txt(tmp_path):
    with h5py.File(tmp_path / "ply_data_test0.h5", "w") as f:
        f["data"] = np.zeros((2, 8, 3), np.float32)
        f["label"] = np.array([[0], [1]], np.uint8)
    (tmp_path / "shape_names.txt").write_text("airplane\nbathtub\n")
    ds = ModelNetDataset(tmp_path, "test")
    assert ds.class_names == ["airplane", "bathtub"]


def test_modelnet_natural_file_order(tmp_path):
    for k in (0, 2, 10):
        write_modelnet(tmp_path / f"train{k}.h5", np.zeros((1, 4, 3)), [k], None)
    ds = ModelNetDataset(tmp_path, "train")
    assert [p.name for p in ds.files] == ["train0.h5", "train2.h5", "train10.h5"]
    assert [ds[i].label for i in range(3)] == [0, 2, 10]


def test_modelnet_split_is_a_word_of_the_file_name(tmp_path):
    """``train_latest.h5`` is a training file, not a test one ("latest" holds "test"); a name
    with two splits is refused, where both splits read it and test accuracy would be inflated."""
    from sparsepipe_hpc.data.modelnet import split_files

    for name in ("ply_data_train0.h5", "ply_data_test0.h5", "train_latest.h5", "contest1.h5",
                 "training_objects.h5"):
        write_modelnet(tmp_path / name, np.zeros((1, 4, 3)), [0], None)
    assert [p.name for p in split_files(tmp_path, "train")] == ["ply_data_train0.h5",
                                                                "train_latest.h5",
                                                                "training_objects.h5"]
    assert [p.name for p in split_files(tmp_path, "test")] == ["ply_data_test0.h5"]
    write_modelnet(tmp_path / "train_test.h5", np.zeros((1, 4, 3)), [0], None)
    for split in ("train", "test"):
        expect(lambda: split_files(tmp_path, split), tmp_path / "train_test.h5",
               f"names split '{split}' and also")


def test_modelnet_no_files_for_split(tmp_path, modelnet_file):
    expect(lambda: ModelNetDataset(tmp_path, "test"), tmp_path,
           "no *.h5 file names split 'test' as a word")


@pytest.mark.parametrize("check", ["full", "structure"])
def test_truncated_modelnet_file(modelnet_file, check):
    data = modelnet_file.read_bytes()
    modelnet_file.write_bytes(data[: len(data) - 200])
    expect(lambda: ModelNetDataset([modelnet_file], check=check), modelnet_file, "truncated")


@pytest.mark.parametrize("name", ["data", "label"])
def test_modelnet_missing_dataset(modelnet_file, name):
    edit(modelnet_file, lambda f: f.__delitem__(name))
    expect(lambda: ModelNetDataset(modelnet_file), modelnet_file, f"missing dataset '{name}'")


@pytest.mark.parametrize("name, data, words", [
    ("data", np.zeros((10, 32, 2), np.float32), ["'/data'", "[S, P, 3]", "(10, 32, 2)"]),
    ("data", np.zeros((10, 96), np.float32), ["'/data'", "[S, P, 3]", "(10, 96)"]),
    ("label", np.zeros((9, 1), np.uint8), ["'/label'", "S = 10", "(9, 1)"]),
    ("label", np.zeros((10, 2), np.uint8), ["'/label'", "[S, 1] or [S]", "(10, 2)"]),
])
def test_modelnet_wrong_shape(modelnet_file, name, data, words):
    edit(modelnet_file, lambda f: replace(f, name, data))
    expect(lambda: ModelNetDataset(modelnet_file), modelnet_file, *words)


@pytest.mark.parametrize("name, data, words", [
    ("data", np.zeros((10, 32, 3), np.int16), ["'/data'", "floating point", "int16"]),
    ("label", np.zeros((10, 1), np.float64), ["'/label'", "integer", "float64"]),
])
def test_modelnet_wrong_dtype(modelnet_file, name, data, words):
    edit(modelnet_file, lambda f: replace(f, name, data))
    expect(lambda: ModelNetDataset(modelnet_file), modelnet_file, *words)


def test_modelnet_nan_and_inf(modelnet_file):
    def poison(f):
        d = f["data"][()]
        d[3, 4, 2] = np.inf
        replace(f, "data", d)
    edit(modelnet_file, poison)
    expect(lambda: ModelNetDataset(modelnet_file), modelnet_file, "'/data'", "finite",
           "(3, 4, 2)")
    ds = ModelNetDataset(modelnet_file, check="structure")
    expect(lambda: ds[3], modelnet_file, "/data[3]", "finite")


def test_modelnet_label_out_of_range(modelnet_file):
    edit(modelnet_file, lambda f: replace(f, "label", np.array([[0]] * 9 + [[4]], np.uint8)))
    expect(lambda: ModelNetDataset(modelnet_file), modelnet_file, "'/label'", "[0, 3]",
           "4 classes")


def test_modelnet_num_points(modelnet_file):
    assert ModelNetDataset(modelnet_file, num_points=8)[0].points.shape == (8, 3)
    with pytest.raises(ValueError, match=r"num_points must lie in \[1, 32\]"):
        ModelNetDataset(modelnet_file, num_points=33)


@pytest.mark.parametrize("dtype, stored", [(">f8", np.float64), ("<f8", np.float64),
                                           (">f4", np.float32), ("i4", np.float64)])
def test_coordinates_keep_their_precision_whatever_the_byte_order(tmp_path, dtype, stored):
    """Big-endian doubles (a foreign writer's, a binary PLY's) are doubles: at UTM coordinates
    a float32 step is 0.25-0.5 m, so voxels would merge."""
    xyz = np.array([[500000.123, 4200000.456, 100.0], [500003.25, 4200002.5, 102.0]])
    xyz = np.round(xyz) if dtype == "i4" else xyz
    path = write_scenes(tmp_path / "utm.h5", [("s", xyz.astype(dtype), None, np.zeros(2, int))],
                        CLASSES)
    with h5py.File(path) as f:
        assert f["scenes/s/xyz"].dtype == stored
    def foreign(f):  # a foreign writer's file: big-endian doubles, no bounds attributes
        replace(f, "scenes/s/xyz", xyz.astype(">f8"))
        del f.attrs["bounds_min"], f.attrs["bounds_max"]

    edit(path, foreign)
    got = SceneDataset(path)[0].points
    assert got.dtype == np.float64 and np.array_equal(got, xyz.astype(">f8").astype(np.float64))


@pytest.mark.parametrize("name, words", [("Area_1/office_1", "without '/'"), ("", "non-empty"),
                                         ("s0", "each used once")])
def test_write_scenes_refuses_names_the_reader_could_not_read(tmp_path, name, words):
    scenes = [("s0", *scene()), (name, *scene(seed=1))]
    with pytest.raises(ValueError, match=words):
        write_scenes(tmp_path / "x.h5", scenes, CLASSES)
    assert not list(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(ValueError, match="'e' has no points"):
        write_scenes(tmp_path / "x.h5", [("e", np.zeros((0, 3)), None, np.zeros(0, int))],
                     CLASSES)



def test_a_file_a_writer_holds_open_is_said_to_be_locked(scenes_file):
    import os
    import subprocess
    import sys

    with h5py.File(scenes_file, "a"):  # another process appends to it meanwhile
        proc = subprocess.run(
            [sys.executable, "-c", "from sparsepipe_hpc.data.checks import open_h5; "
             f"open_h5({str(scenes_file)!r})"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "HDF5_USE_FILE_LOCKING": "TRUE"})
    assert "DataFormatError" in proc.stderr and "cannot be locked" in proc.stderr, proc.stderr
    assert "HDF5_USE_FILE_LOCKING=FALSE" in proc.stderr
