"""Distributed input: each spatial rank reads its share of a batch's points from the file, and ends
with the voxels of its box, the context attached (what ``ctx.distribute`` gives from a whole batch).

    ctx = ParallelContext(MPI.COMM_WORLD, RankLayout.from_world(4, grid=(4, 1, 1)))
    ds = SceneDataset("train.h5")
    origin, shape = grid_for(ds, voxel_size=0.05)
    b = read_distributed(ctx, ds, [3, 8], 0.05, origin, shape, align=model.total_stride,
                         generators=batches.sample_generators([3, 8]))  # None: no augmentation
    logits = model(b.x)                  # b.x: this rank's voxels, context attached
    loss_share = F.cross_entropy(logits.feats, b.labels, reduction="sum") / ctx.global_count(...)
    b.points_read                        # rows this rank read from the file

Who reads what depends on the file:

* **point ranges** (plain scenes): rank ``r`` of the spatial group (``n`` ranks) reads points
  ``[r * P // n, (r + 1) * P // n)`` of each sample (``P`` points) through HDF5 hyperslabs
  (:meth:`SceneDataset.read_range`, :data:`READ_CHUNK` points at a time); the cuts come from
  the voxels every rank saw, and voxels then move to their owners
  (:func:`sparsepipe_hpc.parallel.voxelize.distributed_voxelize`).
* **spatial chunks** (every sample of the batch stored in the chunked layout,
  :mod:`sparsepipe_hpc.data.chunks`): the cuts come first, from the chunk tables alone
  (:func:`~sparsepipe_hpc.parallel.chunked.chunk_cuts` for ``"balanced"``; uniform or explicit
  cuts as given); each rank then reads only the chunks whose (augmented) box meets its own box
  and keeps the points whose voxel it owns (:mod:`sparsepipe_hpc.parallel.chunked`), so points
  barely move. A rank reads about ``P / n`` plus the chunks straddling its box's faces.

Either way, augmentation is :class:`~sparsepipe_hpc.data.loader.RangeAugmenter`, equal row for
row to the single-process :func:`~sparsepipe_hpc.data.loader.collate`'s; it draws only the jitter
blocks (:data:`~sparsepipe_hpc.data.loader.NOISE_BLOCK` rows) meeting the rows a rank reads, so a
rank's input work is O(its rows), not O(rows up to its last one). The result equals
``ctx.distribute(collate(...).x, labels, cuts=b.x.context.spatial.cuts)`` exactly (coords, mean
features, label votes, point->voxel maps). Without spatial parallelism the rank reads whole
samples.

Errors: an unreadable or corrupt range or chunk (NaN coordinates, labels out of range, a failed
read, points outside their chunk's box, a checksum mismatch) on one rank raises on every rank:
DataFormatError there, the same class naming that rank elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, cast

import numpy as np
import torch

from halo.cuts import CutError, Cuts, uniform_cuts
from halo.kmap import decode_keys
from halo.ownership import owner_ranks
from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.loader import JITTER, RangeAugmenter
from sparsepipe_hpc.parallel.chunked import chunk_cuts, chunk_voxels, chunks_in_box, pieces
from sparsepipe_hpc.parallel.voxelize import PointKeys, agree, check_cuts, check_same, \
    quantize, voxelize_keys
from sparsepipe_hpc.voxelize import VoxelizeError
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["LocalBatch", "READ_CHUNK", "read_distributed", "point_range"]

#: Points read, augmented and quantized at a time (bounds the float temporaries per rank:
#: about 200 bytes a point, so 64k points cost ~13 MB, 256k ~50 MB, measured at 2M points a rank).
READ_CHUNK = 1 << 16


@dataclass
class LocalBatch:
    """This rank's share of a batch of ``B`` samples.

    x             SparseTensor: coords int32 [n, 4] (batch, x, y, z) global voxel indices inside
                  this rank's box, feats float32 [n, C]; context: the ParallelContext bound to
                  the batch's decomposition (or the unbound one without spatial parallelism)
    labels        int64 [n] majority label per voxel
    point_index   list of B int64 [p_b]: the points of each sample this rank holds (their
                  indices in the sample, ascending): a range ``[point_start[b], ...)`` on the
                  point-range path, the points of this rank's box on the chunked path
    point_start   B ints: ``point_index[b][0]`` (0 when this rank holds none of sample b)
    point_labels  list of B int64 [p_b]: labels of those points
    point_owner   list of B int64 [p_b]: spatial-grid rank holding each such point's voxel
    point_row     list of B int64 [p_b]: that voxel's row in the owner's ``x``
    points_read   rows this rank read from the file (chunked: including the points of chunks
                  straddling its box that other ranks keep)
    """

    x: SparseTensor
    labels: torch.Tensor
    point_start: list[int]
    point_labels: list[torch.Tensor]
    point_owner: list[torch.Tensor]
    point_row: list[torch.Tensor]
    point_index: list[torch.Tensor]
    points_read: int


def point_range(num_points: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)``: the points of a sample of ``num_points`` that ``rank`` of ``size`` reads."""
    return rank * num_points // size, (rank + 1) * num_points // size


