"""Halo plans: which owned voxels each neighbour needs, and which voxels arrive from whom.

    r = halo_radius(kernel_size=3, padding=1)                  # 1 for a 3x3x3 submanifold conv
    plan = build_plan(grid, cuts, coords, radius=r)           # collective over the grid
    local_map, halo_map = plan.kernel_maps(coords, coords, 3, padding=1)
    boundary = boundary_rows(halo_map)                        # outputs that wait for the halo

The picture, for the rank owning box B (one 2-D slice, radius r = 1)::

          +---------+-------------------+---------+
          |  NW     |        N          |   NE    |        h  halo rows B receives: voxels of
          |      h  | h  h  h  h  h  h  |  h      |           the neighbours within r of B
          +------+--+-------------------+--+------+
          |  W   |h |s  s  s  s  s  s  s| h|   E  |        s  rows B sends: its voxels within
          |      |h |s      box B      s| h|      |           r of a neighbour's box (a corner
          |      |h |s  s  s  s  s  s  s| h|      |           voxel goes to 3 neighbours in 2-D,
          +------+--+-------------------+--+------+           up to 7 in 3-D)
          |  SW  h  | h  h  h  h  h  h  |  h  SE |
          +---------+-------------------+---------+

Every neighbour, edges and corners included (26 in 3-D), sends B the voxels it owns within
``radius`` (per axis, i.e. Chebyshev distance) of B's box; B does the same for each of them. The
radius covers every input a kernel of B's outputs can reach (:func:`halo_radius`). One hop is
enough when interior boxes are at least ``radius`` thick (:meth:`Cuts.check_thickness`).

Contract. coords int32 [N, 4] (batch, x, y, z): the voxels this rank owns, global indices at the
plan's ``stride``. ``halo_coords`` int32 [H, 4]: the received voxels, in blocks of ``recv_counts``
ordered like ``recv_ranks`` (ascending), each block sorted by :func:`halo.kmap.coord_keys`.
``send_rows[i]``: int64 rows of ``coords`` for ``send_ranks[i]``, in the order the receiver stores
them. The exchange is counts first, then coordinates, both point-to-point through a
:class:`halo.transport.Transport` (buffer-protocol, no pickling).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from halo.agree import agree
from halo.cuts import CutError, Cuts
from halo.grid import ProcessGrid
from halo.kmap import (MAX_BATCH, MAX_EXTENT, KernelMap, coord_keys, kernel_map,
                       output_coords, true_at)
from halo.transport.base import Transport

__all__ = ["PlanError", "HaloPlan", "PlanCache", "build_plan", "halo_radius", "boundary_rows",
           "interior_rows", "select_sends", "halo_boxes", "run_facts", "send_runs", "PLAN_TAG"]

PLAN_TAG = 0x4A10  # tags PLAN_TAG (counts) and PLAN_TAG + 1 (coordinates) carry plan messages
_FAR = 1 << 40     # "infinitely far": edge boxes own everything beyond the extent


class PlanError(ValueError):
    """Input to a halo plan breaks its contract."""


def _triple(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (v, v, v) if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)
    if len(t) != 3:
        raise PlanError(f"expected an int or 3 ints; got {v!r}")
    return t  # type: ignore[return-value]


def halo_radius(kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                transposed: bool = False, misalign: int = 0) -> int:
    """Halo radius (voxels at the input's stride) a convolution needs.

    Output ``o`` reads inputs ``o * stride - padding + k * dilation``, k in [0, kernel_size). With
    an output box [L, H) and its input box [L*s, H*s) (cuts aligned to the output's stride),
    inputs reach ``padding`` below the box and ``(K-1)*d - p - s + 1`` above it; the radius is the
    larger, over all axes. ``misalign`` (:meth:`Cuts.misalignment`): when an input box starts
    ``m`` voxels past a multiple of ``s``, its output box starts at the multiple below, so inputs
    reach ``p + m`` below (and less above)::

        inputs   ... 6  7 | 8  9 10 11 ...     cut at 7 (m = 1), s = 2, k = 2
        outputs    [ 3  ]   [ 4 ] [ 5 ]        output 3 (inputs 6, 7) is owned by the upper box,
                   ^ owned above: input 6 is one voxel below its input box

    ``transposed``: the inverse convolution (inputs at the coarse stride,
    ``in * s - p + k * d = out``); it needs aligned cuts (``misalign`` 0).
    """
    if misalign < 0 or (transposed and misalign):
        raise PlanError(f"misalign is {misalign}; it must be >= 0, and 0 for a transposed "
                        f"convolution")
    r = 0
    for k, s, p, d in zip(*(_triple(v) for v in (kernel_size, stride, padding, dilation))):
        if min(k, s, d) < 1 or p < 0:
            raise PlanError(f"kernel_size {k}, stride {s}, dilation {d} must be >= 1 and padding "
                            f"{p} >= 0")
        if transposed:
            below, above = ((k - 1) * d - p) // s, 1 + (p - 1) // s
        else:
            below, above = p + min(misalign, s - 1), (k - 1) * d - p - s + 1
        r = max(r, below, above)
    return r


def halo_boxes(cuts: Cuts, grid_coords: Sequence[int],
               stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) int64 [3] of a box at ``stride``, edge boxes extended to "infinity" (ownership)."""
    lo, hi = cuts.box(grid_coords, stride)
    for a in range(3):
        if grid_coords[a] == 0:
            lo[a] = -_FAR
        if grid_coords[a] == cuts.dims[a] - 1:
            hi[a] = _FAR
    return lo, hi


def select_sends(coords: torch.Tensor, boxes: Sequence[tuple[np.ndarray, np.ndarray]],
                 radius: int) -> list[torch.Tensor]:
    """For each box (lo, hi), the rows of ``coords`` within ``radius`` of it, sorted by key (pure).

    coords int [N, 4]; returns int64 row tensors. Within radius means ``lo - r <= x < hi + r`` on
    every spatial axis.
    """
    if not boxes:
        return []
    order = torch.sort(coord_keys(coords))[1]  # rows by key, so every selection comes out sorted
    return _rows_inside(order, _inside(coords, order, boxes, radius), batched=coords.is_cuda)


def _inside(coords: torch.Tensor, order: torch.Tensor,
            boxes: Sequence[tuple[np.ndarray, np.ndarray]], radius: int) -> list[torch.Tensor]:
    """bool [N] per box: whether row ``order[j]`` of ``coords`` lies within ``radius`` of it."""
    xyz = coords[order, 1:].long()
    # Bounds copied without blocking: a blocking host-to-device copy waits for the device.
    return [((xyz >= torch.as_tensor(lo - radius).to(xyz.device, non_blocking=True))
             & (xyz < torch.as_tensor(hi + radius).to(xyz.device, non_blocking=True))).all(1)
            for lo, hi in boxes]


def _rows_inside(order: torch.Tensor, inside: list[torch.Tensor], batched: bool,
                 counts: Optional[list[int]] = None) -> list[torch.Tensor]:
    """``order[m]`` for every mask ``m`` of ``inside``. Batched (on a GPU, where each boolean
    selection is a host sync): the masks' counts in one copy to the host (or ``counts``, the
    masks' sums read already), then one selection for all masks that needs no more
    (:func:`~halo.kmap.true_at`), one sync instead of one per mask; on the CPU one selection per
    mask is faster (no [B, N] stack)."""
    if not batched:
        return [order[m] for m in inside]
    stacked = torch.stack(inside)  # [B, N]
    if counts is None:
        counts = stacked.sum(1).tolist()  # the one host sync
    flat = true_at(stacked.reshape(-1), sum(counts))  # mask by mask, each in order's order
    return list(torch.split(order[flat % stacked.shape[1]], counts))


@dataclass
class HaloPlan:
    """Who sends which owned rows to whom, and which halo voxels arrive; see the module docstring."""

    send_ranks: list[int]
    send_rows: list[torch.Tensor]
    recv_ranks: list[int]
    recv_counts: list[int]
    halo_coords: torch.Tensor
    num_local: int
    stride: int = 1
    radius: int = 0
    grid_coords: tuple[int, int, int] = (0, 0, 0)
    cuts: Optional[Cuts] = field(default=None, repr=False)
    # Per send block, (a, b) when its rows are exactly a, a+1, ..., b-1 (sent as a slice), else
    # None; None: not known yet (:func:`send_runs` reads it then).
    send_runs: Optional[list[Optional[tuple[int, int]]]] = field(default=None, repr=False)
    # int64 [E], ascending: the rows sent to any neighbour, i.e. those within ``radius`` of a
    # neighbour's box, the only ones whose stencils can reach a halo row (None: not known).
    edge_rows: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def num_halo(self) -> int:
        return int(self.halo_coords.shape[0])

    @property
    def send_counts(self) -> list[int]:
        return [len(r) for r in self.send_rows]

    @property
    def recv_offsets(self) -> list[int]:
        """[len(recv_ranks) + 1]: block i of the halo is rows recv_offsets[i]:recv_offsets[i+1]."""
        return [0] + list(np.cumsum(self.recv_counts, dtype=np.int64).tolist())

    def _check_local(self, local_coords: torch.Tensor) -> None:
        if local_coords.ndim != 2 or len(local_coords) != self.num_local:
            raise PlanError(f"local_coords has shape {tuple(local_coords.shape)}; the plan was "
                            f"built for {self.num_local} local rows")

    def kernel_maps(self, local_coords: torch.Tensor, out_coords: torch.Tensor,
                    kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                    padding: int | Sequence[int] = 0,
                    dilation: int | Sequence[int] = 1) -> tuple[KernelMap, KernelMap]:
        """(local_map, halo_map): the kernel map over inputs local ∪ halo, split by input.

        local_coords int32 [num_local, 4] (the coords the plan was built from); out_coords int
        [M, 4], this rank's outputs at the output stride. local_map's in_rows index local rows
        (n_in = num_local), halo_map's index halo rows 0..H-1 (n_in = num_halo); both keep
        kernel_map's per-offset CSR layout, and every pair of the full map is in exactly one.
        """
        self._check_local(local_coords)
        inputs = torch.cat([local_coords.to(self.halo_coords.dtype), self.halo_coords])
        km = kernel_map(inputs, out_coords, kernel_size, stride, padding, dilation)
        is_local = km.in_rows < self.num_local
        local = km.select(is_local, n_in=self.num_local)
        halo = km.select(~is_local, n_in=self.num_halo, in_rows=km.in_rows - self.num_local)
        return local, halo

    def subm_halo_map(self, local_coords: torch.Tensor, kernel_size: int | Sequence[int],
                      dilation: int | Sequence[int] = 1) -> KernelMap:
        """The halo part of a submanifold convolution over this rank's voxels: halo rows
        (0..H-1) -> local rows, equal to ``kernel_map(halo_coords, local_coords, ...)``.

        A halo voxel lies in a neighbour's box, so only a row within the plan's radius of such a
        box can read one: only :attr:`edge_rows` are looked up (a 2-rank split of 114k voxels:
        481 rows, 2 ms instead of 60 ms on one CPU core). The plan's radius must cover the
        kernel's reach (:func:`halo_radius`; PlanError otherwise), as its halo must.
        """
        self._check_local(local_coords)
        k, d = _triple(kernel_size), _triple(dilation)
        pad = [di * (ki // 2) for ki, di in zip(k, d)]
        reach = halo_radius(k, 1, pad, d)
        if reach > self.radius:
            raise PlanError(f"a submanifold kernel {k} with dilation {d} reaches {reach} voxels; "
                            f"this plan's halo has radius {self.radius}: build it with "
                            f"radius=halo_radius(...) of the convolution")
        if self.edge_rows is None:
            return kernel_map(self.halo_coords, local_coords, k, 1, pad, d)
        km = kernel_map(self.halo_coords, local_coords[self.edge_rows], k, 1, pad, d)
        # Edge rows ascend, so the pairs keep the full map's order (by offset, then output row).
        return KernelMap(km.in_rows, self.edge_rows[km.out_rows], km.ptr, self.num_halo,
                         self.num_local)

    def owned_outputs(self, local_coords: torch.Tensor, kernel_size: int | Sequence[int],
                      stride: int | Sequence[int], padding: int | Sequence[int],
                      dilation: int | Sequence[int], out_shape: Sequence[int]) -> torch.Tensor:
        """This rank's active outputs of a strided convolution: int32 [M, 4], sorted by key.

        An output belongs to the rank whose box (at the output's stride, ``plan.stride *
        stride``) holds it; its inputs all lie in local ∪ halo when the plan's radius is
        :func:`halo_radius` of the convolution. Needs a plan from :func:`build_plan`.
        """
        if self.cuts is None:
            raise PlanError("owned_outputs needs the plan's cuts; build the plan with build_plan")
        s = _triple(stride)
        if len(set(s)) != 1:
            raise PlanError(f"owned_outputs supports one stride for all axes; got {s}")
        inputs = torch.cat([local_coords.to(self.halo_coords.dtype), self.halo_coords])
        out = output_coords(inputs, kernel_size, stride, padding, dilation, out_shape)
        g = self.cuts.locate(out[:, 1:], self.stride * s[0])
        mine = (g == torch.tensor(self.grid_coords, device=g.device)).all(1)
        return out[mine]


def boundary_rows(halo_map: KernelMap) -> torch.Tensor:
    """int64 [B]: sorted output rows that have at least one halo input (they wait for the halo)."""
    return torch.unique(halo_map.out_rows)


def interior_rows(halo_map: KernelMap) -> torch.Tensor:
    """int64 [n_out - B]: sorted output rows with local inputs only (computable before the halo)."""
    mask = torch.ones(halo_map.n_out, dtype=torch.bool, device=halo_map.out_rows.device)
    mask.index_fill_(0, halo_map.out_rows, False)  # a scalar: no host value copied to a GPU
    return torch.nonzero(mask).reshape(-1)


def _shape_problem(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, radius: int,
                   stride: int) -> str:
    """What is wrong with the arguments' shapes, types and settings, read without the device;
    "" if nothing."""
    if tuple(cuts.dims) != tuple(grid.dims):
        return f"cuts are for a grid {cuts.dims} but the process grid is {grid.dims}"
    if coords.ndim != 2 or coords.shape[1] != 4:
        return f"coords has shape {tuple(coords.shape)}; expected [N, 4] (batch, x, y, z)"
    if coords.dtype not in (torch.int32, torch.int64):
        return f"coords has dtype {coords.dtype}; expected int32"
    if not isinstance(radius, (int, np.integer)) or radius < 0:
        return f"radius is {radius!r}; it must be an integer >= 0"
    if not isinstance(stride, (int, np.integer)) or stride < 1:
        return f"stride is {stride!r}; it must be a positive integer"
    return ""


def _contract_checks(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, stride: int,
                     sorted_keys: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the rows' device, nothing read back: (grid position of each row int64 [N, 3], rows
    outside this rank's box bool [N], keys equal to the next sorted one bool [max(N - 1, 0)],
    rows the voxel keys cannot hold bool [N]: a batch index outside [0, MAX_BATCH) or a
    coordinate outside [-MAX_EXTENT, MAX_EXTENT))."""
    g = torch.as_tensor(cuts.locate(coords[:, 1:], stride))
    mine = torch.tensor(grid.coords).to(g.device, non_blocking=True)
    b, xyz = coords[:, 0], coords[:, 1:]
    unkeyed = (b < 0) | (b >= MAX_BATCH) | ((xyz < -MAX_EXTENT) | (xyz >= MAX_EXTENT)).any(1)
    return g, (g != mine).any(1), sorted_keys[1:] == sorted_keys[:-1], unkeyed


def _coords_problem(grid: ProcessGrid, coords: torch.Tensor, stride: int,
                    checks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    order: torch.Tensor, n_bad: int, n_dup: int, n_unkeyed: int) -> str:
    """The first row that breaks the contract, named, from :func:`_contract_checks` and its
    counts (read already); "" if none."""
    g, bad, dup, unkeyed = checks
    if n_unkeyed:  # first: such rows' keys may collide, and look like duplicates
        row = int(torch.nonzero(unkeyed)[0])
        return (f"coords row {row} is {coords[row].tolist()}: batch indices must lie in "
                f"[0, {MAX_BATCH}) and coordinates in [{-MAX_EXTENT}, {MAX_EXTENT}) "
                f"(halo.kmap's voxel keys; {n_unkeyed} such rows)")
    if n_bad:
        row = int(torch.nonzero(bad)[0])
        return (f"coords row {row} is {coords[row].tolist()}, owned by grid position "
                f"{tuple(g[row].tolist())}, not by this rank's {grid.coords} (stride {stride}, "
                f"{n_bad} such rows); pass the voxels this rank owns (halo.distribute)")
    if n_dup:
        first = int(torch.nonzero(dup)[0])
        i, j = sorted((int(order[first]), int(order[first + 1])))
        return (f"coords rows {i} and {j} are the same voxel {coords[i].tolist()} "
                f"({n_dup} duplicates); rows must be unique")
    return ""


def run_facts(blocks: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """int64 [2 x non-empty blocks], on the rows' device: each block's first row and whether its
    rows run consecutively; None without a non-empty block."""
    facts = [torch.stack([r[0], (r[1:] - r[:-1] == 1).all().to(r.dtype)]) for r in blocks
             if len(r)]
    return torch.cat(facts) if facts else None


def send_runs(blocks: list[torch.Tensor], facts: Optional[list[int]] = None
              ) -> list[Optional[tuple[int, int]]]:
    """For each block of rows, (a, b) when it is exactly a, a+1, ..., b-1; else None. ``facts``:
    :func:`run_facts` of the blocks already read back to the host; else one read here for all
    blocks (on a GPU, a read per block would each wait for the device)."""
    if facts is None:
        t = run_facts(blocks)
        facts = t.tolist() if t is not None else []
    read = iter(facts)
    out: list[Optional[tuple[int, int]]] = []
    for r in blocks:
        if not len(r):
            out.append(None)
            continue
        a, consecutive = next(read), next(read)
        out.append((a, a + len(r)) if consecutive else None)
    return out


def build_plan(grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor, radius: int,
               stride: int = 1, transport: Optional[Transport] = None,
               tag: int = PLAN_TAG) -> HaloPlan:
    """Build this rank's halo plan (collective over ``grid.comm``; every rank calls it).

    coords int32 [N, 4]: the voxels this rank owns, global indices at ``stride`` (N may be 0).
    radius: halo width in voxels at ``stride`` (see :func:`halo_radius`). transport: moves counts
    and coordinates; default :class:`halo.transport.MPITransport` on ``grid.comm``.
    Raises PlanError / CutError on every rank for thin boxes, rows this rank does not own or
    the voxel keys cannot hold, or cuts, radius or stride that differ between ranks.
    """
    problem = _shape_problem(grid, cuts, coords, radius, stride)
    thin: Optional[CutError] = None
    if not problem:
        try:
            cuts.check_thickness(radius, stride)  # raised below, once the ranks agree on cuts
        except CutError as e:
            thin = e
    nbrs = [r for r, _ in grid.neighbours()]
    inside: list[torch.Tensor] = []
    batched, checked = False, []
    if not problem and thin is None:
        # One key sort serves the contract's duplicate test and the send selection, and the
        # counts of both come back in one copy: one device wait, where each took its own.
        sorted_keys, order = torch.sort(coord_keys(coords))
        checks = _contract_checks(grid, cuts, coords, stride, sorted_keys)
        boxes = [halo_boxes(cuts, grid.coords_of(r), stride) for r in nbrs]
        inside = _inside(coords, order, boxes, radius) if radius > 0 and nbrs else []
        batched = coords.is_cuda and bool(inside)
        sums = [checks[1].sum().view(1), checks[2].sum().view(1), checks[3].sum().view(1)]
        checked = torch.cat(sums + ([torch.stack(inside).sum(1)] if batched else [])).tolist()
        problem = _coords_problem(grid, coords, stride, checks, order, *checked[:3])
    # Agree first, so that one rank's bad rows stop every rank before the point-to-point phase;
    # and on the arguments every rank must pass alike (each would plan with its own).
    setting = f"cuts {cuts!r}, radius {radius}, stride {stride}"
    any_problem, same = agree(grid.comm, bool(problem), setting)
    if problem:
        raise PlanError(f"build_plan on rank {grid.rank}: {problem}")
    if any_problem:
        raise PlanError("build_plan: another rank passed bad coords; see its error")
    if not same:
        raise PlanError(f"build_plan: ranks passed different arguments; here {setting}; every "
                        f"rank must pass the same")
    if thin is not None:
        raise thin
    if transport is None:
        from halo.transport.mpi import MPITransport

        transport = MPITransport(grid.comm)
    dev = coords.device
    rows = _rows_inside(order, inside, batched, checked[3:]) if inside else \
        [torch.zeros(0, dtype=torch.int64, device=dev) for _ in nbrs]
    coords = coords.int()
    send_ranks = [r for r, rw in zip(nbrs, rows) if len(rw)]
    send_rows = [rw for rw in rows if len(rw)]
    facts = run_facts(send_rows)
    edge = torch.zeros(len(coords), dtype=torch.bool, device=dev)
    if send_rows:  # index_fill_, not edge[...] = True: that copies the value from the host,
        edge.index_fill_(0, torch.cat(send_rows), True)  # a blocking copy on a GPU
    send_n = [torch.tensor([len(r)]).to(dev, non_blocking=True) for r in rows]
    recv_n = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in nbrs]
    transport.start(list(zip(nbrs, send_n)), list(zip(nbrs, recv_n)), tag).wait()
    # The counts received, the edge rows' count and the send blocks' runs in one host copy (one
    # device wait).
    read = recv_n + [edge.sum().view(1)] + ([facts] if facts is not None else [])
    host = torch.cat(read).tolist()
    counts = host[:len(nbrs)]
    recv_ranks = [r for r, c in zip(nbrs, counts) if c]
    recv_counts = [c for c in counts if c]
    halo = torch.empty(sum(recv_counts), 4, dtype=torch.int32, device=dev)
    offs = [0, *itertools.accumulate(recv_counts)]
    recvs = [(r, halo[offs[i]:offs[i + 1]]) for i, r in enumerate(recv_ranks)]
    sends = [(r, coords[rw].contiguous()) for r, rw in zip(send_ranks, send_rows)]
    transport.start(sends, recvs, tag + 1).wait()
    return HaloPlan(send_ranks, send_rows, recv_ranks, recv_counts, halo, len(coords), stride,
                    radius, grid.coords, cuts, send_runs(send_rows, host[len(nbrs) + 1:]),
                    true_at(edge, host[len(nbrs)]))


class PlanCache:
    """Plans by the caller's key (like spconv's ``indice_key``): a sparsity pattern pays once.

        plans = PlanCache()
        plan = plans.get_or_build("subm1", grid, cuts, coords, radius=1)   # collective

    Every rank must use the cache the same way (same keys in the same order), since a miss is a
    collective build. A hit is checked against the request (the rows themselves: the same coords
    tensor, or equal ones; radius, stride, cuts, grid) and a mismatch raises PlanError: a key
    reused for another sparsity pattern would silently exchange garbage.
    Each call agrees on that check and on hit or miss (one small all-reduce), so a rank whose
    rows changed alone, or that missed where the others hit, stops every rank.
    """

    def __init__(self) -> None:
        self._plans: dict[Hashable, HaloPlan] = {}
        self._coords: dict[Hashable, torch.Tensor] = {}  # the rows each plan was built for

    def get_or_build(self, key: Hashable, grid: ProcessGrid, cuts: Cuts, coords: torch.Tensor,
                     radius: int, stride: int = 1, transport: Optional[Transport] = None,
                     builder: Optional[Callable[..., HaloPlan]] = None) -> HaloPlan:
        plan, built_for = self._plans.get(key), self._coords.get(key)
        other: list[str] = []  # what differs from the cached plan's request, besides the numbers
        stale = False
        if plan is not None and built_for is not None:
            same_rows = built_for is coords or (built_for.shape == coords.shape
                                                and bool(torch.equal(built_for, coords)))
            other = [what for what, differs in (
                ("other voxels", not same_rows and len(coords) == plan.num_local),
                ("other cuts", plan.cuts != cuts),
                ("another box", plan.grid_coords != tuple(grid.coords))) if differs]
            stale = not same_rows or bool(other) or (plan.radius, plan.stride) != (radius, stride)
        # Only the verdicts are compared: a key's repr may differ between processes (a set's
        # order follows the hash seed, an object's shows its address).
        setting = "miss" if plan is None else "hit"
        any_stale, same = agree(grid.comm, stale, setting)
        if stale:
            assert plan is not None
            raise PlanError(
                f"plan cache key {key!r} holds a plan for {plan.num_local} rows, radius "
                f"{plan.radius}, stride {plan.stride}; asked for {len(coords)} rows, radius "
                f"{radius}, stride {stride}{''.join(', ' + o for o in other)}: use a distinct "
                f"key per sparsity pattern and radius, or clear() the cache")
        if any_stale:
            raise PlanError(f"plan cache key {key!r}: another rank's request does not match its "
                            "plan; see its error")
        if not same:
            raise PlanError(f"the ranks use the plan cache differently; here key {key!r} is a "
                            f"{setting}: every rank must ask for the same keys in the same order, "
                            "and clear() alike")
        if plan is None:
            plan = (builder or build_plan)(grid, cuts, coords, radius, stride, transport)
            self._plans[key], self._coords[key] = plan, coords
        return plan

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plans

    def __getitem__(self, key: Hashable) -> HaloPlan:
        return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
        self._coords.clear()
