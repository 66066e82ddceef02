"""The scene layout for semantic segmentation (S3DIS/ScanNet-like) and its data set.

    write_scenes("train.h5", [("room_0", xyz, rgb, label)], class_names=["floor", "wall", ...])
    ds = SceneDataset("train.h5")          # or SceneDataset(directory, "train")
    s = ds[0]                              # Sample: points [P, 3] m, feats [P, 3], labels [P]

Layout (HDF5, one file per split, e.g. ``train.h5``, ``val.h5``)::

    /                      attrs: format = "sparsepipe-scenes"    (str)
                                  version = 1                     (int)
                                  class_names = ["floor", ...]    (list of str, K >= 1 entries)
                                  bounds_min, bounds_max          (optional float [3], metres: the
                                                                   box holding every point; saves
                                                                   a scan in grid_for)
                                  voxel_size                      (optional float > 0, metres: the
                                                                   edge the points were thinned to,
                                                                   if they were; must agree across
                                                                   splits)
    /scenes/<name>/xyz     float  [P, 3]  point positions in metres, finite, P >= 1
    /scenes/<name>/rgb     uint8 [P, 3] in 0..255, or float [P, 3] in [0, 1]   (optional; present
                                          in every scene or in none)
    /scenes/<name>/label   integer [P]    class index in [0, K)
    /scenes/<name>/chunks/ optional chunk table: the points sorted by spatial chunk, each chunk's
                           rows and bounding box (:mod:`sparsepipe_hpc.data.chunks`), so that a
                           spatial rank reads only chunks near its box; write with
                           ``write_scenes(..., chunk_size=0.5)``

Scenes are ordered by name (``sorted``), so index ``i`` means the same scene on every rank. Any
float width is accepted for ``xyz`` and any integer width for ``label``; a sample hands out float32
(float64 where the file stores float64 of either byte order, so large coordinates such as UTM keep
their precision until voxelization subtracts the grid's origin) and int64; ``write_scenes`` stores
float64 coordinates, and integers of 32 bits or more, as float64. There is no "ignore" label:
unlabelled points must be dropped or given a class.

Validation: opening checks the attributes, every scene's datasets, shapes and dtypes and, with
``check="full"`` (the default), every value, read in blocks of :data:`CHECK_BLOCK` points (finite
coordinates, colours and labels in range, and
points inside ``bounds_min``/``bounds_max`` when stored: stale bounds would build a grid that misses
points). A scene that breaks a rule raises :class:`DataFormatError` naming the file, the dataset and
the rule. ``check="structure"`` skips the value scan (for very large files); values are still
checked when a scene is read. The full check also digests every value it reads
(``SceneDataset.digest``), so that a resume or a rank refuses other data of the same size.
:func:`sparsepipe_hpc.data.splits.check_splits` checks that two splits agree (classes, features,
voxel size).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import h5py
import numpy as np

from sparsepipe_hpc.data.checks import (
    DataFormatError, check_finite, check_kind, check_range, check_shape, open_h5, read,
    read_str_list, require_dataset)
from sparsepipe_hpc.data.chunks import ChunkTable, check_chunk_rows, chunk_order, \
    partial_chunks, read_chunk_table, write_chunk_table
from sparsepipe_hpc.data.sample import Sample

__all__ = ["FORMAT", "VERSION", "SceneDataset", "write_scenes"]

FORMAT = "sparsepipe-scenes"
VERSION = 1
#: Points per read of the full check at open (and of :meth:`SceneDataset.bounds`' scan): its
#: memory, whatever a scene's size.
CHECK_BLOCK = 1 << 20


def write_scenes(path: str | Path,
                 scenes: Iterable[tuple[str, np.ndarray, Optional[np.ndarray], np.ndarray]],
                 class_names: Sequence[str], attrs: Optional[dict] = None,
                 chunk_size: Optional[float] = None, checksums: bool = True) -> Path:
    """Write ``(name, xyz [P,3] m, rgb [P,3] uint8 or None, label [P] int)`` scenes to ``path``.

    Stores ``bounds_min``/``bounds_max`` of all points; ``attrs`` adds root attributes (e.g. the
    generator's parameters). ``chunk_size`` (metres): store every scene's points sorted by
    spatial chunk with a chunk table (:mod:`sparsepipe_hpc.data.chunks`; ``checksums``: with a
    CRC-32 per chunk); the stored point order is then the chunk order. Returns ``path``.

    The file is written beside ``path`` and renamed into place when complete: a scene that fails
    its shape check (ValueError, naming it) or a source that raises leaves no file that would
    open as a shorter data set.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write_scenes(tmp, scenes, class_names, attrs, chunk_size, checksums)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_scenes(path: Path,
                  scenes: Iterable[tuple[str, np.ndarray, Optional[np.ndarray], np.ndarray]],
                  class_names: Sequence[str], attrs: Optional[dict],
                  chunk_size: Optional[float], checksums: bool) -> None:
    lo = np.full(3, np.inf)
    hi = np.full(3, -np.inf)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["class_names"] = np.array(list(class_names), dtype=h5py.string_dtype())
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        group = f.create_group("scenes")
        for name, xyz, rgb, label in scenes:
            if not isinstance(name, str) or not name or "/" in name or name in group:
                raise ValueError(f"scene name {name!r}: names must be non-empty strings without "
                                 f"'/' (an HDF5 path separator), each used once")
            g = group.create_group(name)
            xyz = _coordinates(np.asarray(xyz))
            rgb = None if rgb is None else np.asarray(rgb)
            label = np.asarray(label)
            _check_scene(name, xyz, rgb, label)
            table: Optional[ChunkTable] = None
            if chunk_size is not None:
                order, table = chunk_order(xyz, chunk_size)
                xyz, label = xyz[order], label[order]
                rgb = None if rgb is None else rgb[order]
                if checksums:
                    table = table.with_checksums(xyz, rgb, label)
            g.create_dataset("xyz", data=xyz)
            if rgb is not None:
                g.create_dataset("rgb", data=rgb)
            g.create_dataset("label", data=label)
            if table is not None:
                write_chunk_table(g, table)
            lo = np.minimum(lo, xyz.min(0))
            hi = np.maximum(hi, xyz.max(0))
        if np.isfinite(lo).all():
            f.attrs["bounds_min"] = lo
            f.attrs["bounds_max"] = hi


def _coordinates(xyz: np.ndarray) -> np.ndarray:
    """``xyz`` in native byte order, float64 where its dtype holds more than float32 does (a
    double of either byte order, an integer of 32 bits or more), else float32. At UTM-like
    coordinates (5e6 m) a float32 step is 0.5 m, coarser than any voxel; voxelization subtracts
    the grid's origin in float64."""
    wide = xyz.dtype.itemsize >= (8 if xyz.dtype.kind == "f" else 4)
    return xyz.astype(np.float64 if wide else np.float32, copy=False)


def _check_scene(name: str, xyz: np.ndarray, rgb: Optional[np.ndarray], label: np.ndarray) -> None:
    """ValueError naming scene ``name`` unless xyz is [P, 3], rgb [P, 3] or None, label [P]."""
    if xyz.ndim != 2 or xyz.shape[1] != 3:
        raise ValueError(f"scene {name!r}: xyz has shape {xyz.shape}; expected [P, 3]")
    p = len(xyz)
    if p == 0:
        raise ValueError(f"scene {name!r} has no points; a scene needs P >= 1 (drop it)")
    if rgb is not None and rgb.shape != (p, 3):
        raise ValueError(f"scene {name!r}: rgb has shape {rgb.shape}; expected [{p}, 3] or None")
    if label.shape != (p,):
        raise ValueError(f"scene {name!r}: label has shape {label.shape}; expected [{p}]")


def _fmt(v: np.ndarray) -> str:
    return "[" + ", ".join(f"{float(x):.9g}" for x in v) + "]"


class SceneDataset:
    """Scenes of one split in the layout above; ``ds[i]`` is a :class:`Sample` with ``labels``.

    ``path`` is the split's file, or a directory holding ``<split>.h5``. The HDF5 file is opened
    lazily on first read and kept open, once per process (a forked worker opens its own).
    """

    def __init__(self, path: str | Path, split: Optional[str] = None, *,
                 check: str = "full") -> None:
        path = Path(path)
        if path.is_dir():
            if split is None:
                raise DataFormatError(f"{path}: is a directory; pass split= (e.g. 'train') to read "
                                      f"{path}/<split>.h5")
            path = path / f"{split}.h5"
        if check not in ("full", "structure"):
            raise ValueError(f"check must be 'full' or 'structure'; got {check!r}")
        self.path = path
        self.split = split
        self._file: Optional[h5py.File] = None
        self._pid = -1
        self._bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
        self._stored_bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
        self._scene_bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
        self.voxel_size: Optional[float] = None
        self._chunks: dict[str, Optional[ChunkTable]] = {}
        # The full check reads every value: a digest of them costs no more reading (see digest).
        content = hashlib.blake2b(digest_size=16) if check == "full" else None
        with open_h5(path) as f:
            self._read_header(f)
            checked = [self._check_scene(f, n, content) for n in self.names]
        #: hex digest of every scene's name and values as read (None with check="structure"):
        #: what tells two files of equal size apart, for a resume or another rank's copy.
        self.digest: Optional[str] = None if content is None else content.hexdigest()
        sizes = [n for n, _ in checked]
        if check == "full":  # every scene was read: keep each one's box (names outliers)
            self._scene_bounds = (np.stack([b[0] for _, b in checked]),  # type: ignore[index]
                                  np.stack([b[1] for _, b in checked]))  # type: ignore[index]
            if self._bounds is None:
                self._bounds = (self._scene_bounds[0].min(0), self._scene_bounds[1].max(0))
        self.sizes = np.asarray(sizes, dtype=np.int64)

    # --- header and per-scene validation --------------------------------------------------------
    def _read_header(self, f: h5py.File) -> None:
        p = self.path
        fmt = f.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode()
        if fmt != FORMAT:
            raise DataFormatError(f"{p}: root attribute 'format' must be '{FORMAT}'; got {fmt!r} "
                                  "(is this a scene file? ModelNet files go to ModelNetDataset)")
        version = f.attrs.get("version")
        if version is None or np.asarray(version).dtype.kind not in "iu" or int(version) != VERSION:
            raise DataFormatError(f"{p}: root attribute 'version' must be {VERSION}; "
                                  f"got {version!r}")
        self.class_names = read_str_list(p, f, "class_names")
        if not self.class_names:
            raise DataFormatError(f"{p}: attribute 'class_names' must list at least one class")
        group = f.get("scenes")
        if not isinstance(group, h5py.Group):
            raise DataFormatError(f"{p}: missing group 'scenes' (one sub-group per scene)")
        self.names = sorted(group.keys())
        if not self.names:
            raise DataFormatError(f"{p}: group 'scenes' holds no scenes")
        self.has_rgb = "rgb" in group[self.names[0]]
        if "bounds_min" in f.attrs and "bounds_max" in f.attrs:
            lo = np.asarray(f.attrs["bounds_min"], dtype=np.float64)
            hi = np.asarray(f.attrs["bounds_max"], dtype=np.float64)
            if lo.shape != (3,) or hi.shape != (3,) or not (np.isfinite(lo).all()
                                                             and np.isfinite(hi).all()
                                                             and (lo <= hi).all()):
                raise DataFormatError(f"{p}: attributes bounds_min/bounds_max must be finite [3] "
                                      f"with min <= max; got {lo.tolist()} / {hi.tolist()}")
            self._bounds = self._stored_bounds = (lo, hi)
        if "voxel_size" in f.attrs:
            v = np.asarray(f.attrs["voxel_size"])
            if v.shape not in ((), (1,)) or v.dtype.kind not in "fiu" or not (
                    np.isfinite(v).all() and float(v.reshape(-1)[0]) > 0):
                raise DataFormatError(f"{p}: attribute 'voxel_size' must be one number > 0 "
                                      f"(metres); got {f.attrs['voxel_size']!r}")
            self.voxel_size = float(v.reshape(-1)[0])

    def _check_scene(self, f: h5py.File, name: str, content: Optional[Any]
                     ) -> tuple[int, Optional[tuple[np.ndarray, np.ndarray]]]:
        """(points, (min, max) float64 [3] when a full check read the values, else None). A full
        check is asked for by ``content``, a hashlib hash that the values read are fed to."""
        p = self.path
        g = f["scenes"].get(name)
        if not isinstance(g, h5py.Group):
            raise DataFormatError(f"{p}: 'scenes/{name}' must be a group holding xyz and label")
        xyz = require_dataset(g, p, "xyz")
        check_shape(p, xyz, (None, 3), "[P, 3]")
        check_kind(p, xyz, "f", "floating point (metres)")
        npts = xyz.shape[0]
        if npts == 0:
            raise DataFormatError(f"{p}: scene '{name}' is empty (xyz has 0 points)")
        label = require_dataset(g, p, "label")
        check_shape(p, label, (npts,), f"[P] with P = {npts} (the length of xyz)")
        check_kind(p, label, "iu", "an integer type")
        if ("rgb" in g) != self.has_rgb:
            raise DataFormatError(
                f"{p}: scene '{name}' {'has' if 'rgb' in g else 'lacks'} 'rgb' but scene "
                f"'{self.names[0]}' {'has' if self.has_rgb else 'lacks'} it; rgb must be present "
                "in every scene or in none")
        if self.has_rgb:
            rgb = require_dataset(g, p, "rgb")
            check_shape(p, rgb, (npts, 3), f"[P, 3] with P = {npts}")
            if not (rgb.dtype == np.uint8 or rgb.dtype.kind == "f"):
                raise DataFormatError(f"{p}: dataset '{rgb.name}' must be uint8 (0..255) or float "
                                      f"(0..1); got dtype {rgb.dtype}")
        self._chunks[name] = read_chunk_table(p, g, int(npts), self._stored_bounds)
        box = None
        if content is not None:  # in blocks: a scene larger than a rank's memory all the same
            # One hash per field, fed block by block, so the digest does not depend on the block
            # size; then the name, the point count and the three in one record per scene.
            fields = [hashlib.blake2b(digest_size=16) for _ in range(3)]
            lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
            for start in range(0, npts, CHECK_BLOCK):
                rows = None if npts <= CHECK_BLOCK else slice(start, min(npts, start + CHECK_BLOCK))
                xyz, feats, label = self._read_scene(f, name, rows)
                for h, values in zip(fields, (xyz, feats, label)):
                    h.update(np.ascontiguousarray(values).data)
                lo, hi = np.minimum(lo, xyz.min(0)), np.maximum(hi, xyz.max(0))
            content.update(repr((name, int(npts), [h.hexdigest() for h in fields])).encode())
            box = (lo, hi)
        return int(npts), box

    def _read_scene(self, f: h5py.File, name: str, rows: Optional[slice] = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xyz float32 [P,3] (float64 where stored so), feats float32 [P,C], labels int64 [P])
        with values checked;
        ``rows``: only points ``[start, stop)`` (an HDF5 hyperslab; messages name the range; the
        first NaN's index counts from the dataset's start, a range error's from ``start``)."""
        p = self.path
        g = f["scenes"][name]
        sel = () if rows is None else rows
        at = "" if rows is None else f"[{rows.start}:{rows.stop}]"
        xyz = read(p, g["xyz"], sel)
        first = 0 if rows is None else int(rows.start)
        check_finite(p, g["xyz"].name + at, xyz, first)
        if self._stored_bounds is not None:
            self._check_in_bounds(g["xyz"].name + at, xyz)
        label = read(p, g["label"], sel)
        check_range(p, g["label"].name + at, label, 0, len(self.class_names) - 1,
                    f"{len(self.class_names)} classes in 'class_names'")
        rgb = read(p, g["rgb"], sel) if self.has_rgb else None
        table = self._chunks.get(name)
        if table is not None:  # every point inside its chunk's box; checksums of whole chunks
            check_chunk_rows(p, name, table, first, xyz, rgb, label)
            if rows is not None and table.checksum is not None:
                # A chunk these rows hold a part of is read whole for its checksum: a range
                # through a corrupt chunk must not pass where the whole sample would not.
                for k in partial_chunks(table, first, first + len(xyz)):
                    whole = slice(int(table.offset[k]), int(table.offset[k] + table.count[k]))
                    check_chunk_rows(p, name, table, whole.start, read(p, g["xyz"], whole),
                                     read(p, g["rgb"], whole) if self.has_rgb else None,
                                     read(p, g["label"], whole))
        if rgb is not None:
            if rgb.dtype == np.uint8:
                feats = rgb.astype(np.float32) / np.float32(255.0)
            else:
                check_finite(p, g["rgb"].name + at, rgb, first)
                check_range(p, g["rgb"].name + at, rgb, 0.0, 1.0,
                            "float colours are scaled to [0, 1]")
                feats = rgb.astype(np.float32)
        else:
            feats = np.ones((len(xyz), 1), dtype=np.float32)
        xyz = _coordinates(xyz)
        return xyz, feats, label.astype(np.int64)

    def _check_in_bounds(self, name: str, xyz: np.ndarray) -> None:
        """Stale bounds attributes give a grid that misses these points: refuse them by name."""
        lo, hi = self._stored_bounds  # type: ignore[misc]
        outside = ((xyz < lo) | (xyz > hi)).any(1)
        if outside.any():
            i = int(np.argmax(outside))
            raise DataFormatError(
                f"{self.path}: dataset '{name}' has {int(outside.sum())} point(s) outside the box "
                f"of the root attributes bounds_min {_fmt(lo)} / bounds_max {_fmt(hi)}; first: "
                f"point {i} at {_fmt(xyz[i])}. The attributes are stale (the grid is "
                "built from them, so those points would be lost): rewrite them as the min/max "
                "over every point, or delete them (the points are then scanned)")

    def sample_bounds(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(min [S, 3], max [S, 3]) float64 metres per scene, when known (after a full check or
        a :meth:`bounds` scan); else None."""
        return self._scene_bounds

    def chunk_table(self, i: int) -> Optional[ChunkTable]:
        """Scene ``i``'s chunk table (validated at open), or None for a scene stored unchunked."""
        return self._chunks[self.names[i]]

    def describe_sample(self, i: int) -> str:
        """Where sample ``i`` lives, for messages: ``scene 'room_3' of /data/train.h5``."""
        return f"scene '{self.names[i]}' of {self.path}"

    # --- data set protocol ----------------------------------------------------------------------
    def _h5(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file = open_h5(self.path)
            self._pid = os.getpid()
        return self._file

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> Sample:
        n = len(self.names)
        if not -n <= i < n:
            raise IndexError(f"scene index {i} out of range for {n} scenes in {self.path}")
        name = self.names[i]
        xyz, feats, labels = self._read_scene(self._h5(), name)
        return Sample(points=xyz, feats=feats, labels=labels, label=None, name=name)

    def read_range(self, i: int, start: int, stop: int) -> Sample:
        """Points ``[start, stop)`` of scene ``i`` only (HDF5 hyperslabs; for a spatial rank's
        share of a sample too large to read whole): a :class:`Sample` of ``stop - start`` points,
        values checked as :meth:`__getitem__` checks them. ``0 <= start <= stop <= sizes[i]``."""
        n = len(self.names)
        if not -n <= i < n:
            raise IndexError(f"scene index {i} out of range for {n} scenes in {self.path}")
        size = int(self.sizes[i])
        if not 0 <= start <= stop <= size:
            raise IndexError(f"point range [{start}, {stop}) is not inside scene "
                             f"'{self.names[i]}' of {self.path}, which has {size} points")
        name = self.names[i]
        xyz, feats, labels = self._read_scene(self._h5(), name, slice(int(start), int(stop)))
        return Sample(points=xyz, feats=feats, labels=labels, label=None,
                      name=f"{name}[{start}:{stop}]")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        """Feature channels of every sample: 3 (rgb) or 1 (a constant)."""
        return 3 if self.has_rgb else 1

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) float64 [3], metres, over every point: from the file's attributes when
        stored, else by one scan (cached)."""
        if self._bounds is None:
            f = self._h5()
            los, his = [], []
            for name in self.names:
                ds = f["scenes"][name]["xyz"]
                lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
                for start in range(0, len(ds), CHECK_BLOCK):
                    xyz = read(self.path, ds, slice(start, start + CHECK_BLOCK))
                    check_finite(self.path, ds.name, xyz, start)
                    lo, hi = np.minimum(lo, xyz.min(0)), np.maximum(hi, xyz.max(0))
                los.append(lo)
                his.append(hi)
            self._scene_bounds = (np.stack(los), np.stack(his))
            self._bounds = (self._scene_bounds[0].min(0), self._scene_bounds[1].max(0))
        return self._bounds

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None

    def __repr__(self) -> str:
        return (f"SceneDataset({str(self.path)!r}, {len(self)} scenes, {self.num_classes} classes, "
                f"in_channels={self.in_channels})")
