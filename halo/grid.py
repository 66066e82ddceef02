"""Process grids: a 3-D, non-periodic Cartesian communicator over the ranks that share a domain.

    grid = ProcessGrid(MPI.COMM_WORLD, (2, 2, 1))   # or None: MPI.Compute_dims picks the shape
    grid.coords                                     # this rank's (gx, gy, gz)
    grid.rank_of((1, 0, 0))                         # rank of a grid position
    for rank, direction in grid.neighbours():       # up to 26 adjacent ranks, e.g. (1, -1, 0)
        ...

Ranks keep their communicator's numbering (``reorder=False``), so rank ``r`` of the grid is rank
``r`` of the communicator it was built from; MPI numbers grid positions row-major (x slowest).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

from mpi4py import MPI

__all__ = ["GridError", "ProcessGrid", "grid_rank"]


class GridError(ValueError):
    """A process grid does not fit its communicator."""


def grid_rank(grid_coords: Sequence[int], dims: Sequence[int]) -> int:
    """Rank of a grid position in a row-major (x slowest) grid of shape ``dims``, MPI's order."""
    gx, gy, gz = (int(c) for c in grid_coords)
    return (gx * int(dims[1]) + gy) * int(dims[2]) + gz


def _check_dims(dims: Sequence[int], size: int) -> tuple[int, int, int]:
    try:
        t = tuple(int(d) for d in dims)
    except (TypeError, ValueError):
        raise GridError(f"grid {dims!r} is not a sequence of 3 ints; pass e.g. (2, 2, 1)") from None
    if len(t) != 3:
        raise GridError(f"grid {t} has {len(t)} axes; a process grid has 3 (x, y, z): pad with 1s, "
                        f"e.g. {t + (1,) * max(0, 3 - len(t))}")
    if min(t) < 1:
        raise GridError(f"grid {t} has an axis with {min(t)} ranks; every axis needs at least 1")
    prod = t[0] * t[1] * t[2]
    if prod != size:
        raise GridError(f"grid {t} has {prod} ranks but the communicator has {size}; "
                        f"pass a grid whose product is {size}")
    return t  # type: ignore[return-value]


class ProcessGrid:
    """A 3-D non-periodic Cartesian process grid over ``comm`` (collective: every rank calls it).

    comm: an intra-communicator (the world or a sub-communicator). dims: ranks along (x, y, z) with
    product ``comm.size``, or None to let ``MPI.Compute_dims`` choose a balanced shape.
    """

    def __init__(self, comm: MPI.Intracomm, dims: Optional[Sequence[int]] = None) -> None:
        if dims is None:
            dims = MPI.Compute_dims(comm.Get_size(), 3)
        # Checked before the collective Create_cart, so a bad shape raises on every rank alike.
        self.dims: tuple[int, int, int] = _check_dims(dims, comm.Get_size())
        self.comm: MPI.Cartcomm = comm.Create_cart(list(self.dims), periods=[False] * 3,
                                                   reorder=False)
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.coords: tuple[int, int, int] = tuple(self.comm.Get_coords(self.rank))  # type: ignore

    def rank_of(self, grid_coords: Sequence[int]) -> int:
        """Rank at grid position ``grid_coords``; GridError when it lies outside the grid."""
        c = tuple(int(v) for v in grid_coords)
        if len(c) != 3 or any(not 0 <= v < d for v, d in zip(c, self.dims)):
            raise GridError(f"grid position {c} is outside the grid {self.dims}")
        return grid_rank(c, self.dims)

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """Grid position of ``rank``."""
        if not 0 <= rank < self.size:
            raise GridError(f"rank {rank} is outside the grid's {self.size} ranks")
        d = self.dims
        return (rank // (d[1] * d[2]), (rank // d[2]) % d[1], rank % d[2])

    def neighbours(self) -> list[tuple[int, tuple[int, int, int]]]:
        """The up to 26 adjacent ranks (faces, edges, corners) as (rank, direction), ascending rank.

        ``direction`` is the neighbour's grid position minus this rank's, each component in
        {-1, 0, 1}. The grid is not periodic, so positions outside it have no neighbour.
        """
        out = []
        for d in itertools.product((-1, 0, 1), repeat=3):
            if d == (0, 0, 0):
                continue
            c = tuple(a + b for a, b in zip(self.coords, d))
            if all(0 <= v < n for v, n in zip(c, self.dims)):
                out.append((grid_rank(c, self.dims), (d[0], d[1], d[2])))
        return sorted(out)

    def free(self) -> None:
        """Release the Cartesian communicator (optional; MPI frees it at finalize)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def __repr__(self) -> str:
        return f"ProcessGrid(dims={self.dims}, rank={self.rank}, coords={self.coords})"
