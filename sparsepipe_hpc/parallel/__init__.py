"""Parallel execution: rank layout, per-rank context, spatially distributed layers.

    from sparsepipe_hpc.parallel import ParallelContext, RankLayout
    ctx = ParallelContext(MPI.COMM_WORLD, RankLayout.from_world(4, grid=(2, 2, 1)))
"""

from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import LayoutError, Position, RankLayout, parse_grid

__all__ = ["ParallelContext", "RankLayout", "Position", "LayoutError", "parse_grid"]
