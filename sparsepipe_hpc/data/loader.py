"""From samples to a batch of voxels: the global grid, train-time augmentation and collation.

    ds = SceneDataset(default_data("seg"), "train")
    origin, shape = grid_for(ds, voxel_size=0.05)        # the same for every sample and rank
    batches = ShardedBatches(len(ds), batch_size=8, replicas=R, rank=r, seed=0)
    for idx in batches:
        batch = collate([ds[i] for i in idx], 0.05, origin, shape, augment=True,
                        generator=batches.sample_generators(idx))
        logits = net(batch.x).feats                     # [N, K], one row per voxel
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

__all__ = ["Batch", "GridSizeError", "JITTER", "NOISE_BLOCK", "augment_margin", "collate",
           "grid_for", "augment_points", "augment_points_range", "jitter_block", "jitter_key",
           "RangeAugmenter", "Sample", "SceneDataset", "ModelNetDataset", "ShardedBatches"]

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
        return Batch(self.x.to(device), self.labels.to(device),
                     [t.to(device) for t in self.point_to_voxel], self.offsets.to(device),
                     [t.to(device) for t in self.point_labels], list(self.names))


def _extent(lo: np.ndarray, hi: np.ndarray, voxel_size: float, multiple: int) -> np.ndarray:
    """Voxels per axis of the padded grid holding [lo, hi], float64 [3]: counted in floats, so
    a tiny voxel or a far outlier gives a huge number (or inf), never an int64 overflow."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is the answer: too many
        n = np.floor(hi / voxel_size) - np.floor(lo / voxel_size) + 1
    n = np.where(np.isfinite(n), n, np.inf)  # inf - inf when both ends overflow
    return np.ceil(n / multiple) * multiple


def _grid(lo: np.ndarray, hi: np.ndarray, voxel_size: float, multiple: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """(first voxel index, padded extent) int64 [3] of the grid holding [lo, hi]; for extents
    :func:`_extent` has found within MAX_EXTENT."""
    first = np.floor(lo / voxel_size).astype(np.int64)
    n = np.floor(hi / voxel_size).astype(np.int64) - first + 1
    while True:
        padded = -(-n // multiple) * multiple
        start = first - (padded - n) // 2  # pad evenly: the grid's centre stays near the data's
        # Points are placed by floor((p - origin) / voxel) against the rounded origin, which
        # can put the lowest or highest point one voxel off floor(p / voxel): widen until
        # both land inside (a point within ~1e-9 m of a voxel face; no margin to absorb it).
        origin = _origin(start, voxel_size)
        below = np.floor((lo - origin) / voxel_size) < 0
        above = np.floor((hi - origin) / voxel_size) >= padded
        if not (below.any() or above.any()):
            return start, padded
        first, n = first - below, n + below + above


def _origin(first: np.ndarray, voxel_size: float) -> np.ndarray:
    """The grid's origin (m) for its first voxel index: rounded, -1.2 not -1.2000000000000002."""
    return np.array([round(float(i * voxel_size), 9) for i in first])


def _smallest_voxel(lo: np.ndarray, hi: np.ndarray, multiple: int) -> float:
    """A round voxel size (3 significant digits) at which [lo, hi] fits in MAX_EXTENT voxels."""
    v = float(np.max(hi - lo)) / max(1, MAX_EXTENT - multiple - 1)
    v = float(f"{v:.2e}")
    while not ((_extent(lo, hi, v, multiple) <= MAX_EXTENT).all()
               and (_grid(lo, hi, v, multiple)[1] <= MAX_EXTENT).all()):
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
    extent = _extent(lo, hi, voxel_size, multiple)
    if (extent <= MAX_EXTENT).all():
        first, padded = _grid(lo, hi, voxel_size, multiple)
        extent = padded.astype(np.float64)  # a voxel more where the rounded origin needs it
    if not (extent <= MAX_EXTENT).all():
        axis = int(np.argmax(extent))
        low, high = _extremes(sets, axis)
        raise GridSizeError(
            f"the points span {lo[axis] + margin:g} .. {hi[axis] - margin:g} m on {'xyz'[axis]}: "
            f"{'x'.join(f'{n:.0f}' if n < 1e12 else f'{n:.3g}' for n in extent)} voxels of "
            f"{voxel_size:g} m, but a sparse "
            f"tensor holds at most {MAX_EXTENT} voxels per axis. Lowest: {low}; highest: {high}. "
            "Remove outlying points from those samples, or use voxels of at least "
            f"{_smallest_voxel(lo, hi, multiple):g} m (trainer: --voxel-size)")
    origin = tuple(float(o) for o in _origin(first, voxel_size))
    return origin, tuple(int(s) for s in padded)  # type: ignore[return-value]


def augment_points(points: torch.Tensor, origin: Sequence[float], spatial_shape: Sequence[int],
                   voxel_size: float, generator: Optional[torch.Generator],
                   jitter: float = JITTER) -> torch.Tensor:
    """A random symmetry of the grid's footprint plus jitter, for ``points [P, 3]`` float64 (m).

    Flips x and y about the grid's centre (each with probability 1/2) and, when the grid is square
    in x-y, swaps x and y (together: the 8 rotations by 90 degrees and reflections), so points stay
    inside the grid; then adds Gaussian noise of ``jitter`` metres (clamped to 3 sigma) per point,
    drawn in blocks of :data:`NOISE_BLOCK` rows (:func:`jitter_block`). Draws from ``generator``
    in a fixed order (3 coins, then the jitter key when ``jitter > 0``), so the same generator
    state gives the same result; :class:`RangeAugmenter` gives any rows of it alone.
    """
    return RangeAugmenter(len(points), origin, spatial_shape, voxel_size, generator,
                          jitter)(points, 0)


#: Rows per jitter block. Block ``k`` (rows ``[k * NOISE_BLOCK, (k + 1) * NOISE_BLOCK)`` of a
#: sample, the last one shorter) is drawn whole from its own generator (:func:`jitter_block`), so
#: the jitter of any row range costs the blocks meeting it, not every row before it. Part of the
#: stream's definition: another value gives other (equally valid) jitter. (Earlier versions drew
#: the jitter as one stream over the whole sample: a checkpoint of theirs resumes with the same
#: data order, flips and swaps but other jitter; a resume within this version stays bitwise.)
NOISE_BLOCK = 1 << 16


def jitter_key(generator: Optional[torch.Generator]) -> int:
    """A sample's jitter key: one 63-bit draw from its generator (after the coins), from which
    every block's seed derives; so the jitter, like the coins, is fixed by the generator's state
    (``ShardedBatches.sample_generators``: by (seed, epoch, sample index))."""
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64))


