"""Reading and augmenting part of a sample: rows [start, stop) equal those of the whole sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsepipe_hpc.data.loader as loader
from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.scenes import SceneDataset, write_scenes

ORIGIN, SHAPE, VOXEL = (-1.0, -1.0, -0.5), (32, 32, 16), 0.0625


@pytest.mark.parametrize("block", [16, 48, 50, loader.NOISE_BLOCK])
@pytest.mark.parametrize("total", [1, 5, 6, 16, 17, 100, 1000])
def test_augment_range_equals_whole(monkeypatch, block, total):
    monkeypatch.setattr(loader, "NOISE_BLOCK", block)
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


@pytest.mark.parametrize("a, b", [(0, 1000), (5, 40), (17, 31), (47, 49), (48, 96), (50, 1000),
                                  (333, 334), (999, 1000), (100, 100), (960, 1000)])
def test_range_jitter_is_the_slice_of_the_whole_samples(monkeypatch, a, b):
    # Ranges starting and ending mid-block (block 48: 1000 rows = 20 whole blocks + 40), the
    # short last block, an empty range; jitter alone (no coins can hide a wrong row).
    monkeypatch.setattr(loader, "NOISE_BLOCK", 48)
    total, sigma = 1000, 0.01
    pts = torch.zeros((total, 3), dtype=torch.float64)
    centre = torch.tensor([o + s * VOXEL / 2 for o, s in zip(ORIGIN, SHAPE)], dtype=torch.float64)
    assert not centre.any()  # points at the grid's centre 0: flips and swap leave them alone,
    # and subtracting the centre is exact
    for seed in range(3):
        whole = loader.augment_points(pts.clone(), ORIGIN, SHAPE, VOXEL,
                                      torch.Generator().manual_seed(seed), sigma) - centre
        assert whole.abs().max() > 0 and whole.abs().max() <= 3 * sigma  # jitter, clamped
        part = loader.augment_points_range(pts[a:b].clone(), a, total, ORIGIN, SHAPE, VOXEL,
                                           torch.Generator().manual_seed(seed), sigma) - centre
        assert torch.equal(part, whole[a:b])
        # and it is the blocks' own draws: row r's noise is row r % 48 of block r // 48
        key = loader.jitter_key(_after_coins(seed))
        for r in {a, b - 1} if b > a else set():
            block = loader.jitter_block(key, r // 48, min(48, total - r // 48 * 48))
            want = (block[r % 48] * sigma).clamp(-3 * sigma, 3 * sigma)
            assert torch.equal(whole[r], want)


def _after_coins(seed: int) -> torch.Generator:
    g = torch.Generator().manual_seed(seed)
    torch.rand(3, generator=g, dtype=torch.float64)
    return g


@pytest.mark.parametrize("a, b", [(0, 1), (0, 64), (63, 65), (130, 200), (640, 1000),
                                  (999, 1000), (500, 500)])
def test_range_draws_only_the_blocks_it_meets(monkeypatch, a, b):
    # Counts rows of Gaussian noise drawn (torch.randn, whatever draws it): a range [a, b) of a
    # 1000-row sample costs the 64-row blocks meeting it, not every row before b.
    monkeypatch.setattr(loader, "NOISE_BLOCK", 64)
    drawn: list[int] = []
    randn = torch.randn

    def counting(*args, **kw):
        out = randn(*args, **kw)
        drawn.append(len(out))
        return out

    monkeypatch.setattr(torch, "randn", counting)
    total = 1000
    pts = torch.zeros((b - a, 3), dtype=torch.float64)
    aug = loader.RangeAugmenter(total, ORIGIN, SHAPE, VOXEL, torch.Generator().manual_seed(1))
    aug(pts, a)
    blocks = range(a // 64, (b - 1) // 64 + 1) if b > a else range(0)
    assert aug.blocks_drawn == len(blocks)
    assert sum(drawn) == sum(min(64, total - k * 64) for k in blocks)


def test_range_augmenter_draws_a_shared_block_once(monkeypatch):
    monkeypatch.setattr(loader, "NOISE_BLOCK", 64)
    aug = loader.RangeAugmenter(1000, ORIGIN, SHAPE, VOXEL, torch.Generator().manual_seed(1))
    for a, b in [(10, 20), (20, 70), (70, 100), (100, 128)]:  # blocks 0, 0-1, 1, 1
        aug(torch.zeros((b - a, 3), dtype=torch.float64), a)
    assert aug.blocks_drawn == 2


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


@pytest.mark.parametrize("block", [16, 32])
def test_range_augmenter_takes_ranges_in_any_order(monkeypatch, block):
    monkeypatch.setattr(loader, "NOISE_BLOCK", block)
    total = 301
    pts = torch.from_numpy(np.random.default_rng(1).uniform(-0.9, 0.9, (total, 3)))
    for seed in range(4):
        whole = loader.augment_points(pts.clone(), ORIGIN, SHAPE, VOXEL,
                                      torch.Generator().manual_seed(seed))
        aug = loader.RangeAugmenter(total, ORIGIN, SHAPE, VOXEL,
                                    torch.Generator().manual_seed(seed))
        # within one block, across blocks, a forward skip, the short last block, then back
        for a, b in [(0, 5), (5, 40), (40, 41), (90, 200), (200, 301), (0, 3), (150, 160)]:
            assert torch.equal(aug(pts[a:b].clone(), a), whole[a:b])


def test_augment_points_draws_a_key_not_the_rows(monkeypatch):
    # The generator moves by the coins and one key, whatever the sample's size, so samples
    # sharing one generator (collate with a single generator) get independent jitter.
    moved = []
    for total in (10, 1000):
        g = torch.Generator().manual_seed(3)
        loader.augment_points(torch.zeros((total, 3), dtype=torch.float64), ORIGIN, SHAPE,
                              VOXEL, g)
        moved.append(torch.rand(1, generator=g))
    assert torch.equal(moved[0], moved[1])
    g = torch.Generator().manual_seed(3)
    first = loader.augment_points(torch.zeros((50, 3), dtype=torch.float64), ORIGIN, SHAPE,
                                  VOXEL, g)
    second = loader.augment_points(torch.zeros((50, 3), dtype=torch.float64), ORIGIN, SHAPE,
                                   VOXEL, g)
    assert not torch.equal(first, second)
