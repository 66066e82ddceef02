"""Property tests under MPI: random clouds, grids, cut positions (aligned or not), kernels.

The oracle for every drawn case: the distributed result equals the serial one, or every rank
raises the same clear error (a box thinner than the kernel's reach). Hypothesis runs on every
rank with the same derandomized draws; each example's verdict is agreed over all ranks before
the next one starts, and shrinking is off, so one rank's failure stops every rank at the same
example instead of leaving the others in a collective. (A failure inside a collective phase on
one rank can still leave the others waiting; pytest-timeout ends that example.) Cut positions
come from a drawn seed: hypothesis's own integers favour 0 and the extent, which are no cuts.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import halo
from halo.cuts import Cuts, CutError
from halo.kmap import coord_keys
from halo.reference import reference_halo
from sparsepipe_hpc.nn import SparseConv3d, SparseInverseConv3d, SubMConv3d
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.sparse import SparseTensor

from mpi4py import MPI

COMM = MPI.COMM_WORLD
SHAPE = (20, 18, 16)
TOL = dict(rtol=1e-9, atol=1e-11)
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))
GRIDS = [g for g in itertools.product(range(1, COMM.size + 1), repeat=3)
         if int(np.prod(g)) == COMM.size]
CONTEXTS: dict = {}


def context(grid) -> ParallelContext:
    """One context per grid for the whole module (building one is collective)."""
    if grid not in CONTEXTS:
        CONTEXTS[grid] = ParallelContext(COMM, RankLayout(1, 1, grid), force_spatial=True)
    return CONTEXTS[grid]


def agreed(fn) -> str:
    """Run ``fn`` (returns an outcome string) and agree: every rank sees every rank's outcome."""
    try:
        outcome = fn()
    except CutError as e:
        outcome = f"CutError: {str(e)[:60]}"
    except Exception as e:  # noqa: BLE001 - any other failure must reach every rank too
        outcome = f"MISMATCH on rank {COMM.rank}: {type(e).__name__}: {e}"
    outcomes = COMM.allgather(outcome)
    bad = [o for o in outcomes if o.startswith("MISMATCH")]
    assert not bad, bad[0]
    assert len({o.split(":")[0] for o in outcomes}) == 1, f"ranks disagree: {outcomes}"
    return outcomes[0]


@st.composite
def cuts_for(draw, grid, extent, align):
    """Random interior cuts, multiples of ``align`` (1: anywhere); boxes may be thin or empty."""
    # Positions from a drawn seed: hypothesis's own integers favour the extremes (cuts at 0 or
    # at the extent), which would leave few real interior cuts.
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bounds = []
    for n, e in zip(grid, extent):
        units = -(-e // align)
        inner = rng.integers(0, units + 1, size=n - 1)
        bounds.append([0, *sorted(min(int(u) * align, e) for u in inner), e])
    return Cuts(tuple(bounds))


@st.composite
def clouds(draw):
    seed = draw(st.integers(0, 2**31))
    clustered = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    hi = torch.tensor(SHAPE) // (2 if clustered else 1)
    xyz = (torch.rand(int(draw(st.integers(200, 700))), 3, generator=g) * hi).long()
    if draw(st.booleans()):  # the grid's corners: clouds touching faces and corners
        xyz = torch.cat([xyz, torch.tensor(list(itertools.product(
            *((0, s - 1) for s in SHAPE))))])
    coords = torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1)
    coords = torch.unique(torch.cat([coords, coords[::2] + torch.tensor([1, 0, 0, 0])]), dim=0)
    feats = torch.randn(len(coords), 3, generator=g, dtype=torch.float64)
    return SparseTensor(coords.int(), feats, SHAPE, 2)


LAYERS = st.sampled_from([
    ("subm", 1, 1), ("subm", 3, 1), ("subm", 3, 2), ("subm", 5, 1),
    ("down", 2, 0), ("down", 3, 1), ("down", 3, 0)])  # kind, kernel, dilation or padding


