"""Data sets for sparsepipe_hpc: HDF5 layouts, the synthetic generator, batching and sharding.

    from sparsepipe_hpc.data import (SceneDataset, ModelNetDataset, ShardedBatches, collate,
                                     default_data, grid_for)
    ds = SceneDataset(default_data("seg"), "train")
    origin, shape = grid_for(ds, voxel_size=0.05)
    for idx in ShardedBatches(len(ds), batch_size=4, seed=0):
        batch = collate([ds[i] for i in idx], 0.05, origin, shape)

Modules: ``checks`` (DataFormatError and shared HDF5 validation), ``scenes`` (scene layout for
segmentation), ``chunks`` (its chunked form for big scenes: points sorted by spatial chunk, a
table of chunk boxes), ``floor`` (a floor of rooms as one large scene), ``modelnet`` (ModelNet40 HDF5 layout for classification), ``shapes`` and ``synth``
(synthetic rooms and objects; ``python -m sparsepipe_hpc.data.synth``), ``default`` (cached
default data), ``loader`` (grid, augmentation, collate), ``sharding`` (batch order per replica),
``prefetch`` (the next batch read on a host thread), ``splits`` (train and validation splits must
agree).
"""

from sparsepipe_hpc.data.checks import DataFormatError
from sparsepipe_hpc.data.default import DataGenerationError, default_data
from sparsepipe_hpc.data.loader import (JITTER, Batch, GridSizeError, augment_margin,
                                        augment_points, collate, grid_for)
from sparsepipe_hpc.data.modelnet import ModelNetDataset, write_modelnet
from sparsepipe_hpc.data.sample import Sample
from sparsepipe_hpc.data.scenes import SceneDataset, write_scenes
from sparsepipe_hpc.data.sharding import ShardedBatches
from sparsepipe_hpc.data.splits import check_splits

__all__ = [
    "Batch", "DataFormatError", "DataGenerationError", "GridSizeError", "JITTER", "ModelNetDataset",
    "Sample", "SceneDataset", "ShardedBatches", "augment_margin", "augment_points", "check_splits",
    "collate", "default_data", "grid_for", "write_modelnet", "write_scenes",
]
