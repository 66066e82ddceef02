"""The ModelNet40 HDF5 layout of PointNet-style code, for classification, and its data set.

    ds = ModelNetDataset("modelnet40_ply_hdf5_2048", "train")     # train*.h5 / ply_data_train*.h5
    ds = ModelNetDataset(["a.h5", "b.h5"], num_points=1024)       # explicit files
    s = ds[0]            # Sample: points [P, 3] (unit sphere), feats ones [P, 1], label int
    write_modelnet("train0.h5", data, label, class_names=[...])

Layout (one or more HDF5 files per split, e.g. ``train0.h5``, ``train1.h5``, ``test0.h5``)::

    /data    float [S, P, 3]   S objects of P points each, finite (usually centred and scaled
                               into the unit sphere)
    /label   integer [S, 1] or [S]   class index in [0, K)   (uint8 and int64 both occur)
    /normal  (ignored when present)

Class names, and with them K, come from the first of: the ``class_names`` argument; a root
attribute ``class_names`` (list of str, as written by :func:`write_modelnet`); a ``shape_names.txt``
beside the files (PointNet's, one name a line); else K = 40 (ModelNet40) with names ``class_<k>``.

Files of a directory are those ``*.h5`` whose name names the split as a word (``train0``,
``ply_data_train1``; ``latest`` is not ``test``; a name with two splits is refused), in natural
order (``train2`` before ``train10``); a global index walks the files in that order. Validation
works as in :mod:`sparsepipe_hpc.data.scenes`: structure always, every value with
``check="full"``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import h5py
import numpy as np

from sparsepipe_hpc.data.checks import (
    DataFormatError, check_finite, check_kind, check_range, check_shape, open_h5, read,
    read_str_list, require_dataset)
from sparsepipe_hpc.data.sample import Sample

__all__ = ["ModelNetDataset", "write_modelnet", "split_files"]

MODELNET40_CLASSES = 40


def write_modelnet(path: str | Path, data: np.ndarray, label: np.ndarray,
                   class_names: Optional[Sequence[str]] = None) -> Path:
    """Write ``data [S, P, 3]`` float32 and ``label [S]`` (stored as uint8 ``[S, 1]``, as in the
    wild) to ``path``; ``class_names`` become a root attribute. Returns ``path``."""
    path = Path(path)
    label = np.asarray(label).reshape(-1, 1)
    dtype = np.uint8 if label.size == 0 or label.max() < 256 else np.int64
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.asarray(data, dtype=np.float32))
        f.create_dataset("label", data=label.astype(dtype))
        if class_names is not None:
            f.attrs["class_names"] = np.array(list(class_names), dtype=h5py.string_dtype())
    return path


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


SPLIT_WORDS = ("train", "test", "val")  # a file naming two of these belongs to no one split


def _names(name: str, split: str) -> bool:
    """Whether a file name names ``split`` as a word: not inside a longer word but for an "ing"
    (ScanObjectNN's ``training_*.h5``), digits after it allowed (``ply_data_train0.h5``,
    ``train_1.h5``; not ``latest.h5`` for test)."""
    return re.search(rf"(?<![A-Za-z]){re.escape(split)}(ing)?\d*(?![A-Za-z])", name) is not None


def split_files(directory: str | Path, split: str) -> list[Path]:
    """The ``*.h5`` files of ``directory`` whose name names ``split`` as a word, in natural
    order; DataFormatError for one that names another split too (it would be read by both)."""
    d = Path(directory)
    files = sorted((p for p in d.glob("*.h5") if _names(p.name, split)), key=_natural_key)
    for p in files:
        others = [w for w in SPLIT_WORDS if w != split and _names(p.name, w)]
        if others:
            raise DataFormatError(f"{p}: the name names split '{split}' and also "
                                  f"'{others[0]}'; each file must belong to one split: rename it")
    if not files:
        have = sorted(p.name for p in d.iterdir())[:10] if d.is_dir() else []
        raise DataFormatError(f"{d}: no *.h5 file names split '{split}' as a word (such as "
                              f"{split}0.h5, ply_data_{split}1.h5, {split}_a.h5; found {have})")
    return files


class ModelNetDataset:
    """Objects of one split in the layout above; ``ds[i]`` is a :class:`Sample` with ``label``.

    ``num_points`` keeps the first points of each object (PointNet's convention; the files store
    points in random order). Files are opened lazily and kept open, once per process.
    """

    def __init__(self, paths: str | Path | Sequence[str | Path], split: str = "train", *,
                 num_points: Optional[int] = None, class_names: Optional[Sequence[str]] = None,
                 check: str = "full") -> None:
        if check not in ("full", "structure"):
            raise ValueError(f"check must be 'full' or 'structure'; got {check!r}")
        if isinstance(paths, (str, Path)):
            p = Path(paths)
            files = split_files(p, split) if p.is_dir() else [p]
        else:
            files = [Path(x) for x in paths]
            if not files:
                raise DataFormatError("ModelNetDataset: the list of files is empty")
        self.files = files
        self.split = split
        self._handles: dict[Path, h5py.File] = {}
        self._pid = -1
        counts: list[int] = []
        points: list[int] = []
        file_names = None
        for path in files:
            with open_h5(path) as f:
                n_samples, n_points = self._check_structure(path, f)
                counts.append(n_samples)
                points.append(n_points)
                if "class_names" in f.attrs:
                    names = read_str_list(path, f, "class_names")
                    if file_names is not None and names != file_names:
                        raise DataFormatError(f"{path}: attribute 'class_names' differs from that "
                                              f"of {files[0]}: {names} vs {file_names}")
                    file_names = names
        self.class_names, self.class_names_from = self._class_names(class_names, file_names)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.points_per_file = points
        if num_points is not None and not 1 <= num_points <= min(points):
            raise ValueError(f"num_points must lie in [1, {min(points)}] (the fewest points per "
                             f"object in these files); got {num_points}")
        self.num_points = num_points
        self._bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
        self._sample_bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
        #: hex digest of every file's points and labels (None with check="structure"), read by
        #: the full check: what tells two files of equal size apart, for a resume or a rank.
        self.digest: Optional[str] = None
        if check == "full":  # every value, and each object's box (to name outliers)
            content = hashlib.blake2b(digest_size=16)
            self._sample_bounds = self._object_boxes(labels=True, content=content)
            self._bounds = (self._sample_bounds[0].min(0), self._sample_bounds[1].max(0))
            self.digest = content.hexdigest()

    def _object_boxes(self, labels: bool = False, content: Optional[Any] = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) float64 [S, 3] of each object's points, checked finite (and the labels in
        range with ``labels``; the points and labels fed to the hashlib hash ``content``)."""
        los, his = [], []
        for path in self.files:
            with open_h5(path) as f:
                data = read(path, f["data"])
                check_finite(path, "/data", data)
                if labels:
                    label = read(path, f["label"])
                    self._check_labels(path, label)
                    if content is not None:
                        content.update(np.ascontiguousarray(data))
                        content.update(np.ascontiguousarray(label))
            los.append(data.min(1).astype(np.float64))
            his.append(data.max(1).astype(np.float64))
        return np.concatenate(los), np.concatenate(his)

    def _check_structure(self, path: Path, f: h5py.File) -> tuple[int, int]:
        data = require_dataset(f, path, "data")
        check_shape(path, data, (None, None, 3), "[S, P, 3]")
        check_kind(path, data, "f", "floating point")
        s, p = data.shape[0], data.shape[1]
        if s == 0 or p == 0:
            raise DataFormatError(f"{path}: dataset '/data' holds no points; shape {data.shape}")
        label = require_dataset(f, path, "label")
        if label.shape not in ((s,), (s, 1)):
            raise DataFormatError(f"{path}: dataset '/label' must have shape [S, 1] or [S] with "
                                  f"S = {s} (the objects in '/data'); got {tuple(label.shape)}")
        check_kind(path, label, "iu", "an integer type")
        return int(s), int(p)

    def _class_names(self, given: Optional[Sequence[str]], in_files: Optional[list[str]]
                     ) -> tuple[list[str], str]:
        """(names, where they came from: for messages)."""
        if given is not None:
            return list(given), "the class_names argument"
        if in_files is not None:
            return in_files, f"attribute 'class_names' of {self.files[0]}"
        txt = self.files[0].parent / "shape_names.txt"
        if txt.is_file():
            names = [line.strip() for line in txt.read_text().splitlines() if line.strip()]
            if names:
                return names, str(txt)
        return ([f"class_{k}" for k in range(MODELNET40_CLASSES)],
                f"the ModelNet40 default (no 'class_names' attribute in {self.files[0]}, no "
                "shape_names.txt beside it)")

    def _check_labels(self, path: Path, label: np.ndarray) -> None:
        k = len(self.class_names)
        check_range(path, "/label", label, 0, k - 1, f"{k} classes")

    # --- data set protocol ----------------------------------------------------------------------
    def _h5(self, path: Path) -> h5py.File:
        if self._pid != os.getpid():
            self._handles = {}  # a forked child must not share its parent's HDF5 handles
            self._pid = os.getpid()
        if path not in self._handles:
            self._handles[path] = open_h5(path)
        return self._handles[path]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"object index {i} out of range for {n} objects in {self.split}")
        i = i % n
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        row = i - int(self.offsets[k])
        path = self.files[k]
        f = self._h5(path)
        pts = read(path, f["data"], (row, slice(0, self.num_points)))
        check_finite(path, f"/data[{row}]", pts)
        label = read(path, f["label"], row).reshape(-1)
        self._check_labels(path, label)
        return Sample(points=pts.astype(np.float32, copy=False),
                      feats=np.ones((len(pts), 1), dtype=np.float32), labels=None,
                      label=int(label[0]), name=f"{path.stem}/{row}")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        """Feature channels of every sample: 1 (a constant; the layout has no colour)."""
        return 1

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) float64 [3] over every point of every file (one scan, cached)."""
        if self._bounds is None:
            self._sample_bounds = self._object_boxes()
            self._bounds = (self._sample_bounds[0].min(0), self._sample_bounds[1].max(0))
        return self._bounds

    def sample_bounds(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(min [S, 3], max [S, 3]) float64 per object, when known (after a full check or a
        :meth:`bounds` scan); else None."""
        return self._sample_bounds

    def describe_sample(self, i: int) -> str:
        """Where object ``i`` lives, for messages: ``object 17 (row 5 of /data/train1.h5)``."""
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return f"object {i} (row {i - int(self.offsets[k])} of {self.files[k]})"

    def close(self) -> None:
        if self._pid == os.getpid():
            for f in self._handles.values():
                f.close()
        self._handles = {}

    def __repr__(self) -> str:
        return (f"ModelNetDataset({len(self.files)} file(s), split {self.split!r}, {len(self)} "
                f"objects, {self.num_classes} classes)")
