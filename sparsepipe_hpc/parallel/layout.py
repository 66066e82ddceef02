"""RankLayout: how the ranks of a job split into replicas x pipeline stages x spatial grid.

    layout = RankLayout.from_world(8, grid=(2, 2, 1))     # 2 replicas of a 2x2x1 spatial grid
    layout.position(5)   # Position(replica=1, stage=0, spatial=1)

Rank order is replica-major, then stage, then spatial rank (the Cartesian grid's row-major order),
so a spatial group is a block of consecutive ranks: on a cluster, neighbouring boxes share a node.
Every communicator in the project is derived from this one object.

Where the devices differ (BaPipe's setting), which stage runs on which ranks matters; the planner
may pick another order than the launch's, and the trainer applies it by renumbering the ranks::

    comm = stage_ordered(MPI.COMM_WORLD, layout, (1, 0))   # stage 0 on the ranks launched as
                                                           # stage 1's, and stage 1 on stage 0's
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

__all__ = ["RankLayout", "Position", "LayoutError", "parse_grid", "parse_stage_order",
           "stage_ordered"]


class LayoutError(ValueError):
    """A rank layout that does not fit the job."""


class Position(NamedTuple):
    replica: int
    stage: int
    spatial: int


def parse_grid(text: str | Sequence[int] | None) -> Optional[tuple[int, int, int]]:
    """``"2,2,1"`` or ``(2, 2, 1)`` -> (2, 2, 1); None stays None."""
    if text is None:
        return None
    parts = text.replace("x", ",").split(",") if isinstance(text, str) else list(text)
    try:
        grid = tuple(int(p) for p in parts)
    except ValueError:
        raise LayoutError(f"grid must be three positive integers like 2,2,1; got {text!r}") from None
    if len(grid) != 3 or min(grid) < 1:
        raise LayoutError(f"grid must be three positive integers like 2,2,1; got {text!r}")
    return grid  # type: ignore[return-value]


def parse_stage_order(text: str | Sequence[int], stages: int, name: str = "stage order"
                      ) -> tuple[int, ...]:
    """``"1,0"`` or ``(1, 0)`` -> (1, 0), checked: a permutation of ``0 .. stages - 1``
    (LayoutError naming ``name``, the rule and the launch's order)."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        order = tuple(int(p) for p in parts)
    except ValueError:
        order = ()
    if sorted(order) != list(range(stages)):
        shown = text if isinstance(text, str) else ",".join(map(str, text))
        raise LayoutError(f"{name} {shown} must list each of the {stages} stage(s) "
                          f"0..{stages - 1} once ({','.join(map(str, range(stages)))} is the "
                          f"launch's order)")
    return order


def stage_ordered(comm: Any, layout: "RankLayout", order: Sequence[int]) -> Any:
    """``comm`` with its ranks renumbered so that stage ``s`` runs on the processes the layout
    places at stage ``order[s]`` (each keeps its replica and spatial rank). A process keeps its
    device, so this moves stages between devices. **Collective** (one ``Split``); the caller
    frees the result.
    """
    order = parse_stage_order(order, layout.stages)
    if comm.Get_size() != layout.size:
        raise LayoutError(f"the communicator has {comm.Get_size()} ranks, the layout {layout}")
    launched = layout.position(comm.Get_rank())
    return comm.Split(0, layout.rank_of(launched.replica, order.index(launched.stage),
                                        launched.spatial))


@dataclass(frozen=True)
class RankLayout:
    replicas: int
    stages: int
    grid: tuple[int, int, int]

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.stages < 1 or min(self.grid) < 1:
            raise LayoutError(f"replicas, stages and grid entries must be >= 1; got {self}")

    @property
    def spatial_size(self) -> int:
        return math.prod(self.grid)

    @property
    def size(self) -> int:
        return self.replicas * self.stages * self.spatial_size

    @classmethod
    def from_world(cls, world_size: int, grid: Optional[Sequence[int]] = None,
                   replicas: Optional[int] = None, stages: int = 1) -> "RankLayout":
        """Fill in what is not given: by default all ranks are data-parallel replicas."""
        g = tuple(grid) if grid is not None else (1, 1, 1)
        per_replica = stages * math.prod(g)
        if replicas is None:
            if world_size % per_replica:
                # Library terms only: each front end (the trainer's options, a user's script)
                # names its own way of changing the grid.
                what = f"grid {g}" if stages == 1 else f"grid {g} x {stages} stages"
                knobs = "a grid" if stages == 1 else "a grid and a stage count"
                raise LayoutError(
                    f"{what} uses {per_replica} ranks per replica, which does not divide the "
                    f"{world_size} ranks of the job; choose {knobs} whose product divides "
                    f"{world_size}, or start a multiple of {per_replica} ranks")
            replicas = world_size // per_replica
        layout = cls(replicas, stages, g)  # type: ignore[arg-type]
        if layout.size != world_size:
            raise LayoutError(f"{replicas} replica(s) x {stages} stage(s) x grid {g} = "
                              f"{layout.size} ranks, but the job has {world_size}")
        return layout

    def position(self, rank: int) -> Position:
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is outside a layout of {self.size} ranks")
        replica, rest = divmod(rank, self.stages * self.spatial_size)
        stage, spatial = divmod(rest, self.spatial_size)
        return Position(replica, stage, spatial)

    def rank_of(self, replica: int, stage: int, spatial: int) -> int:
        return (replica * self.stages + stage) * self.spatial_size + spatial

    def __str__(self) -> str:
        g = "x".join(map(str, self.grid))
        return f"{self.replicas} replica(s) x {self.stages} stage(s) x grid {g} = {self.size} ranks"