def reach(kind: str, k: int, arg: int) -> int:
    """Voxels (level 0) that every interior box must span for the layer's halo to be exact: the
    layer's own reach, worked out here, not asked of the library. A submanifold layer reaches
    ``dilation * (k // 2)``; a strided pair, conservatively, a few voxels more than its kernel
    (its inverse runs at stride 2, on cuts that may fall between the coarse voxels)."""
    return arg * (k // 2) if kind == "subm" else 2 * k + 2


def thinnest_interior(cuts: Cuts) -> int:
    """The narrowest box with boxes on both sides along its axis (level-0 voxels); a large number
    where no axis has one."""
    widths = [w for b in cuts.bounds for w in np.diff(b)[1:-1]]
    return int(min(widths)) if widths else 1 << 30


def build(kind: str, k: int, arg: int) -> torch.nn.Module:
    if kind == "subm":
        return torch.nn.Sequential(SubMConv3d(3, 4, k, dilation=arg))
    return torch.nn.Sequential(SparseConv3d(3, 4, k, 2, arg, indice_key="d"),
                               SparseInverseConv3d(4, 2, k, indice_key="d"))


@SETTINGS
@given(data=st.data(), x=clouds(), layer=LAYERS, grid=st.sampled_from(GRIDS),
       align=st.sampled_from([1, 2]))
def test_distributed_layers_equal_serial_or_refuse_everywhere(data, x, layer, grid, align):
    cuts = data.draw(cuts_for(grid, SHAPE, align))
    torch.manual_seed(0)
    serial = build(*layer).double()
    dist = copy.deepcopy(serial)
    ctx = context(grid)

    def check() -> str:
        fs = x.feats.clone().requires_grad_()
        ys = serial(x.replace(feats=fs, kmaps={}))
        r = torch.randn(ys.feats.shape, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
        (ys.feats * r).sum().backward()
        xl, = ctx.distribute(x.replace(kmaps={}), cuts=cuts)
        fd = xl.feats.clone().requires_grad_()
        yd = dist(xl.replace(feats=fd))
        order = torch.argsort(coord_keys(ys.coords))
        rows = order[torch.searchsorted(coord_keys(ys.coords)[order], coord_keys(yd.coords))
                     .clamp(max=len(order) - 1)]
        assert torch.equal(ys.coords[rows], yd.coords), "outputs the serial run lacks"
        (yd.feats * r[rows]).sum().backward()
        torch.testing.assert_close(yd.feats, ys.feats[rows].detach(), **TOL)
        assert COMM.allreduce(len(yd.coords)) == len(ys.coords), "outputs lost or duplicated"
        in_order = torch.argsort(coord_keys(x.coords))
        in_rows = in_order[torch.searchsorted(coord_keys(x.coords)[in_order],
                                              coord_keys(xl.coords))]
        torch.testing.assert_close(fd.grad, fs.grad[in_rows], **TOL)
        ctx.allreduce_gradients(dist)
        for ps, pd in zip(serial.parameters(), dist.parameters()):
            torch.testing.assert_close(pd.grad, ps.grad, **TOL)
        return "equal"

    outcome = agreed(check)
    # A refusal must be deserved: only where an interior box is thinner than the layer's reach
    # (the first and last boxes may be thin, even empty). Subm reaches are exact both ways.
    thin = thinnest_interior(cuts) < reach(*layer)
    assert (outcome != "equal") <= thin, f"refused with every interior box thick: {outcome}"
    if layer[0] == "subm":
        assert (outcome != "equal") == thin, f"{outcome}; cuts {cuts.bounds}"


@SETTINGS
@given(data=st.data(), x=clouds(), grid=st.sampled_from(GRIDS), radius=st.integers(0, 3),
       stride=st.sampled_from([1, 2]))
def test_halo_plans_equal_the_brute_force_halo(data, x, grid, radius, stride):
    cuts = data.draw(cuts_for(grid, SHAPE, 1))
    pgrid = context(grid).group.grid
    coords = x.coords.clone()
    coords[:, 1:] //= stride
    coords = torch.unique(coords, dim=0)

    def check() -> str:
        mine = coords[halo.owner_ranks(pgrid, cuts, coords, stride) == pgrid.rank]
        plan = halo.build_plan(pgrid, cuts, mine, radius, stride=stride)
        expect = reference_halo(coords, cuts, pgrid.coords, radius, stride)
        assert torch.equal(torch.sort(coord_keys(plan.halo_coords))[0],
                           torch.sort(coord_keys(expect))[0]), "halo differs from brute force"
        return "equal"

    agreed(check)


def test_a_failure_on_one_rank_is_seen_by_all(comm):
    """The agreement itself: a mismatch on the last rank fails the example on every rank."""
    def check() -> str:
        assert comm.rank != comm.size - 1, "planted"
        return "equal"

    with pytest.raises(AssertionError, match="MISMATCH on rank"):
        agreed(check)