def jitter_block(key: int, block: int, rows: int) -> torch.Tensor:
    """float64 [rows, 3]: the standard-normal jitter of block ``block`` of the sample whose
    :func:`jitter_key` is ``key`` (row-major: a point's x, y, z noise are consecutive draws).

    The block's generator is seeded by a hash of (key, block) (numpy's SeedSequence, as the
    sample generators are), so blocks are independent and any one is drawn without the others.
    """
    seed = int(np.random.SeedSequence([key, block]).generate_state(1, np.uint64)[0])
    return torch.randn((rows, 3), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


class RangeAugmenter:
    """:func:`augment_points` applied to row ranges of one sample, bit for bit.

        aug = RangeAugmenter(total, origin, shape, voxel_size, generator)
        part = aug(points[a:b], a)      # rows [a, b) of augment_points(all_points, ...)
        aug.blocks_drawn                # jitter blocks drawn so far

    Draws the coins and the jitter key once; a range ``[a, b)`` then draws only the jitter blocks
    (:data:`NOISE_BLOCK` rows each) meeting it: work and memory O(b - a + NOISE_BLOCK), wherever
    the range lies in the sample. Ranges may come in any order; the last block drawn is kept, so
    consecutive ranges draw a block they share once.
    """

    def __init__(self, total: int, origin: Sequence[float], spatial_shape: Sequence[int],
                 voxel_size: float, generator: Optional[torch.Generator],
                 jitter: float = JITTER) -> None:
        self.total = int(total)
        self.spatial_shape = tuple(spatial_shape)
        self.jitter = jitter
        self.centre = torch.tensor([o + s * voxel_size / 2 for o, s in zip(origin, spatial_shape)],
                                   dtype=torch.float64)
        self.coin = torch.rand(3, generator=generator, dtype=torch.float64)
        self.key = jitter_key(generator) if jitter > 0 else 0
        self.block = NOISE_BLOCK  # read once: the block size defines the stream
        self.blocks_drawn = 0
        self._last: Optional[tuple[int, torch.Tensor]] = None  # (block, its noise) drawn last

    def _noise_block(self, k: int) -> torch.Tensor:
        """Block ``k``'s jitter in metres, clamped to 3 sigma: float64 [rows of block k, 3]."""
        if self._last is None or self._last[0] != k:
            rows = min(self.block, self.total - k * self.block)
            noise = jitter_block(self.key, k, rows)
            noise.mul_(self.jitter).clamp_(-3 * self.jitter, 3 * self.jitter)
            self._last = (k, noise)
            self.blocks_drawn += 1
        return self._last[1]

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
        p = points - self.centre
        if self.coin[0] < 0.5:
            p[:, 0] = -p[:, 0]
        if self.coin[1] < 0.5:
            p[:, 1] = -p[:, 1]
        if self.coin[2] < 0.5 and self.spatial_shape[0] == self.spatial_shape[1]:
            p = p[:, [1, 0, 2]]
        if self.jitter > 0 and stop > start:
            n = self.block
            for k in range(start // n, (stop - 1) // n + 1):  # the blocks meeting [start, stop)
                lo = k * n
                a, b = max(lo, start), min(lo + n, stop)
                p[a - start:b - start] += self._noise_block(k)[a - lo:b - lo]
        p += self.centre
        return p


def augment_points_range(points: torch.Tensor, start: int, total: int, origin: Sequence[float],
                         spatial_shape: Sequence[int], voxel_size: float,
                         generator: Optional[torch.Generator], jitter: float = JITTER
                         ) -> torch.Tensor:
    """Rows ``[start, start + len(points))`` of ``augment_points(all_points, ...)`` for a sample of
    ``total`` points, given only those rows ``points [p, 3]`` float64 (m): the same flips, swap
    and per-point jitter, bit for bit, from a generator in the same state, drawing only the
    jitter blocks meeting the range. For a spatial rank that read a hyperslab of the sample
    (:class:`RangeAugmenter` for several ranges)."""
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
