"""Sample: one point cloud as a data set hands it out, before voxelization.

    s = dataset[i]
    s.points   # float32 [P, 3], metres (float64 where the file stores it; ModelNet: unit sphere)
    s.feats    # float32 [P, C]: rgb in [0, 1], or a column of ones when the file has no colour
    s.labels   # int64 [P] per-point class (segmentation) or None
    s.label    # int class of the whole cloud (classification) or None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Sample"]


@dataclass
class Sample:
    """One point cloud. Exactly one of ``labels`` (segmentation) and ``label`` (classification)
    is set; ``name`` says where it came from (scene name, or ``file/row``)."""

    points: np.ndarray
    feats: np.ndarray
    labels: Optional[np.ndarray]
    label: Optional[int]
    name: str

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])
