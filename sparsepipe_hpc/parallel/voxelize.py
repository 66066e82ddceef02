"""Distributed voxelization: each rank of a spatial group holds part of the points, each ends with
the voxels of its box, equal to the single-process voxelization of all the points.

    grid = ProcessGrid(spatial_comm, (2, 1, 1))
    v = distributed_voxelize(grid, batch, xyz, feats, index, voxel_size=0.05, origin=origin,
                             spatial_shape=shape, labels=lab, num_classes=13, cuts="balanced",
                             align=16)
    v.coords        # int32 [n, 4] (batch, x, y, z) global voxel indices inside v.cuts' box of
                    # this rank, sorted by (batch, x, y, z)
    v.feats         # float32 [n, C]: mean feature of the voxel's points, over ALL ranks' points
    v.labels        # int64 [n]: majority label over all ranks' points (ties: smallest label)
    v.point_owner   # int64 [p]: grid rank holding the voxel of each of THIS rank's points
    v.point_row     # int64 [p]: that voxel's row in the owner's v.coords

Inputs per rank (any disjoint split of a batch's points, a rank may hold none): ``batch int [p]``
sample of each point, ``points [p, 3]`` metres (float64; float32 is widened like
:func:`sparsepipe_hpc.voxelize.voxelize` does), ``feats float32 [p, C]``, ``index int64 [p]`` the
point's position in its sample (distinct within a sample), ``labels int [p]``.

How (three steps, every one collective over ``grid.comm``)::

    1. quantize   idx = floor((point - origin) / voxel_size), float64, as voxelize() does
    2. cuts       uniform, explicit, or balanced: every rank sends the keys of the voxels it saw
                  to a hash rank (key % size), which counts each distinct voxel once in the
                  all-reduced histograms of halo.balanced_cuts - a voxel whose points lie on 2
                  ranks is not counted twice
    3. owners     every POINT (key, index, features, label) moves to the rank owning its voxel
                  (Alltoallv); the owner sorts them by index and sums features in that
                  order with the same code as voxelize() (merge_points)

Exactness: moving points rather than per-rank partial sums costs a little more traffic (each point
moves once; partial sums would move fewer rows) but makes the float32 feature sums bit-identical
to the single-process ones, whose order is the points' order in the sample. Partial sums in
float64 would only be exact for benign feature ranges. Labels are integer votes: exact anyway.

Errors: bad input on any rank (NaN/inf coordinates or features, points off the grid, labels out
of range, ranks disagreeing on channels, batch size or classes) raises :class:`VoxelizeError` on
every rank before the first exchange, naming the rank, the input and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from halo.cuts import Cuts, balanced_cuts, uniform_cuts
from halo.grid import ProcessGrid
from halo.kmap import MAX_BATCH, MAX_EXTENT, coord_keys, decode_keys, key_batch
from halo.ownership import owner_ranks
from sparsepipe_hpc.parallel.failures import run_on_all
from sparsepipe_hpc.parallel.rows import send_list, send_rows
from sparsepipe_hpc.voxelize import VoxelizeError, merge_points

__all__ = ["LocalVoxels", "PointKeys", "agree", "check_cuts", "distributed_voxelize", "quantize",
           "voxelize_keys"]


@dataclass
class LocalVoxels:
    """This rank's voxels after :func:`distributed_voxelize` (fields: see the module docstring)."""

    coords: torch.Tensor
    feats: torch.Tensor
    labels: Optional[torch.Tensor]
    cuts: Cuts
    point_owner: torch.Tensor
    point_row: torch.Tensor


def agree(comm: Any, fn: Callable[[], Any], error: type = VoxelizeError,
          kinds: Sequence[type] = ()) -> Any:
    """Run ``fn`` on every rank of ``comm``; if it raised anywhere, raise everywhere (collective).

    The rank that failed re-raises its own exception; the others raise, with the first failing
    rank's message, that exception's class when it is one of ``kinds`` (or ``error``), so none
    is left waiting in a later collective.
    """
    outcome = run_on_all(comm, fn)
    if outcome.caught is not None:
        raise outcome.caught
    if outcome.failures:
        rank, kind, msg = outcome.failures[0]
        cls = next((k for k in kinds if k.__name__ == kind), error)
        raise cls(f"rank {rank} of {outcome.size}: {msg}")
    return outcome.value


