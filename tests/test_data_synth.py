"""The synthetic generator: both layouts round-trip through their loaders, same seed same data."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from sparsepipe_hpc.data import ModelNetDataset, SceneDataset
from sparsepipe_hpc.data import synth
from sparsepipe_hpc.data.shapes import SHAPES, area, sample_surface

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    rc = synth.main(["--out", str(out), "--task", "both", "--scenes", "4", "--val-scenes", "2",
                     "--objects", "60", "--test-objects", "12", "--points", "256",
                     "--per-file", "25", "--seed", "3"])
    assert rc == 0
    return out


def test_scene_round_trip(both):
    train = SceneDataset(both / "scenes", "train")
    val = SceneDataset(both / "scenes" / "val.h5")
    assert (len(train), len(val)) == (4, 2)
    assert train.class_names == list(synth.SEG_CLASSES) and train.num_classes == 8
    assert train.in_channels == 3
    seen = np.zeros(8, dtype=np.int64)
    for i in range(len(train)):
        s = train[i]
        assert s.points.dtype == np.float32 and s.points.shape[1] == 3
        assert s.feats.dtype == np.float32 and s.feats.shape == (s.num_points, 3)
        assert 0.0 <= s.feats.min() and s.feats.max() <= 1.0
        assert s.labels.dtype == np.int64 and s.labels.shape == (s.num_points,)
        assert s.label is None and s.name == f"room_{i:04d}"
        assert 20_000 <= s.num_points <= 60_000
        seen += np.bincount(s.labels, minlength=8)
        # Nothing below the floor or flying off: every point within the room's box (+ noise).
        lo, hi = s.points.min(0), s.points.max(0)
        assert lo[2] > -0.05 and hi[2] < 3.0 and (lo[:2] > -0.05).all() and (hi[:2] < 4.5).all()
        with h5py.File(both / "scenes" / "train.h5") as f:
            np.testing.assert_array_equal(f["scenes"][s.name]["xyz"][()], s.points)
    assert (seen > 0).all(), seen  # every class occurs
    lo, hi = train.bounds()
    assert (lo <= np.min([train[i].points.min(0) for i in range(4)], 0)).all()


def test_objects_round_trip(both):
    d = both / "modelnet"
    assert sorted(p.name for p in d.glob("*.h5")) == ["test0.h5", "train0.h5", "train1.h5",
                                                      "train2.h5"]
    train = ModelNetDataset(d, "train")
    test = ModelNetDataset(d, "test", num_points=100)
    assert (len(train), len(test)) == (60, 12)
    assert train.class_names == list(synth.CLS_CLASSES) and train.num_classes == 6
    labels = [train[i].label for i in range(len(train))]
    assert labels == [i % 6 for i in range(60)]  # across three files, in order
    s = train[27]
    assert s.name == "train1/2" and s.points.shape == (256, 3) and s.feats.shape == (256, 1)
    norms = np.linalg.norm(s.points, axis=1)
    assert abs(norms.max() - 1.0) < 1e-5
    assert np.abs(s.points.mean(0)).max() < 1e-5
    assert test[0].points.shape == (100, 3)
    with h5py.File(d / "train0.h5") as f:
        assert f["label"].shape == (25, 1) and f["label"].dtype.kind == "u"


def test_same_seed_same_arrays(tmp_path):
    a = synth.generate_scenes(tmp_path / "a", 2, 1, seed=7, points=(2000, 3000))
    b = synth.generate_scenes(tmp_path / "b", 2, 1, seed=7, points=(2000, 3000))
    c = synth.generate_scenes(tmp_path / "c", 3, 1, seed=7, points=(2000, 3000))
    d = synth.generate_scenes(tmp_path / "d", 2, 1, seed=8, points=(2000, 3000))
    for split in ("train", "val"):
        x, y = SceneDataset(a, split), SceneDataset(b, split)
        for i in range(len(x)):
            for field in ("points", "feats", "labels"):
                np.testing.assert_array_equal(getattr(x[i], field), getattr(y[i], field))
    # Room i does not depend on how many rooms are made; another seed gives other rooms.
    np.testing.assert_array_equal(SceneDataset(c, "train")[1].points,
                                  SceneDataset(a, "train")[1].points)
    assert SceneDataset(d, "train")[0].num_points != SceneDataset(a, "train")[0].num_points
    o1 = synth.generate_objects(tmp_path / "a", 12, 6, points=64, seed=7)
    o2 = synth.generate_objects(tmp_path / "b", 12, 6, points=64, seed=7)
    for split in ("train", "test"):
        with h5py.File(o1 / f"{split}0.h5") as f, h5py.File(o2 / f"{split}0.h5") as g:
            np.testing.assert_array_equal(f["data"][()], g["data"][()])
            np.testing.assert_array_equal(f["label"][()], g["label"][()])


@pytest.mark.parametrize("kind", SHAPES)
def test_shapes_sample_their_surface(kind):
    rng = np.random.default_rng(0)
    p = synth.random_params(kind, rng)
    pts = sample_surface(kind, p, 5000, rng)
    assert pts.shape == (5000, 3) and np.isfinite(pts).all()
    assert pts[:, 2].min() > -1e-9  # resting frame: nothing below z = 0
    assert area(kind, p) > 0
    if kind == "sphere":
        centre = np.array([0, 0, p["r"]])
        np.testing.assert_allclose(np.linalg.norm(pts - centre, axis=1), p["r"], rtol=1e-9)
    if kind == "box":  # uniform by area: each face pair gets its share of the points
        sx, sy, sz = p["sx"], p["sy"], p["sz"]
        on_top = np.isclose(pts[:, 2], sz).mean()
        assert abs(on_top - sx * sy / area(kind, p)) < 0.03


def test_room_variety():
    rooms = [synth.make_room(np.random.default_rng(i)) for i in range(6)]
    counts = [len(r[0]) for r in rooms]
    assert len(set(counts)) == 6
    # Colour does not give the class away: the same class has different colours across rooms.
    box_colours = [r[1][r[2] == 2].mean(0) for r in rooms if (r[2] == 2).any()]
    assert np.ptp(np.array(box_colours), axis=0).max() > 30
