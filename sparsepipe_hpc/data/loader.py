"""From samples to a batch of voxels: the global grid, train-time augmentation and collation.

    ds = SceneDataset(default_data("seg"), "train")
    origin, shape = grid_for(ds, voxel_size=0.05)        # the same for every sample and rank
    batches = ShardedBatches(len(ds), batch_size=8, replicas=R, rank=r, seed=0)
    for idx in batches:
        batch = collate([ds[i] for i in idx], 0.05, origin, shape, augment=True,
                        generator=batches.sample_generators(idx))
        logits = net(batch.x)                           # [N, K], one row per voxel
        loss = F.cross_entropy(logits, batch.labels)

Batch contract (B samples, N voxels in all):
    x.coords        int32 [N, 4]  (batch, x, y, z), global voxel indices of the grid
                    ``origin + index * voxel_size``; sample b's rows: ``offsets[b]:offsets[b+1]``
    x.feats         float32 [N, C] mean point feature per voxel
    labels          int64 [N] majority point label per voxel (segmentation), or [B] (classification)
    offsets         int64 [B + 1] voxel row offsets per sample
    point_to_voxel  list of B int64 [P_b]: each point's row *within its sample's voxels* (add
                    ``offsets[b]`` for a row of ``x``); -1 only for a point dropped off the grid
                    by an explicit ``clip=True``
    point_labels    list of B int64 [P_b] per-point labels (segmentation), [] for classification
    names           list of B sample names

``Sample``, the data sets and ``ShardedBatches`` are re-exported here for one-stop imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, cast

import numpy as np
import torch

from sparsepipe_hpc.data.modelnet import ModelNetDataset
from sparsepipe_hpc.data.sample import Sample
from sparsepipe_hpc.data.scenes import SceneDataset
from sparsepipe_hpc.data.sharding import ShardedBatches
from sparsepipe_hpc.sparse import MAX_EXTENT, SparseTensor
from sparsepipe_hpc.voxelize import voxelize

__all__ = ["Batch", "GridSizeError", "JITTER", "augment_margin", "collate", "grid_for",
           "augment_points", "augment_points_range", "RangeAugmenter", "Sample", "SceneDataset", "ModelNetDataset",
           "ShardedBatches"]

#: Default standard deviation (metres) of the per-point jitter of :func:`augment_points`.
JITTER = 0.005


class GridSizeError(ValueError):
    """The points and the voxel size give a grid wider than a sparse tensor can index."""


class _HasBounds(Protocol):
    def bounds(self) -> tuple[np.ndarray, np.ndarray]: ...


def augment_margin(jitter: float = JITTER) -> float:
    """Metres to widen a grid by so that :func:`augment_points` (flips about the grid's centre,
    x-y swap, jitter clamped to 3 sigma) keeps every point inside it: the flips and the swap map
    a point at distance d from an edge to distance d from another edge, and the jitter moves it by
    at most 3 sigma; the micrometre covers float rounding."""
    return 3 * jitter + 1e-6


@dataclass
class Batch:
    """Voxelized samples; see the module docstring for every field's contract."""

    x: SparseTensor
    labels: torch.Tensor
    point_to_voxel: list[torch.Tensor]
    offsets: torch.Tensor
    point_labels: list[torch.Tensor]
    names: list[str] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.x.batch_size)

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch with every tensor on ``device``."""
        return Batch(self.x.replace(coords=self.x.coords.to(device),
                                    feats=self.x.feats.to(device)),
                     self.labels.to(device), [t.to(device) for t in self.point_to_voxel],
                     self.offsets.to(device), [t.to(device) for t in self.point_labels],
                     list(self.names))


def _grid(lo: np.ndarray, hi: np.ndarray, voxel_size: float, multiple: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """(first voxel index, padded extent) int64 [3] of the grid holding [lo, hi]."""
    first = np.floor(lo / voxel_size).astype(np.int64)
    last = np.floor(hi / voxel_size).astype(np.int64)  # the voxel holding the highest point
    n = last - first + 1
    padded = -(-n // multiple) * multiple
    first -= (padded - n) // 2  # pad evenly so that the grid's centre stays near the data's
    return first, padded


def _smallest_voxel(lo: np.ndarray, hi: np.ndarray, multiple: int) -> float:
    """A round voxel size (3 significant digits) at which [lo, hi] fits in MAX_EXTENT voxels."""
    v = float(np.max(hi - lo)) / max(1, MAX_EXTENT - multiple - 1)
    v = float(f"{v:.2e}")
    while (_grid(lo, hi, v, multiple)[1] > MAX_EXTENT).any():
        v = float(f"{v * 1.01:.2e}")
    return v


def _extremes(sets: Sequence[_HasBounds], axis: int) -> tuple[str, str]:
    """Where the lowest and the highest coordinate on ``axis`` lie, for messages: a sample when
    the data set knows each sample's box, else the data set."""
    found = []
    for pick, side in ((np.argmin, 0), (np.argmax, 1)):
        best: Optional[tuple[float, str]] = None
        for d in sets:
            per = getattr(d, "sample_bounds", lambda: None)()
            if per is not None:
                values = per[side][:, axis]
                i = int(pick(values))
                where, value = d.describe_sample(i), float(values[i])  # type: ignore[attr-defined]
            else:
                value = float(d.bounds()[side][axis])
                where = repr(d)
            if best is None or (value < best[0] if side == 0 else value > best[0]):
                best = (value, where)
        found.append(f"{'xyz'[axis]} = {best[0]:g} m in {best[1]}")  # type: ignore[index]
    return found[0], found[1]


