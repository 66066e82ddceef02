"""Chunked scenes: a scene's points stored sorted by spatial chunk, with a table of each chunk's
rows and bounding box, so that a spatial rank reads only the chunks that can reach its box.

    order, table = chunk_order(xyz, chunk_size=0.5)     # sort a scene's points into chunks
    xyz, rgb, label = xyz[order], rgb[order], label[order]
    table = table.with_checksums(xyz, rgb, label)       # optional CRC-32 per chunk
    write_chunk_table(h5_group, table)                  # /scenes/<name>/chunks/...
    table = read_chunk_table(path, h5_group, points=P, bounds=(lo, hi))   # validated

Layout (an optional group next to a scene's datasets; :mod:`sparsepipe_hpc.data.scenes`)::

    /scenes/<name>/xyz, rgb, label       the scene's points, SORTED BY CHUNK: chunk k is rows
                                         [offset[k], offset[k] + count[k])
    /scenes/<name>/chunks/offset         int    [K]     first row of chunk k; offset[0] = 0,
                                                        offset[k + 1] = offset[k] + count[k]
    /scenes/<name>/chunks/count          int    [K]     rows of chunk k, >= 1; sum = P
    /scenes/<name>/chunks/bbox_min       float  [K, 3]  metres: min of chunk k's xyz (<= every
    /scenes/<name>/chunks/bbox_max       float  [K, 3]  point's coordinate; max likewise)
    /scenes/<name>/chunks/checksum       uint32 [K]     optional: CRC-32 (zlib) of chunk k's
                                                        xyz bytes, then rgb's, then label's,
                                                        as stored
    /scenes/<name>/chunks  attrs: chunk_size (float, metres; informative)

A chunked file is still a plain scene file: readers that ignore ``chunks`` see the same points in
the same order, so the single-process voxelization of a chunked scene is that of its points in
chunk order (exactness of the distributed path is against that order). The writer
(:func:`chunk_order`) cuts space into cubes of ``chunk_size`` metres from the scene's min corner
and orders chunks x-major (x, then y, then z), points within a chunk in their original order;
readers rely only on the table, so any grouping with honest boxes works.

Checks: :func:`read_chunk_table` refuses a table whose datasets are missing or mis-shaped, whose
rows do not tile ``[0, P)`` in order, whose counts do not sum to ``P``, or whose boxes are not
finite, inverted, or outside the file's ``bounds_min``/``bounds_max``.
:func:`check_chunk_rows` refuses points outside their chunk's box (a box that lies would make a
rank skip a chunk it needs) and checksum mismatches. Every error is a
:class:`~sparsepipe_hpc.data.checks.DataFormatError` naming the file, the dataset, the chunk and
the values.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import h5py
import numpy as np

from sparsepipe_hpc.data.checks import DataFormatError, check_kind, check_shape, read, \
    require_dataset

__all__ = ["ChunkTable", "chunk_order", "check_chunk_rows", "partial_chunks", "chunk_checksums",
           "read_chunk_table", "write_chunk_table"]


@dataclass(frozen=True)
class ChunkTable:
    """One scene's chunks: ``offset``/``count`` int64 [K] (rows), ``lo``/``hi`` float64 [K, 3]
    (metres), ``checksum`` uint32 [K] or None; ``chunk_size`` metres (0.0: unknown)."""

    offset: np.ndarray
    count: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    checksum: Optional[np.ndarray] = None
    chunk_size: float = 0.0

    def __len__(self) -> int:
        return len(self.offset)

    def with_checksums(self, xyz: np.ndarray, rgb: Optional[np.ndarray],
                       label: np.ndarray) -> "ChunkTable":
        """This table with the CRC-32 of every chunk of these (chunk-sorted, as stored) arrays."""
        return replace(self, checksum=chunk_checksums(self, xyz, rgb, label))


def chunk_order(xyz: np.ndarray, chunk_size: float) -> tuple[np.ndarray, ChunkTable]:
    """(order int64 [P], table): ``xyz[order]`` is sorted by chunk (cubes of ``chunk_size``
    metres from the points' min corner, x-major), stable within a chunk; the table describes
    the sorted points. ``xyz`` float [P, 3], finite, P >= 1."""
    if not chunk_size > 0:
        raise ValueError(f"chunk_size must be > 0 metres; got {chunk_size}")
    xyz = np.asarray(xyz)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or len(xyz) == 0:
        raise ValueError(f"chunk_order: xyz must be [P, 3] with P >= 1; got {xyz.shape}")
    cell = np.floor((xyz - xyz.min(0)) / chunk_size).astype(np.int64)
    n = cell.max(0) + 1
    cid = (cell[:, 0] * n[1] + cell[:, 1]) * n[2] + cell[:, 2]
    order = np.argsort(cid, kind="stable")
    ids, start, count = np.unique(cid[order], return_index=True, return_counts=True)
    sorted_xyz = xyz[order].astype(np.float64)
    lo = np.minimum.reduceat(sorted_xyz, start, axis=0)
    hi = np.maximum.reduceat(sorted_xyz, start, axis=0)
    return order, ChunkTable(start.astype(np.int64), count.astype(np.int64), lo, hi,
                             chunk_size=float(chunk_size))


def _crc(*arrays: Optional[np.ndarray]) -> int:
    c = 0
    for a in arrays:
        if a is not None:
            c = zlib.crc32(np.ascontiguousarray(a).data, c)
    return c


def chunk_checksums(table: ChunkTable, xyz: np.ndarray, rgb: Optional[np.ndarray],
                    label: np.ndarray, first: int = 0) -> np.ndarray:
    """uint32 [K]: CRC-32 of each chunk's xyz, rgb (if any) and label bytes; the arrays hold rows
    ``[first, first + len)`` of the scene and must cover every chunk of ``table``."""
    out = np.empty(len(table), np.uint32)
    for k, (a, n) in enumerate(zip(table.offset - first, table.count)):
        out[k] = _crc(xyz[a:a + n], None if rgb is None else rgb[a:a + n], label[a:a + n])
    return out


def write_chunk_table(scene: h5py.Group, table: ChunkTable) -> None:
    """Write ``table`` as ``scene/chunks`` (the layout above)."""
    g = scene.create_group("chunks")
    g.attrs["chunk_size"] = float(table.chunk_size)
    g.create_dataset("offset", data=np.asarray(table.offset, np.int64))
    g.create_dataset("count", data=np.asarray(table.count, np.int64))
    g.create_dataset("bbox_min", data=np.asarray(table.lo, np.float64))
    g.create_dataset("bbox_max", data=np.asarray(table.hi, np.float64))
    if table.checksum is not None:
        g.create_dataset("checksum", data=np.asarray(table.checksum, np.uint32))


def _fmt(v: np.ndarray) -> str:
    return "[" + ", ".join(f"{float(x):.9g}" for x in np.asarray(v).reshape(-1)) + "]"


def read_chunk_table(path: str | Path, scene: h5py.Group, points: int,
                     bounds: Optional[tuple[np.ndarray, np.ndarray]] = None
                     ) -> Optional[ChunkTable]:
    """The validated table of ``scene`` (an HDF5 group holding ``points`` rows), or None when the
    scene has no ``chunks`` group. ``bounds``: the file's stored bounds, which every box must
    lie in."""
    g = scene.get("chunks")
    if g is None:
        return None
    where = f"{path}: '{scene.name}/chunks'"
    if not isinstance(g, h5py.Group):
        raise DataFormatError(f"{where} must be a group holding offset, count, bbox_min, bbox_max")
    ds = {k: require_dataset(g, path, k) for k in ("offset", "count", "bbox_min", "bbox_max")}
    for key in ("offset", "count"):
        check_shape(path, ds[key], (None,), "[K]")
        check_kind(path, ds[key], "iu", "an integer type")
    k_chunks = ds["offset"].shape[0]
    check_shape(path, ds["count"], (k_chunks,), f"[K] with K = {k_chunks} (the length of offset)")
    for key in ("bbox_min", "bbox_max"):
        check_shape(path, ds[key], (k_chunks, 3), f"[K, 3] with K = {k_chunks}")
        check_kind(path, ds[key], "f", "floating point (metres)")
    if k_chunks == 0:
        raise DataFormatError(f"{where} has 0 chunks; a chunked scene of {points} points needs "
                              "at least one (or delete the group to read it as a plain scene)")
    offset = read(path, ds["offset"]).astype(np.int64)
    count = read(path, ds["count"]).astype(np.int64)
    lo = read(path, ds["bbox_min"]).astype(np.float64)
    hi = read(path, ds["bbox_max"]).astype(np.float64)
    if (count < 1).any():
        k = int(np.argmax(count < 1))
        raise DataFormatError(f"{where}/count: every chunk must hold >= 1 point; chunk {k} has "
                              f"{int(count[k])}")
    if int(count.sum()) != points:
        raise DataFormatError(f"{where}/count sums to {int(count.sum())} points but the scene "
                              f"has {points} (xyz rows); the table does not describe this scene")
    want = np.concatenate([[0], np.cumsum(count)[:-1]])
    if not np.array_equal(offset, want):
        k = int(np.argmax(offset != want))
        raise DataFormatError(f"{where}/offset: chunks must tile the rows in order (offset[k] = "
                              f"offset[k-1] + count[k-1], from 0); chunk {k} starts at "
                              f"{int(offset[k])}, expected {int(want[k])}")
    bad = ~(np.isfinite(lo).all(1) & np.isfinite(hi).all(1) & (lo <= hi).all(1))
    if bad.any():
        k = int(np.argmax(bad))
        raise DataFormatError(f"{where}: bbox_min/bbox_max of chunk {k} must be finite with "
                              f"min <= max; got {_fmt(lo[k])} / {_fmt(hi[k])}")
    if bounds is not None:
        out = ((lo < bounds[0]) | (hi > bounds[1])).any(1)
        if out.any():
            k = int(np.argmax(out))
            raise DataFormatError(f"{where}: the box of chunk {k} ({_fmt(lo[k])} / "
                                  f"{_fmt(hi[k])}) is not inside the file's bounds_min "
                                  f"{_fmt(bounds[0])} / bounds_max {_fmt(bounds[1])}")
    checksum = None
    if "checksum" in g:
        c = require_dataset(g, path, "checksum")
        check_shape(path, c, (k_chunks,), f"[K] with K = {k_chunks}")
        check_kind(path, c, "iu", "an unsigned integer type (CRC-32)")
        checksum = read(path, c).astype(np.uint32)
    return ChunkTable(offset, count, lo, hi, checksum, _chunk_size(g.attrs.get("chunk_size")))


def _chunk_size(attr: Any) -> float:
    """The ``chunk_size`` attribute in metres; 0.0 (unknown) where it is missing or no single
    number: it only informs, so another writer's odd value does not stop a read."""
    try:
        size = float(np.asarray(attr, dtype=np.float64).reshape(-1)[0])
    except (TypeError, ValueError, IndexError):
        return 0.0
    return size if math.isfinite(size) and size > 0 else 0.0


def check_chunk_rows(path: str | Path, scene: str, table: ChunkTable, start: int,
                     xyz: np.ndarray, rgb: Optional[np.ndarray], label: np.ndarray) -> None:
    """Check rows ``[start, start + len(xyz))`` of a chunked scene (arrays as stored) against
    ``table``: every point inside its chunk's box, and the checksum of every chunk these rows
    hold whole. Raises DataFormatError naming the chunk."""
    stop = start + len(xyz)
    if stop == start:
        return
    end = table.offset + table.count
    first = int(np.searchsorted(end, start, side="right"))   # chunk holding row `start`
    last = int(np.searchsorted(table.offset, stop, side="left"))  # chunks [first, last)
    ks = np.arange(first, last)
    seg = np.maximum(table.offset[ks], start) - start          # each chunk's first row here
    x = np.asarray(xyz, np.float64)
    mn = np.minimum.reduceat(x, seg, axis=0)
    mx = np.maximum.reduceat(x, seg, axis=0)
    lie = ((mn < table.lo[ks]) | (mx > table.hi[ks])).any(1)
    if lie.any():
        j = int(np.argmax(lie))
        k = int(ks[j])
        raise DataFormatError(
            f"{path}: scene '{scene}' chunk {k} (rows {int(table.offset[k])}.."
            f"{int(end[k]) - 1}) has points outside its box bbox_min {_fmt(table.lo[k])} / "
            f"bbox_max {_fmt(table.hi[k])}: they span {_fmt(mn[j])} / {_fmt(mx[j])}. The chunk "
            "table is stale or corrupt (a rank would skip points it needs); rewrite the file's "
            "chunks (write_scenes(..., chunk_size=...))")
    if table.checksum is None:
        return
    whole = (table.offset[ks] >= start) & (end[ks] <= stop)
    for k in ks[whole]:
        a, n = int(table.offset[k]) - start, int(table.count[k])
        got = _crc(xyz[a:a + n], None if rgb is None else rgb[a:a + n], label[a:a + n])
        if got != int(table.checksum[k]):
            raise DataFormatError(
                f"{path}: scene '{scene}' chunk {int(k)} (rows {int(table.offset[k])}.."
                f"{int(end[k]) - 1}) fails its checksum: CRC-32 {got:#010x}, the table says "
                f"{int(table.checksum[k]):#010x}; the points are corrupt (re-copy the file)")


def partial_chunks(table: ChunkTable, start: int, stop: int) -> list[int]:
    """The chunks of which rows ``[start, stop)`` hold a part but not the whole: at most the
    first and the last (their checksums cover rows outside the range)."""
    if stop <= start:
        return []
    end = table.offset + table.count
    first = int(np.searchsorted(end, start, side="right"))
    last = int(np.searchsorted(table.offset, stop, side="left")) - 1
    return sorted({k for k in (first, last) if table.offset[k] < start or end[k] > stop})
