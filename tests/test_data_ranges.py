"""Reading and augmenting part of a sample: rows [start, stop) equal those of the whole sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsepipe_hpc.data.loader as loader
from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.scenes import SceneDataset, write_scenes

ORIGIN, SHAPE, VOXEL = (-1.0, -1.0, -0.5), (32, 32, 16), 0.0625


@pytest.mark.parametrize("chunk", [16, 48, loader.NOISE_CHUNK])
@pytest.mark.parametrize("total", [1, 5, 6, 16, 17, 100, 1000])
def test_augment_range_equals_whole(monkeypatch, chunk, total):
    monkeypatch.setattr(loader, "NOISE_CHUNK", chunk)
    rng = np.random.default_rng(total)
    pts = torch.from_numpy(rng.uniform(-0.9, 0.9, (total, 3)))
    for seed in range(4):  # different coins: flips and swap on and off
        whole = loader.augment_points(pts.clone(), ORIGIN, SHAPE, VOXEL,
                                      torch.Generator().manual_seed(seed))
        cuts = sorted({0, total, *rng.integers(0, total + 1, 3).tolist()})
        for a, b in zip(cuts[:-1], cuts[1:]):
            part = loader.augment_points_range(pts[a:b].clone(), a, total, ORIGIN, SHAPE, VOXEL,
                                               torch.Generator().manual_seed(seed))
            assert torch.equal(part, whole[a:b])


def test_augment_range_refuses_rows_outside():
    with pytest.raises(ValueError, match=r"rows \[3, 5\) are not inside a sample of 4 points"):
        loader.augment_points_range(torch.zeros(2, 3), 3, 4, ORIGIN, SHAPE, VOXEL, None)


def test_read_range_equals_slices(tmp_path):
    rng = np.random.default_rng(0)
    xyz = rng.uniform(-1, 1, (50, 3))
    rgb = rng.integers(0, 256, (50, 3)).astype(np.uint8)
    lab = rng.integers(0, 3, 50)
    ds = SceneDataset(write_scenes(tmp_path / "s.h5", [("a", xyz, rgb, lab)], ["p", "q", "r"]))
    whole = ds[0]
    for a, b in [(0, 50), (0, 0), (7, 31), (49, 50)]:
        part = ds.read_range(0, a, b)
        assert np.array_equal(part.points, whole.points[a:b])
        assert np.array_equal(part.feats, whole.feats[a:b])
        assert np.array_equal(part.labels, whole.labels[a:b])
    with pytest.raises(IndexError, match=r"\[40, 51\) is not inside scene 'a'"):
        ds.read_range(0, 40, 51)


def test_read_range_names_a_nan_in_its_range(tmp_path):
    xyz = np.zeros((20, 3))
    xyz[12, 1] = np.nan
    path = write_scenes(tmp_path / "s.h5", [("a", xyz, None, np.zeros(20, int))], ["p"])
    ds = SceneDataset(path, check="structure")
    assert len(ds.read_range(0, 0, 10).points) == 10  # the NaN is not in this range
    with pytest.raises(DataFormatError,
                       match=r"xyz\[10:20\]' must be finite; 1 NaN.*first at index \(12, 1\)"):
        ds.read_range(0, 10, 20)


@pytest.mark.parametrize("chunk", [16, 32])
def test_range_augmenter_streams_consecutive_ranges(monkeypatch, chunk):
    monkeypatch.setattr(loader, "NOISE_CHUNK", chunk)
    total = 301
    pts = torch.from_numpy(np.random.default_rng(1).uniform(-0.9, 0.9, (total, 3)))
    for seed in range(4):
        whole = loader.augment_points(pts.clone(), ORIGIN, SHAPE, VOXEL,
                                      torch.Generator().manual_seed(seed))
        aug = loader.RangeAugmenter(total, ORIGIN, SHAPE, VOXEL,
                                    torch.Generator().manual_seed(seed))
        # within one chunk, across chunks, a forward skip, and into the merged last chunk
        for a, b in [(0, 5), (5, 40), (40, 41), (90, 200), (200, 301)]:
            assert torch.equal(aug(pts[a:b].clone(), a), whole[a:b])
        with pytest.raises(ValueError, match="increasing order"):
            aug(pts[0:3], 0)
