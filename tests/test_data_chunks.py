"""The chunked scene layout (sparsepipe_hpc.data.chunks) and the pure chunk geometry of the
distributed input (sparsepipe_hpc.parallel.chunked): tables, validation, corrupt files."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from halo.cuts import Cuts
from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.chunks import chunk_order
from sparsepipe_hpc.data.floor import generate_floor, write_floor
from sparsepipe_hpc.data.loader import RangeAugmenter
from sparsepipe_hpc.data.scenes import SceneDataset, write_scenes
from sparsepipe_hpc.parallel.chunked import chunk_cuts, chunk_voxels, chunks_in_box, pieces

CLASSES = ["a", "b", "c", "d"]


def cloud(rng, n):
    xyz = rng.uniform([0, 0, 0], [3.0, 2.0, 1.5], (n, 3)).astype(np.float32)
    return xyz, rng.integers(0, 256, (n, 3)).astype(np.uint8), rng.integers(0, 4, n)


@pytest.fixture
def chunked(tmp_path, rng):
    xyz, rgb, lab = cloud(rng, 3000)
    path = write_scenes(tmp_path / "c.h5", [("r", xyz, rgb, lab)], CLASSES, chunk_size=0.5)
    return path, (xyz, rgb, lab)


def test_chunk_order_tiles_the_rows_and_boxes_hold_their_points(rng):
    xyz = rng.normal(0, 2, (5000, 3))
    order, t = chunk_order(xyz, 0.7)
    assert np.array_equal(np.sort(order), np.arange(5000))
    s = xyz[order]
    assert t.offset[0] == 0 and t.count.sum() == 5000
    assert np.array_equal(t.offset[1:], np.cumsum(t.count)[:-1])
    for k in range(len(t)):
        p = s[t.offset[k]:t.offset[k] + t.count[k]]
        assert (p.min(0) == t.lo[k]).all() and (p.max(0) == t.hi[k]).all()  # tight boxes
        assert (t.hi[k] - t.lo[k] <= 0.7 + 1e-12).all()
        assert (np.diff(order[t.offset[k]:t.offset[k] + t.count[k]]) > 0).all()  # stable


def test_chunked_file_reads_as_the_sorted_scene(chunked):
    path, (xyz, rgb, lab) = chunked
    ds = SceneDataset(path)
    order, _ = chunk_order(xyz, 0.5)
    s = ds[0]
    assert np.array_equal(s.points, xyz[order]) and np.array_equal(s.labels, lab[order])
    t = ds.chunk_table(0)
    assert t is not None and t.checksum is not None and t.chunk_size == 0.5
    part = ds.read_range(0, int(t.offset[3]), int(t.offset[5]))
    assert np.array_equal(part.points, xyz[order][t.offset[3]:t.offset[5]])


def test_plain_files_have_no_chunk_table(tmp_path, rng):
    ds = SceneDataset(write_scenes(tmp_path / "p.h5", [("r", *cloud(rng, 50))], CLASSES))
    assert ds.chunk_table(0) is None


def edit(path, fn):
    with h5py.File(path, "r+") as f:
        fn(f["scenes/r"])


@pytest.mark.parametrize("fault,message", [
    ("offset", r"'/scenes/r/chunks'/offset: chunks must tile the rows in order .* chunk 2 "
               r"starts at \d+, expected \d+"),
    ("count", r"'/scenes/r/chunks'/count sums to 3001 points but the scene has 3000"),
    ("missing", r"missing dataset 'bbox_min' \(under /scenes/r/chunks"),
    ("inverted", r"bbox_min/bbox_max of chunk 1 must be finite with min <= max"),
    ("outside", r"the box of chunk 0 .* is not inside the file's bounds_min"),
    ("empty", r"every chunk must hold >= 1 point; chunk 0 has 0"),
    ("shape", r"dataset '/scenes/r/chunks/bbox_max' must have shape \[K, 3\]"),
])
def test_bad_tables_are_refused_at_open(chunked, fault, message):
    path, _ = chunked

    def damage(g):
        c = g["chunks"]
        if fault == "offset":
            o = c["offset"][...]
            o[2] += 1
            c["offset"][...] = o
        elif fault == "count":
            n = c["count"][...]
            n[-1] += 1
            c["count"][...] = n
        elif fault == "missing":
            del c["bbox_min"]
        elif fault == "inverted":
            lo = c["bbox_min"][...]
            lo[1, 0] = c["bbox_max"][1, 0] + 1
            c["bbox_min"][...] = lo
        elif fault == "outside":
            lo = c["bbox_min"][...]
            lo[0, 2] = -10.0
            c["bbox_min"][...] = lo
        elif fault == "empty":
            n = c["count"][...]
            n[1] += n[0]
            n[0] = 0
            c["count"][...] = n
            c["offset"][...] = np.concatenate([[0], np.cumsum(n)[:-1]])
        else:
            del c["bbox_max"]
            c.create_dataset("bbox_max", data=np.zeros((len(c["offset"]), 2)))
    edit(path, damage)
    for check in ("full", "structure"):
        with pytest.raises(DataFormatError, match=message):
            SceneDataset(path, check=check)


def test_a_lying_box_or_a_bad_checksum_is_found_on_read(chunked):
    path, _ = chunked
    t = SceneDataset(path).chunk_table(0)
    k = 3
    a, n = int(t.offset[k]), int(t.count[k])

    def shrink(g):  # the box no longer holds the chunk's points (a stale table)
        hi = g["chunks/bbox_max"][...]
        hi[k] = (t.lo[k] + t.hi[k]) / 2
        g["chunks/bbox_max"][...] = hi
    edit(path, shrink)
    with pytest.raises(DataFormatError, match=rf"chunk {k} \(rows {a}..{a + n - 1}\) has points "
                                              "outside its box"):
        SceneDataset(path)  # the full check reads every point
    ds = SceneDataset(path, check="structure")
    with pytest.raises(DataFormatError, match=rf"chunk {k} .* outside its box"):
        ds.read_range(0, a, a + n)
    ds.read_range(0, 0, a)  # other chunks read fine
    ds.close()

    def restore_and_corrupt(g):
        hi = g["chunks/bbox_max"][...]
        hi[k] = t.hi[k]
        g["chunks/bbox_max"][...] = hi
        x = g["xyz"][a + 1]
        g["xyz"][a + 1] = (x + t.lo[k]) / 2  # still inside the box: only the checksum sees it
    edit(path, restore_and_corrupt)
    ds = SceneDataset(path, check="structure")
    with pytest.raises(DataFormatError, match=rf"chunk {k} \(rows {a}..{a + n - 1}\) fails its "
                                              r"checksum: CRC-32 0x[0-9a-f]{8}, the table says"):
        ds.read_range(0, a, a + n)
    # A range through a part of the chunk reads the rest of it for its checksum: one rank's
    # share of a sample, cut anywhere, finds the corruption the whole sample would.
    for part in ((a, a + 1), (a + n - 1, a + n + 5), (max(a - 7, 0), a + 2)):
        with pytest.raises(DataFormatError, match=rf"chunk {k} \(rows {a}..{a + n - 1}\) fails"):
            ds.read_range(0, *part)
    ds.read_range(0, 0, a)  # the chunks before it read fine
    with pytest.raises(DataFormatError, match="fails its checksum"):
        ds[0]


def test_a_write_that_fails_leaves_no_file_and_bad_shapes_name_the_scene(tmp_path, rng):
    xyz, rgb, lab = cloud(rng, 100)

    def source():
        yield "r0", xyz, rgb, lab
        raise RuntimeError("the source failed at the second scene")
    with pytest.raises(RuntimeError, match="second scene"):
        write_scenes(tmp_path / "s.h5", source(), CLASSES)
    assert not list(tmp_path.iterdir())  # no shorter data set, no temporary file
    for bad, message in [
            ((xyz, rgb, lab[:7]), r"scene 'r': label has shape \(7,\); expected \[100\]"),
            ((xyz, rgb[:, :2], lab), r"rgb has shape \(100, 2\); expected \[100, 3\]"),
            ((xyz[:, :2], None, lab), r"xyz has shape \(100, 2\); expected \[P, 3\]")]:
        for chunk_size in (None, 0.5):
            with pytest.raises(ValueError, match=message):
                write_scenes(tmp_path / "s.h5", [("r", *bad)], CLASSES, chunk_size=chunk_size)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("attr", ["half", np.zeros(0), np.nan])
def test_an_odd_chunk_size_attribute_reads_as_unknown(chunked, attr):
    path, _ = chunked
    edit(path, lambda g: g["chunks"].attrs.__setitem__("chunk_size", attr))
    assert SceneDataset(path).chunk_table(0).chunk_size == 0.0


def test_floor_generator_writes_one_chunked_scene(tmp_path):
    ds = SceneDataset(write_floor(tmp_path / "f.h5", 30000, rooms_x=2, rooms_y=1))
    assert len(ds) == 1 and ds.sizes[0] == 30000 and ds.chunk_table(0) is not None
    lo, hi = ds.bounds()
    assert hi[0] - lo[0] > 8.0  # two rooms along x
    d = generate_floor(tmp_path, 8000, rooms_x=1, rooms_y=1, chunk_size=None)
    assert SceneDataset(d, "val").chunk_table(0) is None and SceneDataset(d, "train").sizes[0] == 8000


# --- pure geometry of the chunked read -----------------------------------------------------------

def test_pieces_merge_consecutive_chunks_up_to_a_size():
    offset = np.array([0, 10, 30, 35, 60])
    count = np.array([10, 20, 5, 25, 7])
    assert pieces(offset, count, np.array([0, 1, 2, 4]), 100) == [(0, 35, 0, 3), (60, 67, 4, 5)]
    assert pieces(offset, count, np.array([0, 1, 2]), 30) == [(0, 30, 0, 2), (30, 35, 2, 3)]
    assert pieces(offset, count, np.array([3]), 10) == [(35, 60, 3, 4)]  # one big chunk whole
    assert pieces(offset, count, np.array([], np.int64), 10) == []


def test_chunks_in_box_and_voxel_ranges():
    vlo, vhi = chunk_voxels(np.array([[0.0, 0, 0], [1.0, 0, 0], [-5.0, 0, 0]]),
                            np.array([[0.45, 1, 1], [1.25, 1, 1], [-4.0, 1, 1]]),
                            (0.0, 0.0, 0.0), 0.1, (20, 10, 10), margin=1)
    assert vlo[:, 0].tolist() == [0, 9, 0] and vhi[:, 0].tolist() == [5, 13, 0]  # clamped
    assert vhi[0, 1] == 9  # clamped to the grid's last voxel
    box = (np.array([6, 0, 0]), np.array([20, 10, 10]))
    assert chunks_in_box(vlo, vhi, *box).tolist() == [False, True, False]
    assert chunks_in_box(vlo, vhi, np.array([0, 0, 0]), np.array([6, 10, 10])).tolist() == \
        [True, False, True]
    assert not chunks_in_box(vlo, vhi, np.array([3, 0, 0]), np.array([3, 10, 10])).any()


def test_chunk_cuts_follow_the_points():
    # 900 points in x-voxels 0..7 (225 per 2-voxel unit), 100 in 24..31: the half (500) falls
    # nearest the boundary after 2 units (450), inside the dense part
    vlo = np.array([[0, 0, 0], [24, 0, 0]])
    vhi = np.array([[7, 3, 3], [31, 3, 3]])
    c = chunk_cuts([(vlo, vhi, np.array([900, 100]))], (32, 4, 4), (2, 1, 1), align=2)
    assert isinstance(c, Cuts) and c.bounds[0].tolist() == [0, 4, 32]
    assert c == chunk_cuts([(vlo[:1], vhi[:1], np.array([900])), (vlo[1:], vhi[1:],
                                                                    np.array([100]))],
                           (32, 4, 4), (2, 1, 1), align=2)  # samples add up


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), square=st.booleans(), jitter=st.sampled_from([0.0, 0.01]))
def test_augmented_boxes_hold_the_augmented_points(seed, square, jitter):
    rng = np.random.default_rng(seed)
    pts = rng.uniform(0, 3, (400, 3))
    order, t = chunk_order(pts, 0.6)
    s = torch.from_numpy(pts[order])
    shape = (32, 32, 16) if square else (32, 24, 16)
    aug = RangeAugmenter(len(s), (-0.1, -0.1, -0.1), shape, 0.1,
                         torch.Generator().manual_seed(seed), jitter)
    lo, hi = aug.box(t.lo, t.hi)
    out = aug(s.clone(), 0).numpy()
    for k in range(len(t)):
        p = out[t.offset[k]:t.offset[k] + t.count[k]]
        assert (p >= lo[k] - 1e-12).all() and (p <= hi[k] + 1e-12).all()


def test_synth_cli_writes_a_chunked_floor(tmp_path, capsys):
    from sparsepipe_hpc.data.synth import main

    assert main(["--out", str(tmp_path), "--task", "floor", "--floor-points", "6000",
                 "--floor-rooms", "2", "1", "--chunk-size", "0.75"]) == 0
    for split in ("train", "val"):
        ds = SceneDataset(tmp_path / "floor", split)
        t = ds.chunk_table(0)
        assert ds.sizes[0] == 6000 and t is not None and t.chunk_size == 0.75
    assert "wrote 2 floors of 6000 points" in capsys.readouterr().out
