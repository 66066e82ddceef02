"""Distributed input: each spatial rank reads its share of a batch's points from the file, and ends
with the voxels of its box, the context attached (what ``ctx.distribute`` gives from a whole batch).

    ctx = ParallelContext(MPI.COMM_WORLD, RankLayout.from_world(4, grid=(4, 1, 1)))
    ds = SceneDataset("train.h5")
    origin, shape = grid_for(ds, voxel_size=0.05)
    b = read_distributed(ctx, ds, [3, 8], 0.05, origin, shape, align=model.total_stride,
                         generators=batches.sample_generators([3, 8]))  # None: no augmentation
    logits = model(b.x)                  # b.x: this rank's voxels, context attached
    loss_share = F.cross_entropy(logits.feats, b.labels, reduction="sum") / ctx.global_count(...)

Who reads what: rank ``r`` of the spatial group (``n`` ranks) reads points
``[r * P // n, (r + 1) * P // n)`` of each sample (``P`` points) through HDF5 hyperslabs
(:meth:`SceneDataset.read_range`, :data:`READ_CHUNK` points at a time): never the whole sample.
Augmentation is :class:`~sparsepipe_hpc.data.loader.RangeAugmenter`, equal row for row to the
single-process
:func:`~sparsepipe_hpc.data.loader.collate`'s. Voxels then move to their owners
(:func:`sparsepipe_hpc.parallel.voxelize.distributed_voxelize`): the result equals
``ctx.distribute(collate(...).x, labels)`` exactly. Without spatial parallelism the rank reads
whole samples.

Errors: an unreadable or corrupt range (NaN coordinates, labels out of range, a failed read) on
one rank raises on every rank: DataFormatError there, the same class naming that rank elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, cast

import numpy as np
import torch

from halo.cuts import Cuts
from halo.grid import ProcessGrid
from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.loader import JITTER, RangeAugmenter
from sparsepipe_hpc.parallel.voxelize import PointKeys, agree, quantize, voxelize_keys
from sparsepipe_hpc.voxelize import VoxelizeError
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["LocalBatch", "READ_CHUNK", "read_distributed", "point_range"]

#: Points read, augmented and quantized at a time (bounds the float temporaries per rank).
READ_CHUNK = 1 << 18


@dataclass
class LocalBatch:
    """This rank's share of a batch of ``B`` samples.

    x             SparseTensor: coords int32 [n, 4] (batch, x, y, z) global voxel indices inside
                  this rank's box, feats float32 [n, C]; context: the ParallelContext bound to
                  the batch's decomposition (or the unbound one without spatial parallelism)
    labels        int64 [n] majority label per voxel
    point_start   B ints: the first point of each sample this rank read
    point_labels  list of B int64 [p_b]: labels of the points this rank read
    point_owner   list of B int64 [p_b]: spatial-grid rank holding each such point's voxel
    point_row     list of B int64 [p_b]: that voxel's row in the owner's ``x``
    """

    x: SparseTensor
    labels: torch.Tensor
    point_start: list[int]
    point_labels: list[torch.Tensor]
    point_owner: list[torch.Tensor]
    point_row: list[torch.Tensor]


def point_range(num_points: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)``: the points of a sample of ``num_points`` that ``rank`` of ``size`` reads."""
    return rank * num_points // size, (rank + 1) * num_points // size


