"""Halo exchange under mpirun: exact values, the adjoint identity, autograd, overlap, buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import halo
import halo.transport.delay as delay_module
from helpers import FakeClock, HostReads
from halo.kmap import coord_keys
from halo.synth import boundary_cloud, clustered_cloud, with_batch

GRIDS = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1)]
EXTENT = (32, 32, 24)


def setup(comm, rng, dims, radius=1):
    if int(np.prod(dims)) != comm.size:
        pytest.skip(f"grid {dims} needs {int(np.prod(dims))} ranks")
    grid = halo.ProcessGrid(comm, dims)
    cuts = halo.uniform_cuts(EXTENT, grid.dims, align=2)
    xyz = np.unique(np.concatenate([clustered_cloud(rng, 1200, EXTENT, spread=0.15),
                                    boundary_cloud(rng, 600, cuts, radius=radius)]), axis=0)
    cloud = with_batch(xyz)
    mine = cloud[halo.owner_ranks(grid, cuts, cloud) == grid.rank]
    plan = halo.build_plan(grid, cuts, mine, radius)
    return grid, cloud, mine, plan


def field(coords, c, dtype=torch.float64):
    """Features as a function of the global coordinate: any rank can compute anyone's."""
    k = coord_keys(coords).double()[:, None]
    j = torch.arange(1, c + 1, dtype=torch.float64)[None]
    return torch.sin(k * 1e-3 * j + j).to(dtype)


def allsum(comm, x: float) -> float:
    buf = np.array([x], np.float64)
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return float(buf[0])


@pytest.mark.parametrize("dims", GRIDS)
def test_exchange_values(comm, rng, dims):
    grid, cloud, mine, plan = setup(comm, rng, dims)
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        feats = field(mine, 5).mul(100).to(dtype)
        got = ex.start(feats).wait()
        assert got.dtype == dtype and got.shape == (plan.num_halo, 5)
        assert torch.equal(got, field(plan.halo_coords, 5).mul(100).to(dtype))


@pytest.mark.parametrize("dims", GRIDS)
def test_exchange_setup_reads_back_once(comm, rng, dims):
    """Which send blocks are row ranges is read back once for all of them (each read waits for
    the device on a GPU), with the plan, so that the exchange's setup reads nothing; and the
    ranges are found: a face of key-sorted rows is one."""
    from halo.plan import send_runs

    grid, cloud, mine, plan = setup(comm, rng, dims)
    transport = halo.MPITransport(grid.comm)
    with HostReads() as reads:
        ex = halo.HaloExchange(plan, transport)
    assert reads.count == 0, reads.ops
    with HostReads() as reads:
        assert send_runs(plan.send_rows) == ex._runs
    assert reads.ops == (["tolist"] if any(len(r) for r in plan.send_rows) else []), reads.ops
    for rows, run in zip(plan.send_rows, ex._runs):
        steps_of_one = len(rows) > 0 and bool((rows.diff() == 1).all())
        assert (run is not None) == steps_of_one
        if run is not None:
            assert run == (int(rows[0]), int(rows[0]) + len(rows))


@pytest.mark.parametrize("dims", GRIDS)
def test_adjoint_identity(comm, rng, dims):
    """<H x, y> == <x, H^T y>, summed over ranks, in float64."""
    grid, cloud, mine, plan = setup(comm, rng, dims, radius=2)
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    g = torch.Generator().manual_seed(1000 + grid.rank)
    x = torch.randn(plan.num_local, 7, dtype=torch.float64, generator=g)
    y = torch.randn(plan.num_halo, 7, dtype=torch.float64, generator=g)
    hx = ex.start(x).wait()
    hty = ex.start_adjoint(y).wait()
    assert hty.shape == x.shape
    lhs = allsum(grid.comm, float((hx * y).sum()))
    rhs = allsum(grid.comm, float((x * hty).sum()))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    # Exact content: H^T y at an owned row is the sum of y over that voxel's halo copies.
    halo_keys = coord_keys(plan.halo_coords)
    ex_keys = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    copies = ex_keys.start(torch.ones(plan.num_local, 1, dtype=torch.float64)).wait()
    counts = ex_keys.start_adjoint(copies).wait()  # how many neighbours hold each owned row
    sent = torch.zeros(plan.num_local, dtype=torch.float64)
    for rows in plan.send_rows:
        sent[rows] += 1
    assert torch.equal(counts[:, 0], sent)
    assert len(torch.unique(halo_keys)) == plan.num_halo