class _Buffers:
    """What a rank keeps of its points (36 bytes a point: key, index, features, label), in
    buffers sized once for an upper bound of its share."""

    def __init__(self, n: int, channels: int, batch_size: int) -> None:
        self.keys = torch.empty(n, dtype=torch.int64)
        self.index = torch.empty(n, dtype=torch.int64)
        self.feats = torch.empty((n, channels), dtype=torch.float32)
        self.labels = torch.empty(n, dtype=torch.int64)
        self.counts = np.zeros(batch_size, np.int64)
        self.row = 0
        self.spec: Optional[tuple] = None

    def add(self, b: int, part: PointKeys, keep: Optional[torch.Tensor] = None) -> None:
        keys, index, feats = part.keys, part.index, part.feats
        labels = cast(torch.Tensor, part.labels)  # labels are always given here
        if keep is not None:
            keys, index, feats, labels = keys[keep], index[keep], feats[keep], labels[keep]
        r, n = self.row, len(keys)
        self.keys[r:r + n] = keys
        self.index[r:r + n] = index
        self.feats[r:r + n] = feats
        self.labels[r:r + n] = labels
        self.counts[b] += n
        self.row += n
        self.spec = part.grid

    def done(self, dataset: Any, voxel_size: float, origin: Sequence[float],
             spatial_shape: Sequence[int]) -> PointKeys:
        r = self.row
        if self.spec is None:  # this rank read no points at all
            self.spec = quantize(torch.zeros(0), torch.zeros(0, 3),
                                 torch.zeros(0, dataset.in_channels), torch.zeros(0), voxel_size,
                                 origin, spatial_shape).grid
        return PointKeys(self.keys[:r], self.index[:r], self.feats[:r], self.labels[:r],
                         self.counts, self.spec)


def _chunk_tables(dataset: Any, indices: Sequence[int]) -> Optional[list[Any]]:
    """Every sample's chunk table, or None unless every sample of the batch has one."""
    get = getattr(dataset, "chunk_table", None)
    if get is None:
        return None
    tables = [get(i) for i in indices]
    return tables if all(t is not None for t in tables) else None