def read_distributed(ctx: Any, dataset: Any, indices: Sequence[int], voxel_size: float,
                     origin: Sequence[float], spatial_shape: Sequence[int], *,
                     generators: Optional[Sequence[torch.Generator]] = None,
                     jitter: float = JITTER, align: int = 1,
                     cuts: Optional[Cuts] = None) -> LocalBatch:
    """Read, augment and voxelize samples ``indices`` of ``dataset`` over ``ctx``'s spatial group.

    Collective over the spatial group. ``dataset``: a :class:`SceneDataset` (``sizes``,
    ``read_range``, ``num_classes``). ``generators``: one per sample, in the state
    ``collate(..., augment=True, generator=generators)`` would get them (e.g.
    ``ShardedBatches.sample_generators``); None: no augmentation. ``align`` and ``cuts`` as in
    :meth:`ParallelContext.distribute`; the cut mode is the context's.
    """
    if len(indices) == 0:
        raise ValueError("read_distributed: got no samples; a batch needs at least one")
    if generators is not None and len(generators) != len(indices):
        raise ValueError(f"read_distributed: got {len(generators)} generators for "
                         f"{len(indices)} samples; pass one per sample")
    spatial = ctx.group is not None
    if spatial:
        grid = ctx.group.grid
    else:  # one rank: a 1x1x1 grid over its own communicator, made once per context
        grid = getattr(ctx, "_input_grid", None)
        if grid is None:
            grid = ctx._input_grid = ProcessGrid(ctx.spatial_comm, (1, 1, 1))
    rank, size = grid.rank, grid.size

    name = f"samples {list(indices)} of {getattr(dataset, 'path', dataset)}"

    def read() -> tuple[PointKeys, list[int], list[torch.Tensor]]:
        # READ_CHUNK points at a time: only their float positions and the augmentation's
        # temporaries are alive at once; what is kept (36 bytes a point: key, index, rgb, label)
        # goes straight into buffers sized for this rank's share.
        ranges = [point_range(int(dataset.sizes[i]), rank, size) for i in indices]
        n = sum(z - a for a, z in ranges)
        keys = torch.empty(n, dtype=torch.int64)
        index = torch.empty(n, dtype=torch.int64)
        feats = torch.empty((n, dataset.in_channels), dtype=torch.float32)
        labels = torch.empty(n, dtype=torch.int64)
        counts = np.zeros(len(indices), np.int64)
        row, spec, point_labels = 0, None, []
        for b, (i, (start, stop)) in enumerate(zip(indices, ranges)):
            aug = None if generators is None else RangeAugmenter(
                int(dataset.sizes[i]), origin, spatial_shape, voxel_size, generators[b], jitter)
            first = row
            for a in range(start, stop, READ_CHUNK):
                z = min(a + READ_CHUNK, stop)
                s = dataset.read_range(i, a, z)
                pts = torch.as_tensor(np.asarray(s.points), dtype=torch.float64)
                if aug is not None:
                    pts = aug(pts, a)
                part = quantize(torch.full((len(pts),), b, dtype=torch.int64), pts,
                                torch.as_tensor(s.feats), torch.arange(a, z), voxel_size,
                                origin, spatial_shape, torch.as_tensor(s.labels),
                                dataset.num_classes, len(indices), name)
                del s, pts
                keys[row:row + z - a] = part.keys
                index[row:row + z - a] = part.index
                feats[row:row + z - a] = part.feats
                labels[row:row + z - a] = cast(torch.Tensor, part.labels)  # labels were given
                spec = part.grid
                row += z - a
            counts[b] = stop - start
            point_labels.append(labels[first:row])
        if spec is None:  # this rank read no points at all
            spec = quantize(torch.zeros(0), torch.zeros(0, 3), torch.zeros(0, dataset.in_channels),
                            torch.zeros(0), voxel_size, origin, spatial_shape).grid
        return PointKeys(keys, index, feats, labels, counts, spec), [r[0] for r in ranges], \
            point_labels

    pk, starts, point_labels = agree(grid.comm, read, DataFormatError,
                                     kinds=(DataFormatError, VoxelizeError))
    counts = [len(t) for t in point_labels]
    v = voxelize_keys(grid, pk, dataset.num_classes,
                      cuts=cuts if cuts is not None else ctx.cuts_mode, align=align, name=name)
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
    return LocalBatch(x, labels, starts, point_labels, split(v.point_owner), split(v.point_row))