@pytest.mark.parametrize("dims", GRIDS)
def test_autograd_function(comm, rng, dims):
    grid, cloud, mine, plan = setup(comm, rng, dims)
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    x = field(mine, 3).requires_grad_(True)
    h = halo.halo_exchange(x, ex)
    w = field(plan.halo_coords, 3) + 0.5
    (h * w).sum().backward()
    assert torch.equal(h.detach(), field(plan.halo_coords, 3))
    assert torch.equal(x.grad, ex.start_adjoint(w).wait())


@pytest.mark.parametrize("dims", GRIDS)
def test_overlapping_exchanges_and_buffer_reuse(comm, rng, dims):
    """Two exchanges in flight at once on one plan; earlier results survive later calls."""
    grid, cloud, mine, plan = setup(comm, rng, dims)
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    a, b = field(mine, 4), field(mine, 4) * -2
    pa, pb = ex.start(a), ex.start(b)
    while not (pa.test() and pb.test()):
        pass
    ha, hb = pa.wait(), pb.wait()
    want = field(plan.halo_coords, 4)
    assert torch.equal(ha, want) and torch.equal(hb, want * -2)
    hc = ex.start(a * 3).wait()  # reuses a staging buffer; ha must not change
    assert torch.equal(ha, want) and torch.equal(hc, want * 3)
    assert sum(len(v) for v in ex._pool.values()) == 2  # two staging buffers, now both free
    out = torch.empty(plan.num_halo, 4, dtype=torch.float64)
    assert ex.start(a, out=out).wait() is out and torch.equal(out, want)



def test_delayed_transport_overlap(comm, rng, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(delay_module, "time", clock)
    grid, cloud, mine, plan = setup(comm, rng, (comm.size, 1, 1))
    slow = halo.DelayedTransport(halo.MPITransport(grid.comm), seconds=0.05)
    ex = halo.HaloExchange(plan, slow)
    pending = ex.start(field(mine, 2))
    assert not pending.test()  # still "on the wire": the delay has not passed
    got = pending.wait()       # waits out the whole delay
    assert sum(clock.slept) == pytest.approx(0.05)
    assert torch.equal(got, field(plan.halo_coords, 2))
    pending = ex.start(field(mine, 2))
    clock.now += 0.06          # work longer than the delay: the wait then adds nothing
    got = pending.wait()
    assert sum(clock.slept) == pytest.approx(0.05)
    assert torch.equal(got, field(plan.halo_coords, 2))


def test_shape_errors(comm, rng):
    grid, cloud, mine, plan = setup(comm, rng, (comm.size, 1, 1))
    ex = halo.HaloExchange(plan, halo.MPITransport(grid.comm))
    with pytest.raises(halo.ExchangeError, match=f"the plan needs \\[{plan.num_local}, C\\]"):
        ex.start(torch.zeros(plan.num_local + 1, 2))
    with pytest.raises(halo.ExchangeError, match="grad_halo has shape"):
        ex.start_adjoint(torch.zeros(plan.num_halo + 1, 2))
    if plan.num_local and plan.num_halo:  # only the error, never a half-started exchange
        with pytest.raises(halo.ExchangeError, match="out is"):
            ex.start(torch.zeros(plan.num_local, 2), out=torch.zeros(plan.num_halo, 3))
