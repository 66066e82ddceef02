"""Transports, grids and the exchange in one process (MPI.COMM_SELF, messages to oneself)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import halo
import halo.transport.delay as delay_module
from helpers import FakeClock
from halo.plan import HaloPlan
from halo.transport.base import CompletedRequest


def test_process_grid_on_one_rank():
    g = halo.ProcessGrid(MPI.COMM_SELF)
    assert g.dims == (1, 1, 1) and g.coords == (0, 0, 0) and g.neighbours() == []
    assert g.rank_of((0, 0, 0)) == 0
    with pytest.raises(halo.GridError, match="outside the grid"):
        g.rank_of((1, 0, 0))
    with pytest.raises(halo.GridError, match="grid \\(2, 2, 1\\) has 4 ranks but the communicator "
                                             "has 1; pass a grid whose product is 1"):
        halo.ProcessGrid(MPI.COMM_SELF, (2, 2, 1))
    with pytest.raises(halo.GridError, match="has 2 axes"):
        halo.ProcessGrid(MPI.COMM_SELF, (1, 1))


def test_mpi_transport_moves_any_dtype():
    t = halo.MPITransport(MPI.COMM_SELF)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        src = (torch.arange(24).reshape(4, 6) % 3).to(dtype)
        dst = torch.empty_like(src)
        t.start([(0, src)], [(0, dst)], tag=5).wait()
        assert torch.equal(src, dst)
    src = torch.zeros(0, 3)
    t.start([(0, src)], [(0, torch.zeros(0, 3))], tag=5).wait()  # empty messages are fine
    assert isinstance(t.start([], [], 1), CompletedRequest)


def test_mpi_transport_refuses_what_it_cannot_send():
    t = halo.MPITransport(MPI.COMM_SELF)
    with pytest.raises(halo.TransportError, match="not contiguous"):
        t.start([(0, torch.zeros(4, 4).t())], [], 1)
    with pytest.raises(halo.TransportError, match="is on meta; it moves host"):
        t.start([(0, torch.zeros(4, device="meta"))], [], 1)



def test_delayed_transport_holds_requests_back(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(delay_module, "time", clock)
    inner = halo.MPITransport(MPI.COMM_SELF)
    slow = halo.DelayedTransport(inner, 0.03)
    a, b = torch.ones(3), torch.zeros(3)
    req = slow.start([(0, a)], [(0, b)], 2)
    assert not req.test()  # whatever the message did, the delay has not passed
    clock.now += 0.01      # 10 ms of work
    assert not req.test()
    req.wait()             # sleeps the remaining 20 ms, no more
    assert clock.slept == [pytest.approx(0.02)] and torch.equal(a, b)
    # A caller that worked longer than the delay does not wait for it.
    c, d = torch.full((3,), 2.0), torch.zeros(3)
    req = slow.start([(0, c)], [(0, d)], 3)
    clock.now += 0.05
    while not req.test():  # only the real transfer is left
        pass
    req.wait()
    assert clock.slept == [pytest.approx(0.02)] and torch.equal(c, d)
    with pytest.raises(ValueError, match="seconds is -1"):
        halo.DelayedTransport(inner, -1)
    assert slow.delayed == 2
    # tags=: only those messages wait (the halo's, say, not a plan's blocking ones).
    picky = halo.DelayedTransport(inner, 0.03, tags=[7])
    e, f = torch.full((3,), 4.0), torch.zeros(3)
    picky.start([(0, e)], [(0, f)], 8).wait()
    assert len(clock.slept) == 1 and picky.delayed == 0 and torch.equal(e, f)
    picky.start([(0, e)], [(0, f)], 7).wait()
    assert clock.slept[1:] == [pytest.approx(0.03)] and picky.delayed == 1


def test_delayed_transport_on_a_device_holds_the_compute_stream_not_the_host():
    """With ``device``, start and wait return at once; the compute stream's work queued after the
    wait runs only once ``seconds`` have passed since start (on the device's timeline), and test()
    says so. Other tags are not held; requests in flight together pause side by side."""
    import time

    from halo.transport.streams import SimDevice

    dev = SimDevice()
    slow = halo.DelayedTransport(halo.MPITransport(MPI.COMM_SELF), 0.2, tags=[7], device=dev)
    a, b, seen = torch.ones(3), torch.zeros(3), []
    t0 = time.monotonic()
    first = slow.start([(0, a)], [(0, b)], 7)
    second = slow.start([(0, a)], [(0, torch.zeros(3))], 7)
    assert not first.test()
    first.wait()
    dev.compute.launch(lambda: seen.append(time.monotonic() - t0))
    second.wait()
    assert time.monotonic() - t0 < 0.15 and seen == [] and torch.equal(a, b)  # host went on
    dev.compute.record().synchronize()
    assert 0.2 <= seen[0] < 0.35  # the two pauses ran side by side, not one after the other
    assert first.test() and second.test() and slow.delayed == 2
    plain = slow.start([(0, a)], [(0, b)], 8)  # another tag: the inner request itself
    assert plain.test() and slow.delayed == 2


def test_delayed_transport_hands_progress_and_close_to_the_one_it_wraps():
    """A wrapped staged transport must still hand on its held-back sends, and be closed."""
    calls = []

    class Inner(halo.MPITransport):
        def progress(self):
            calls.append("progress")
            return True

        def close(self):
            calls.append("close")

    slow = halo.DelayedTransport(Inner(MPI.COMM_SELF), 0.01)
    assert slow.progress() is True
    slow.close()
    assert calls == ["progress", "close"]


def self_plan():
    """Rank 0 sends itself two blocks; local row 2 is in both (like a corner voxel)."""
    return HaloPlan(send_ranks=[0, 0], send_rows=[torch.tensor([1, 2]), torch.tensor([2, 4])],
                    recv_ranks=[0, 0], recv_counts=[2, 2],
                    halo_coords=torch.zeros(4, 4, dtype=torch.int32), num_local=5)


def test_exchange_and_adjoint_on_a_self_loop():
    ex = halo.HaloExchange(self_plan(), halo.MPITransport(MPI.COMM_SELF))
    x = torch.arange(10, dtype=torch.float64).reshape(5, 2)
    h = ex.start(x).wait()
    assert torch.equal(h, x[[1, 2, 2, 4]])
    g = torch.arange(8, dtype=torch.float64).reshape(4, 2) + 1
    back = ex.start_adjoint(g).wait()
    want = torch.zeros(5, 2, dtype=torch.float64)
    want[1] += g[0]
    want[2] += g[1] + g[2]
    want[4] += g[3]
    assert torch.equal(back, want)
    acc = torch.ones(5, 2, dtype=torch.float64)
    assert ex.start_adjoint(g, out=acc).wait() is acc and torch.equal(acc, want + 1)
    with pytest.raises(halo.ExchangeError, match="expected contiguous \\[5, 2\\]"):
        ex.start_adjoint(g, out=torch.zeros(4, 2, dtype=torch.float64))
    # <H x, y> == <x, H^T y>
    assert float((h * g).sum()) == pytest.approx(float((x * back).sum()))
    xr = x.clone().requires_grad_(True)
    (halo.halo_exchange(xr, ex) * g).sum().backward()
    assert torch.equal(xr.grad, want)


def test_exchange_with_nothing_to_send():
    plan = HaloPlan([], [], [], [], torch.zeros(0, 4, dtype=torch.int32), num_local=3)
    ex = halo.HaloExchange(plan, halo.MPITransport(MPI.COMM_SELF))
    p = ex.start(torch.ones(3, 2))
    assert p.test() and p.wait().shape == (0, 2)
    assert torch.equal(ex.start_adjoint(torch.zeros(0, 2)).wait(), torch.zeros(3, 2))


def test_build_plan_on_one_rank():
    grid = halo.ProcessGrid(MPI.COMM_SELF)
    cuts = halo.uniform_cuts((8, 8, 8), grid.dims)
    coords = torch.tensor([[0, 1, 2, 3], [0, 7, 7, 7]], dtype=torch.int32)
    plan = halo.build_plan(grid, cuts, coords, radius=1)
    assert plan.num_halo == 0 and plan.num_local == 2 and plan.send_ranks == []
    with pytest.raises(halo.PlanError, match="rows 0 and 1 are the same voxel"):
        halo.build_plan(grid, cuts, coords[[0, 0]], radius=1)
    with pytest.raises(halo.PlanError, match="expected \\[N, 4\\]"):
        halo.build_plan(grid, cuts, coords[:, 1:], radius=1)
    c, f = halo.distribute(grid, cuts, coords.flip(0), torch.tensor([[1.0], [2.0]]))
    assert torch.equal(c, coords) and f[:, 0].tolist() == [2.0, 1.0]