@dataclass
class PointKeys:
    """This rank's points, quantized (the output of :func:`quantize`; rows are points).

    keys     int64 [p]: :func:`halo.kmap.coord_keys` of (batch, x, y, z) global voxel indices
    index    int64 [p]: the point's position in its sample
    feats    float32 [p, C]
    labels   int64 [p] or None
    counts   int64 [B]: points per sample on this rank
    grid     (origin, voxel_size, spatial_shape) the keys are relative to
    """

    keys: torch.Tensor
    index: torch.Tensor
    feats: torch.Tensor
    labels: Optional[torch.Tensor]
    counts: np.ndarray
    grid: tuple

    @staticmethod
    def cat(parts: Sequence["PointKeys"]) -> "PointKeys":
        """Concatenate the rows of quantized parts (same grid, same batch size)."""
        if len(parts) == 1:
            return parts[0]
        labels = None if parts[0].labels is None else torch.cat([p.labels for p in parts])  # type: ignore[misc]
        return PointKeys(torch.cat([p.keys for p in parts]), torch.cat([p.index for p in parts]),
                         torch.cat([p.feats for p in parts]), labels,
                         np.sum([p.counts for p in parts], axis=0), parts[0].grid)


def quantize(batch: torch.Tensor, points: torch.Tensor, feats: torch.Tensor,
             index: torch.Tensor, voxel_size: float, origin: Sequence[float],
             spatial_shape: Sequence[int], labels: Optional[torch.Tensor] = None,
             num_classes: Optional[int] = None, batch_size: int = 1,
             name: str = "points") -> PointKeys:
    """Check this rank's points and quantize them (local, no communication): the first step of
    :func:`distributed_voxelize`, for callers that want to drop the float positions early.

    Raises VoxelizeError (on this rank only) for NaN/inf, points off the grid, labels or batch
    indices out of range, mismatched shapes.
    """
    points = torch.as_tensor(points).to(torch.float64)
    feats = torch.as_tensor(feats).to(torch.float32)
    batch = torch.as_tensor(batch).long()
    index = torch.as_tensor(index).long()
    if labels is not None:
        labels = torch.as_tensor(labels).long()
    p = len(points)
    if points.dim() != 2 or points.shape[1] != 3:
        raise VoxelizeError(f"{name} must be [p, 3]; got {list(points.shape)}")
    if feats.dim() != 2 or len(feats) != p:
        raise VoxelizeError(f"features of {name} must be [{p}, C]; got {list(feats.shape)}")
    for what, t in (("batch", batch), ("index", index)) + (
            (("labels", labels),) if labels is not None else ()):
        if t.shape != (p,):
            raise VoxelizeError(f"{what} of {name} must be [{p}]; got {list(t.shape)}")
    if not voxel_size > 0:
        raise VoxelizeError(f"voxel_size must be > 0; got {voxel_size}")
    if not torch.isfinite(points).all():
        bad = (~torch.isfinite(points)).any(1)
        i = int(bad.nonzero()[0])
        raise VoxelizeError(f"{name} has {int(bad.sum())} point(s) with NaN or inf coordinates; "
                            f"first: point {int(index[i])} of sample {int(batch[i])}")
    if not torch.isfinite(feats).all():
        raise VoxelizeError(f"features of {name} contain NaN or inf")
    if not 0 < batch_size <= MAX_BATCH:  # coord_keys holds no more (more wrapped into others)
        raise VoxelizeError(f"batch_size must lie in [1, {MAX_BATCH}] (the voxel keys' sample "
                            f"field); got {batch_size}: split the batch")
    if max(spatial_shape) > MAX_EXTENT:
        raise VoxelizeError(f"spatial_shape {tuple(spatial_shape)} exceeds {MAX_EXTENT} voxels "
                            "per axis (the voxel keys' range): use a larger voxel_size")
    if p and (int(batch.min()) < 0 or int(batch.max()) >= batch_size):
        raise VoxelizeError(f"batch of {name} must lie in [0, {batch_size}); got "
                            f"[{int(batch.min())}, {int(batch.max())}]")
    if labels is not None and num_classes is None:
        raise VoxelizeError("distributed_voxelize: pass num_classes with labels (each rank "
                            "sees only some labels, so none can infer the class count)")
    if labels is not None and num_classes is not None and p and (
            int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise VoxelizeError(f"labels of {name} must lie in [0, {num_classes - 1}]; "
                            f"got [{int(labels.min())}, {int(labels.max())}]")
    shape = torch.tensor(list(spatial_shape), dtype=torch.int64)
    idx = torch.floor((points - torch.tensor(list(origin), dtype=torch.float64))
                      / voxel_size).long()  # the same expression as voxelize(): same indices
    inside = ((idx >= 0) & (idx < shape)).all(1)
    if not bool(inside.all()):
        i = int((~inside).nonzero()[0])
        raise VoxelizeError(
            f"{name}: {int((~inside).sum())} point(s) fall outside the grid (origin "
            f"{tuple(origin)}, {tuple(spatial_shape)} voxels of {voxel_size} m); first: point "
            f"{int(index[i])} of sample {int(batch[i])} at {points[i].tolist()} -> voxel "
            f"{idx[i].tolist()}. Enlarge the grid")
    keys = coord_keys(torch.cat([batch[:, None], idx], 1))
    counts = np.bincount(batch.numpy(), minlength=batch_size).astype(np.int64)
    spec = (tuple(float(o) for o in origin), float(voxel_size), tuple(int(s) for s in spatial_shape))
    return PointKeys(keys, index, feats, labels, counts, spec)


def check_same(comm: Any, what: dict[str, Any]) -> None:
    """VoxelizeError on every rank of ``comm`` unless all pass equal ``what`` (name -> value).
    Collective (one allgather)."""
    seen = comm.allgather(what)
    for k in what:
        values = [s[k] for s in seen]
        if len(set(values)) > 1:
            raise VoxelizeError(f"the ranks of the spatial group disagree on {k}: "
                                + ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
                                + "; every rank must pass the same")


def check_cuts(grid: ProcessGrid, cuts: Any, extent: Sequence[int]) -> Cuts:
    """``cuts`` when it is a :class:`halo.Cuts` for ``grid``'s dims over ``extent`` (voxels);
    VoxelizeError otherwise (also for a cut mode other than 'balanced' or 'uniform')."""
    extent = [int(s) for s in extent]
    if not isinstance(cuts, Cuts):
        raise VoxelizeError(f"cuts must be 'balanced', 'uniform' or a Cuts; got {cuts!r}")
    if cuts.dims != grid.dims or list(cuts.extent) != extent:
        raise VoxelizeError(f"explicit cuts {cuts} are for a grid {cuts.dims} over extent "
                            f"{cuts.extent}; the grid is {grid.dims} and the extent "
                            f"{tuple(extent)} voxels")
    return cuts


def _cuts(grid: ProcessGrid, keys: torch.Tensor, spatial_shape: Sequence[int],
          cuts: str | Cuts, align: int) -> Cuts:
    extent = [int(s) for s in spatial_shape]
    if isinstance(cuts, Cuts):
        return check_cuts(grid, cuts, extent)
    if cuts == "uniform" or grid.size == 1:  # one box: balanced cuts are the whole extent too
        return uniform_cuts(extent, grid.dims, align=align)
    if cuts != "balanced":
        check_cuts(grid, cuts, extent)  # raises: not a Cuts
    # Each distinct voxel must be counted once: send the keys this rank saw to a hash rank.
    mine = torch.unique(keys)
    moved = send_rows(grid.comm, mine % grid.size, mine)
    distinct = torch.unique(moved.rows[0])
    xyz = decode_keys(distinct)[:, 1:]
    return balanced_cuts(grid.comm, xyz, extent, grid.dims, align=align)


def distributed_voxelize(grid: ProcessGrid, batch: torch.Tensor, points: torch.Tensor,
                         feats: torch.Tensor, index: torch.Tensor, voxel_size: float,
                         origin: Sequence[float], spatial_shape: Sequence[int],
                         labels: Optional[torch.Tensor] = None,
                         num_classes: Optional[int] = None, batch_size: int = 1,
                         cuts: str | Cuts = "balanced", align: int = 1,
                         name: str = "points") -> LocalVoxels:
    """Voxelize points spread over ``grid.comm`` into each rank's box (collective).

    See the module docstring for the contracts. ``cuts``: ``"balanced"`` (voxel-count quantiles,
    exactly what :meth:`SpatialGroup.decompose` computes from the whole batch), ``"uniform"``, or
    explicit :class:`halo.Cuts`; interior cuts are multiples of ``align`` (level-0 voxels).
    ``num_classes`` is required with ``labels`` (ranks see different labels, so none may guess
    it from its own). Raises VoxelizeError on every rank for bad input on any rank.
    """
    pk = agree(grid.comm, lambda: quantize(batch, points, feats, index, voxel_size, origin,
                                           spatial_shape, labels, num_classes, batch_size, name))
    return voxelize_keys(grid, pk, num_classes, cuts, align, name)


def _in_sample_order(keys: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether every sample's points already come in ascending ``index`` order (then so do every
    voxel's, and no sort is needed: true when ranks read contiguous ranges in rank order)."""
    if len(index) < 2:
        return True
    b = key_batch(keys)
    if bool((b[1:] == b[:-1]).all()):
        return bool((index[1:] > index[:-1]).all())
    for s in torch.unique(b).tolist():
        i = index[b == s]
        if not bool((i[1:] > i[:-1]).all()):
            return False
    return True


#: Keys decoded at a time when locating owners (a decode needs ~80 bytes per key).
OWNER_CHUNK = 1 << 18


def _owners(grid: ProcessGrid, cuts: Cuts, keys: torch.Tensor) -> torch.Tensor:
    """int64 [p]: the grid rank owning each key's voxel, decoding OWNER_CHUNK keys at a time."""
    out = torch.empty(len(keys), dtype=torch.int64)
    for a in range(0, len(keys), OWNER_CHUNK):
        out[a:a + OWNER_CHUNK] = owner_ranks(grid, cuts, decode_keys(keys[a:a + OWNER_CHUNK]))
    return out


def voxelize_keys(grid: ProcessGrid, pk: PointKeys, num_classes: Optional[int] = None,
                  cuts: str | Cuts = "balanced", align: int = 1,
                  name: str = "points") -> LocalVoxels:
    """Steps 2 and 3 of :func:`distributed_voxelize` from every rank's :func:`quantize` output
    (collective over ``grid.comm``). ``pk`` is consumed: its tensors are released once sent, so
    that a rank does not hold its points and its owners' points at once."""
    batch_size = len(pk.counts)
    spatial_shape = pk.grid[2]
    check_same(grid.comm, {"feature channels": int(pk.feats.shape[1]),
                            "batch size": batch_size, "classes": num_classes,
                            "labels given": pk.labels is not None,
                            "grid (origin, voxel size, shape)": pk.grid,
                            "cuts": repr(cuts), "align": int(align)})
    from mpi4py import MPI

    per_sample = pk.counts.copy()
    grid.comm.Allreduce(MPI.IN_PLACE, per_sample, op=MPI.SUM)
    if (per_sample == 0).any():  # every rank sees the same sums: all raise alike
        raise VoxelizeError(f"{name}: sample {int(np.argmin(per_sample))} has no points on any "
                            "rank; a sample needs at least one point")
    box_cuts = agree(grid.comm, lambda: _cuts(grid, pk.keys, spatial_shape, cuts, align))
    owner = _owners(grid, box_cuts, pk.keys)
    has_labels = pk.labels is not None
    payload = [pk.keys, pk.index, pk.feats]
    if pk.labels is not None:
        payload.append(pk.labels)
    pk.keys = pk.index = pk.feats = pk.labels = None  # type: ignore[assignment]  # consumed
    moved = send_list(grid.comm, owner, payload)  # empties payload as it sends
    r_keys, r_index, r_feats = moved.rows[:3]
    r_labels = moved.rows[3] if has_labels else None
    moved.rows = ()  # the owner's copies go as soon as they are merged
    # The serial summation order within a voxel is the sample's point order (a voxel holds
    # points of one sample only): sort by index unless the rows already come in that order.
    if _in_sample_order(r_keys, r_index):
        u_keys, mean, inverse, vox_labels = merge_points(r_keys, r_feats, r_labels,
                                                         num_classes or 0)
        rows = inverse
    else:
        order = torch.sort(r_index, stable=True)[1]
        u_keys, mean, inverse, vox_labels = merge_points(
            r_keys[order], r_feats[order], r_labels[order] if r_labels is not None else None,
            num_classes or 0)
        rows = torch.empty(len(order), dtype=torch.int64)
        rows[order] = inverse
    del r_keys, r_index, r_feats, r_labels
    (point_row,) = moved.reply(rows)
    return LocalVoxels(decode_keys(u_keys), mean, vox_labels, box_cuts, owner, point_row)