def grid_for(dataset: _HasBounds | Sequence[_HasBounds], voxel_size: float, multiple: int = 16,
             margin: Optional[float] = None
             ) -> tuple[tuple[float, float, float], tuple[int, int, int]]:
    """A fixed global grid ``(origin (m), spatial_shape (voxels))`` holding every point.

    ``dataset`` is one data set or several (e.g. train and val, so both share a grid); their
    ``bounds()`` are united, widened by ``margin`` metres (default :func:`augment_margin`, so that
    augmented points stay on the grid too), snapped to voxel boundaries (the origin is a multiple
    of ``voxel_size``) and padded evenly on both sides until every axis is a multiple of
    ``multiple`` (the network's total stride). The result depends only on the files, so every rank
    computes the same grid.

    Raises GridSizeError when an axis would need more than ``MAX_EXTENT`` (65,536) voxels, naming
    the samples that hold the extreme coordinates (outliers far from the scene, or a voxel size
    too small for the scene) and the smallest voxel size that fits.
    """
    if not voxel_size > 0 or not math.isfinite(voxel_size):
        raise ValueError(f"voxel_size must be a positive number of metres; got {voxel_size}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1; got {multiple}")
    margin = augment_margin() if margin is None else margin
    sets: list[Any] = list(dataset) if isinstance(dataset, (list, tuple)) else [dataset]
    lo = np.min([np.asarray(d.bounds()[0], dtype=np.float64) for d in sets], axis=0) - margin
    hi = np.max([np.asarray(d.bounds()[1], dtype=np.float64) for d in sets], axis=0) + margin
    first, padded = _grid(lo, hi, voxel_size, multiple)
    if (padded > MAX_EXTENT).any():
        axis = int(np.argmax(padded))
        low, high = _extremes(sets, axis)
        raise GridSizeError(
            f"the points span {lo[axis] + margin:g} .. {hi[axis] - margin:g} m on {'xyz'[axis]}: "
            f"{'x'.join(map(str, padded.tolist()))} voxels of {voxel_size:g} m, but a sparse "
            f"tensor holds at most {MAX_EXTENT} voxels per axis. Lowest: {low}; highest: {high}. "
            "Remove outlying points from those samples, or use voxels of at least "
            f"{_smallest_voxel(lo, hi, multiple):g} m (trainer: --voxel-size)")
    origin = tuple(round(float(i * voxel_size), 9) for i in first)  # -1.2, not -1.2000000000000002
    return origin, tuple(int(s) for s in padded)  # type: ignore[return-value]


def augment_points(points: torch.Tensor, origin: Sequence[float], spatial_shape: Sequence[int],
                   voxel_size: float, generator: Optional[torch.Generator],
                   jitter: float = JITTER) -> torch.Tensor:
    """A random symmetry of the grid's footprint plus jitter, for ``points [P, 3]`` float64 (m).

    Flips x and y about the grid's centre (each with probability 1/2) and, when the grid is square
    in x-y, swaps x and y (together: the 8 rotations by 90 degrees and reflections), so points stay
    inside the grid; then adds Gaussian noise of ``jitter`` metres (clamped to 3 sigma) per point.
    Draws from ``generator`` in a fixed order, so the same generator state gives the same result.
    """
    centre = torch.tensor([o + s * voxel_size / 2 for o, s in zip(origin, spatial_shape)],
                          dtype=torch.float64)
    coin = torch.rand(3, generator=generator, dtype=torch.float64)
    p = points - centre
    if coin[0] < 0.5:
        p[:, 0] = -p[:, 0]
    if coin[1] < 0.5:
        p[:, 1] = -p[:, 1]
    if coin[2] < 0.5 and spatial_shape[0] == spatial_shape[1]:
        p = p[:, [1, 0, 2]]
    if jitter > 0:
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64) * jitter
        p = p + noise.clamp_(-3 * jitter, 3 * jitter)
    return p + centre


