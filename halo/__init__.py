"""halo: domain decomposition and halo exchange for sparse voxel sets over MPI.

It knows voxels, boxes, ranks and kernels, not neural networks. A stencil over a sparse voxel set,
split over a 2 x 2 x 1 grid of ranks (run under ``mpirun -n 4``)::

    from mpi4py import MPI
    import halo

    grid = halo.ProcessGrid(MPI.COMM_WORLD, (2, 2, 1))
    cuts = halo.balanced_cuts(grid.comm, my_xyz, extent=(256, 256, 64), dims=grid.dims, align=4)
    coords, feats = halo.distribute(grid, cuts, my_coords, my_feats)     # rows to their owners
    plan = halo.build_plan(grid, cuts, coords, radius=halo.halo_radius(3, padding=1))
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    pending = ex.start(feats)                    # neighbours' boundary rows are on their way
    local, ghost = plan.kernel_maps(coords, coords, kernel_size=3, padding=1)
    ...                                          # work on interior rows (local pairs) meanwhile
    halo_feats = pending.wait()                  # [plan.num_halo, C], rows of plan.halo_coords
    ...                                          # then the ghost pairs: halo row -> local output

Coordinates are int32 [N, 4] (batch, x, y, z) global voxel indices throughout; see each module
for its tensor contracts: :mod:`halo.grid`, :mod:`halo.cuts`, :mod:`halo.ownership`,
:mod:`halo.plan`, :mod:`halo.exchange`, :mod:`halo.transport`, :mod:`halo.kmap`,
:mod:`halo.balance`; :mod:`halo.synth` (synthetic clouds) and :mod:`halo.reference` (brute-force
references) serve tests and benchmarks.

Names are imported on first use (PEP 562), so ``import halo.kmap`` alone does not load mpi4py
(importing ``mpi4py.MPI`` initializes MPI).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "halo.grid": ["ProcessGrid", "GridError"],
    "halo.cuts": ["Cuts", "CutError", "uniform_cuts", "balanced_cuts", "axis_histograms",
                  "cuts_from_histograms"],
    "halo.ownership": ["owner_ranks", "distribute", "gather", "OwnershipError"],
    "halo.plan": ["HaloPlan", "PlanCache", "PlanError", "build_plan", "halo_radius",
                  "boundary_rows", "interior_rows"],
    "halo.exchange": ["HaloExchange", "Pending", "halo_exchange", "ExchangeError"],
    "halo.transport": ["Transport", "Request", "TransportError", "MPITransport",
                       "DelayedTransport"],
    "halo.balance": ["minmax_cuts"],
    "halo.kmap": ["KernelMap", "kernel_map", "output_coords", "coord_keys"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]

if TYPE_CHECKING:
    from halo.balance import minmax_cuts  # noqa: F401
    from halo.cuts import (CutError, Cuts, axis_histograms, balanced_cuts,  # noqa: F401
                           cuts_from_histograms, uniform_cuts)
    from halo.exchange import ExchangeError, HaloExchange, Pending, halo_exchange  # noqa: F401
    from halo.grid import GridError, ProcessGrid  # noqa: F401
    from halo.kmap import KernelMap, coord_keys, kernel_map, output_coords  # noqa: F401
    from halo.ownership import OwnershipError, distribute, gather, owner_ranks  # noqa: F401
    from halo.plan import (HaloPlan, PlanCache, PlanError, boundary_rows,  # noqa: F401
                           build_plan, halo_radius, interior_rows)
    from halo.transport import (DelayedTransport, MPITransport, Request,  # noqa: F401
                                Transport, TransportError)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'halo' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