def read_distributed(ctx: Any, dataset: Any, indices: Sequence[int], voxel_size: float,
                     origin: Sequence[float], spatial_shape: Sequence[int], *,
                     generators: Optional[Sequence[torch.Generator]] = None,
                     jitter: float = JITTER, align: int = 1,
                     cuts: Optional[Cuts] = None) -> LocalBatch:
    """Read, augment and voxelize samples ``indices`` of ``dataset`` over ``ctx``'s spatial group.

    Collective over the spatial group. ``dataset``: a :class:`SceneDataset` (``sizes``,
    ``read_range``, ``num_classes``; ``chunk_table`` for the chunked path). ``generators``: one
    per sample, in the state ``collate(..., augment=True, generator=generators)`` would get them
    (e.g. ``ShardedBatches.sample_generators``); None: no augmentation. ``align`` and ``cuts``
    as in :meth:`ParallelContext.distribute`; the cut mode is the context's.
    """
    spatial = ctx.group is not None
    grid = ctx.input_grid()  # one rank without a group: a 1x1x1 grid (raises after close)
    rank, size = grid.rank, grid.size
    name = f"samples {list(indices)} of {getattr(dataset, 'path', dataset)}"

    def augmenters() -> list[Optional[RangeAugmenter]]:
        if len(indices) == 0:
            raise ValueError("read_distributed: got no samples; a batch needs at least one")
        if generators is not None and len(generators) != len(indices):
            raise ValueError(f"read_distributed: got {len(generators)} generators for "
                             f"{len(indices)} samples; pass one per sample")
        bad = [int(i) for i in indices if not 0 <= int(i) < len(dataset.sizes)]
        if bad:
            raise ValueError(f"read_distributed: sample(s) {bad} of {name} are out of range: "
                             f"it has {len(dataset.sizes)}")
        return [None if generators is None else RangeAugmenter(
            int(dataset.sizes[i]), origin, spatial_shape, voxel_size, generators[b], jitter)
            for b, i in enumerate(indices)]

    # Checked on every rank together: one rank raising alone would leave the others waiting.
    augs = agree(grid.comm, augmenters)
    # Each rank reads its share of every sample: pieces of different samples, or of the same
    # one augmented differently, would merge into one sample without an error.
    check_same(grid.comm, {"samples": tuple(int(i) for i in indices),
                           "dataset": str(getattr(dataset, "path", type(dataset).__name__)),
                           "augmentation (flips, swap, jitter key)": tuple(
                               None if a is None else (tuple(a.coin.tolist()), a.key, a.jitter)
                               for a in augs)})

    def quantized(b: int, i: int, a: int, z: int) -> PointKeys:
        """Points ``[a, z)`` of sample ``indices[b]``, read, augmented and quantized."""
        s = dataset.read_range(i, a, z)
        pts = torch.as_tensor(np.asarray(s.points), dtype=torch.float64)
        aug = augs[b]
        if aug is not None:
            pts = aug(pts, a)
        return quantize(torch.full((len(pts),), b, dtype=torch.int64), pts,
                        torch.as_tensor(s.feats), torch.arange(a, z), voxel_size, origin,
                        spatial_shape, torch.as_tensor(s.labels), dataset.num_classes,
                        len(indices), name)

    def read_ranges() -> tuple[PointKeys, int]:
        # READ_CHUNK points at a time: only their float positions and the augmentation's
        # temporaries are alive at once; what is kept goes straight into the buffers.
        ranges = [point_range(int(dataset.sizes[i]), rank, size) for i in indices]
        buf = _Buffers(sum(z - a for a, z in ranges), dataset.in_channels, len(indices))
        for b, (i, (start, stop)) in enumerate(zip(indices, ranges)):
            for a in range(start, stop, READ_CHUNK):
                buf.add(b, quantized(b, i, a, min(a + READ_CHUNK, stop)))
        return buf.done(dataset, voxel_size, origin, spatial_shape), buf.row

    mode = cuts if cuts is not None else ctx.cuts_mode
    tables = _chunk_tables(dataset, indices)
    if tables is None:
        pk, read_rows = agree(grid.comm, read_ranges, DataFormatError,
                              kinds=(DataFormatError, VoxelizeError))
    else:
        # The cuts first, from the tables (every rank computes the same), then this box's chunks.
        voxels = []
        for b, t in enumerate(tables):
            lo, hi = (t.lo, t.hi) if augs[b] is None else augs[b].box(t.lo, t.hi)  # type: ignore[union-attr]
            voxels.append(chunk_voxels(lo, hi, origin, voxel_size, spatial_shape))

        def first_cuts() -> Cuts:
            extent = [int(v) for v in spatial_shape]
            if isinstance(mode, Cuts) or mode not in ("balanced", "uniform"):
                return check_cuts(grid, mode, extent)
            if mode == "uniform" or size == 1:
                return uniform_cuts(extent, grid.dims, align=align)
            return chunk_cuts([(lo, hi, t.count) for (lo, hi), t in zip(voxels, tables)],
                              extent, grid.dims, align)

        mode = agree(grid.comm, first_cuts, VoxelizeError, kinds=(VoxelizeError, CutError))
        box = mode.box(grid.coords)

        def read_chunks() -> tuple[PointKeys, int]:
            chosen = [np.nonzero(chunks_in_box(lo, hi, *box))[0] for lo, hi in voxels]
            buf = _Buffers(sum(int(t.count[c].sum()) for t, c in zip(tables, chosen)),
                           dataset.in_channels, len(indices))
            for b, (i, t, c) in enumerate(zip(indices, tables, chosen)):
                for a, z, _, _ in pieces(t.offset, t.count, c, READ_CHUNK):
                    part = quantized(b, i, a, z)
                    mine = owner_ranks(grid, mode, decode_keys(part.keys)) == rank
                    buf.add(b, part, mine)
            return buf.done(dataset, voxel_size, origin, spatial_shape), \
                sum(int(t.count[c].sum()) for t, c in zip(tables, chosen))

        pk, read_rows = agree(grid.comm, read_chunks, DataFormatError,
                              kinds=(DataFormatError, VoxelizeError))
    counts = [int(n) for n in pk.counts]
    # The chunked path's points are any subset: keep their indices (the ranges' are rebuilt).
    index = pk.index if tables is not None else None
    point_labels = list(torch.split(cast(torch.Tensor, pk.labels), counts))
    v = voxelize_keys(grid, pk, dataset.num_classes, cuts=mode, align=align, name=name)
    del pk
    if spatial:
        from sparsepipe_hpc.parallel.spatial import SpatialDomain

        context = ctx.bind(SpatialDomain(ctx.group, v.cuts))
    else:
        context = ctx
    shape3 = (int(spatial_shape[0]), int(spatial_shape[1]), int(spatial_shape[2]))
    x = SparseTensor(v.coords, v.feats, shape3, len(indices), context=context)
    labels = v.labels if v.labels is not None else torch.zeros(0, dtype=torch.int64)
    split = lambda t: list(torch.split(t, counts))  # noqa: E731
    if index is not None:
        point_index = split(index)
    else:
        point_index = [torch.arange(a, a + n) for (a, _), n in zip(
            (point_range(int(dataset.sizes[i]), rank, size) for i in indices), counts)]
    starts = [int(t[0]) if len(t) else 0 for t in point_index]
    return LocalBatch(x, labels, starts, point_labels, split(v.point_owner), split(v.point_row),
                      point_index, read_rows)