#: Rows per draw when :func:`augment_points_range` streams the jitter (a multiple of 16: torch's
#: CPU normal sampler works in blocks of 16, which makes a chunked draw equal one whole draw).
NOISE_CHUNK = 1 << 16


class RangeAugmenter:
    """:func:`augment_points` applied to consecutive row ranges of one sample, bit for bit.

        aug = RangeAugmenter(total, origin, shape, voxel_size, generator)
        part = aug(points[a:b], a)      # then aug(points[b:c], b), ...: starts may skip rows
                                        # forward, never go back

    Draws the coins once, then streams the jitter in chunks of :data:`NOISE_CHUNK` rows (memory:
    one chunk; time: every row up to the last one asked for, as one whole draw would).
    """

    def __init__(self, total: int, origin: Sequence[float], spatial_shape: Sequence[int],
                 voxel_size: float, generator: Optional[torch.Generator],
                 jitter: float = JITTER) -> None:
        self.total = int(total)
        self.spatial_shape = tuple(spatial_shape)
        self.generator = generator
        self.jitter = jitter
        self.centre = torch.tensor([o + s * voxel_size / 2 for o, s in zip(origin, spatial_shape)],
                                   dtype=torch.float64)
        self.coin = torch.rand(3, generator=generator, dtype=torch.float64)
        self._pos = 0       # rows drawn so far
        self._chunk: Optional[torch.Tensor] = None  # the last chunk drawn, rows [pos - n, pos)

    def _noise(self, start: int, stop: int) -> torch.Tensor:
        out = torch.empty((stop - start, 3), dtype=torch.float64)
        if self._chunk is not None:  # rows of the chunk drawn last
            lo = self._pos - len(self._chunk)
            a, b = max(lo, start), min(self._pos, stop)
            if a < b:
                out[a - start:b - start] = self._chunk[a - lo:b - lo]
        while self._pos < stop:
            left = self.total - self._pos
            n = left if left < 2 * NOISE_CHUNK else NOISE_CHUNK
            self._chunk = torch.randn((n, 3), generator=self.generator, dtype=torch.float64)
            a, b = max(self._pos, start), min(self._pos + n, stop)
            if a < b:
                out[a - start:b - start] = self._chunk[a - self._pos:b - self._pos]
            self._pos += n
        return out

    def box(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where boxes ``[lo, hi]`` (float64 [K, 3], metres) of the sample go: (lo', hi') holding
        the augmented position of every point inside them (flips, swap, and the jitter's bound of
        3 x ``jitter``; exact up to float rounding, which callers allow for). Pure: draws
        nothing."""
        c = self.centre.numpy()
        a, b = np.asarray(lo, np.float64) - c, np.asarray(hi, np.float64) - c
        for axis in (0, 1):
            if self.coin[axis] < 0.5:
                a[:, axis], b[:, axis] = -b[:, axis], -a[:, axis].copy()
        if self.coin[2] < 0.5 and self.spatial_shape[0] == self.spatial_shape[1]:
            a, b = a[:, [1, 0, 2]], b[:, [1, 0, 2]]
        pad = 3 * self.jitter if self.jitter > 0 else 0.0
        return a - pad + c, b + pad + c

    def __call__(self, points: torch.Tensor, start: int) -> torch.Tensor:
        """Rows ``[start, start + len(points))`` of the augmented sample; ``points`` float64."""
        stop = start + len(points)
        if not 0 <= start <= stop <= self.total:
            raise ValueError(f"augment_points_range: rows [{start}, {stop}) are not inside a "
                             f"sample of {self.total} points")
        if self._chunk is not None and start < self._pos - len(self._chunk):
            raise ValueError(f"RangeAugmenter: rows from {start} were asked after rows up to "
                             f"{self._pos}; ranges must come in increasing order")
        p = points - self.centre
        if self.coin[0] < 0.5:
            p[:, 0] = -p[:, 0]
        if self.coin[1] < 0.5:
            p[:, 1] = -p[:, 1]
        if self.coin[2] < 0.5 and self.spatial_shape[0] == self.spatial_shape[1]:
            p = p[:, [1, 0, 2]]
        if self.jitter > 0:
            noise = self._noise(start, stop)
            noise.mul_(self.jitter).clamp_(-3 * self.jitter, 3 * self.jitter)
            p += noise
            del noise
        p += self.centre
        return p


def augment_points_range(points: torch.Tensor, start: int, total: int, origin: Sequence[float],
                         spatial_shape: Sequence[int], voxel_size: float,
                         generator: Optional[torch.Generator], jitter: float = JITTER
                         ) -> torch.Tensor:
    """Rows ``[start, start + len(points))`` of ``augment_points(all_points, ...)`` for a sample of
    ``total`` points, given only those rows ``points [p, 3]`` float64 (m): the same flips, swap
    and per-point jitter, bit for bit, from a generator in the same state. For a spatial rank
    that read a hyperslab of the sample (:class:`RangeAugmenter` for several ranges)."""
    return RangeAugmenter(total, origin, spatial_shape, voxel_size, generator, jitter)(points,
                                                                                         start)


def collate(samples: Sequence[Sample], voxel_size: float, origin: Sequence[float],
            spatial_shape: Sequence[int], augment: bool = False,
            generator: torch.Generator | Sequence[torch.Generator] | None = None, *,
            jitter: float = JITTER, clip: bool = False) -> Batch:
    """Voxelize ``samples`` against the global grid and batch them (see :class:`Batch`).

    ``augment`` (training only) applies :func:`augment_points` drawing from ``generator``: one
    generator for the batch, or one per sample (``ShardedBatches.sample_generators``: then a
    sample's augmentation depends only on (seed, epoch, sample), not on the replica count). Points
    off the grid raise a VoxelizeError naming the sample, unless ``clip=True`` drops them; a grid
    from :func:`grid_for` (default margin) holds every augmented point, so nothing is dropped
    silently. Segmentation samples give per-voxel majority labels, classification samples one
    label each; a batch may not mix the two.
    """
    if len(samples) == 0:
        raise ValueError("collate: got no samples; a batch needs at least one")
    per_sample = isinstance(generator, (list, tuple))
    if per_sample and len(generator) != len(samples):  # type: ignore[arg-type]
        raise ValueError(f"collate: got {len(generator)} generators for "  # type: ignore[arg-type]
                         f"{len(samples)} samples; pass one per sample or a single one")
    seg = samples[0].labels is not None
    channels = samples[0].feats.shape[1]
    voxels = []
    point_labels: list[torch.Tensor] = []
    for k, s in enumerate(samples):
        if (s.labels is not None) != seg:
            kinds = ("classification", "segmentation") if seg else ("segmentation",
                                                                     "classification")
            raise ValueError(f"collate: sample {s.name!r} is a {kinds[0]} sample but "
                             f"{samples[0].name!r} is a {kinds[1]} one; a batch holds one kind")
        if s.feats.shape != (s.num_points, channels):
            raise ValueError(f"collate: sample {s.name!r} has feats {tuple(s.feats.shape)}; "
                             f"expected [{s.num_points}, {channels}] like {samples[0].name!r}")
        if not seg and s.label is None:
            raise ValueError(f"collate: sample {s.name!r} has neither labels nor label")
        pts = torch.as_tensor(np.asarray(s.points), dtype=torch.float64)
        if augment:
            g = cast(Optional[torch.Generator],
                     generator[k] if per_sample else generator)  # type: ignore[index]
            pts = augment_points(pts, origin, spatial_shape, voxel_size, g, jitter)
        labels = torch.as_tensor(np.asarray(s.labels), dtype=torch.int64) if seg else None
        voxels.append(voxelize(pts, s.feats, voxel_size, origin, spatial_shape, labels=labels,
                               clip=clip, name=f"sample {s.name!r}"))
        if labels is not None:  # seg
            point_labels.append(labels)
    x = SparseTensor.from_voxels(voxels, spatial_shape)
    counts = torch.tensor([len(v.coords) for v in voxels], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    if seg:
        labels_out = torch.cat([cast(torch.Tensor, v.labels) for v in voxels])
    else:  # every sample's label was checked above
        labels_out = torch.tensor([int(cast(int, s.label)) for s in samples], dtype=torch.int64)
    return Batch(x, labels_out, [v.point_to_voxel for v in voxels], offsets, point_labels,
                 [s.name for s in samples])
