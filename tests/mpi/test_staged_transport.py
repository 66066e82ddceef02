"""StagedTransport's stream ordering under real mpirun, on the CPU stand-in device (SimDevice):
a ring exchange delivers each rank's data; the D2H copy waits for the compute stream's producer;
the compute stream's consumer waits for the H2D copy; staging buffers are not reused while a copy
that uses them is pending; requests complete in any order without mismatching messages.

The same StagedTransport on CudaDevice (real GPU streams) is not run here (no GPU)."""

from __future__ import annotations

import pytest
import torch

from halo.transport.mpi import MPITransport
from halo.transport.staged import StagedTransport
from halo.transport.streams import SimDevice


def ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def test_ring_exchange_in_stream_order(comm):
    dev = SimDevice()
    tr = StagedTransport(MPITransport(comm), dev)
    right, left = ring(comm)
    send = torch.zeros(4, 3)
    recv = torch.full((4, 3), -1.0)
    dev.compute.hold()  # the producer of `send` is still queued on the compute stream
    dev.compute.launch(lambda: send.fill_(float(comm.rank)))
    req = tr.start([(right, send)], [(left, recv)], tag=3)
    assert not req.test()  # its send cannot go before the D2H copy, which waits for compute
    dev.compute.release()
    seen: list[torch.Tensor] = []
    tr.comm_stream.hold()  # a slow comm stream: the H2D copy is enqueued but does not run
    req.wait()
    dev.compute.launch(lambda: seen.append(recv.clone()))  # the consumer, after wait()
    assert not seen and recv.eq(-1).all(), "the consumer ran before the H2D copy"
    assert tr.pool.pending >= 1  # the receive buffer is held until its copy has run
    tr.comm_stream.release()
    assert seen and seen[0].eq(float(left)).all()
    assert recv.eq(float(left)).all()


def test_many_requests_any_completion_order_and_buffer_reuse(comm):
    dev = SimDevice()
    tr = StagedTransport(MPITransport(comm), dev)
    right, left = ring(comm)
    dtypes = [torch.float32, torch.float64, torch.int64, torch.bfloat16]
    sends = [torch.arange(k + 1, dtype=torch.float64).to(dtypes[k % 4]) + 100 * comm.rank
             for k in range(8)]
    recvs = [torch.empty_like(s) for s in sends]
    reqs = [tr.start([(right, s)], [(left, r)], tag=5) for s, r in zip(sends, recvs)]
    for req in reversed(reqs):  # the last started is waited for first: sends still go in order
        req.wait()
    for k, r in enumerate(recvs):
        want = torch.arange(k + 1, dtype=torch.float64).to(dtypes[k % 4]) + 100 * left
        assert torch.equal(r, want), k
    made = tr.pool.allocated
    for _ in range(3):  # every copy has run: steady state allocates nothing new
        tr.start([(right, sends[0])], [(left, recvs[0])], tag=5).wait()
    assert tr.pool.allocated == made


def test_receive_waits_for_earlier_readers_on_the_compute_stream(comm):
    """The H2D copy overwrites the receive tensor, so it runs after the compute stream's earlier
    work, which may still read the old contents - in a receive-only request too."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    dev = SimDevice()
    tr = StagedTransport(MPITransport(comm), dev)
    if comm.rank == 0:
        tr.start([(1, torch.full((5,), 7.0))], [], tag=4).wait()
    elif comm.rank == 1:
        recv = torch.full((5,), -1.0)
        seen: list[torch.Tensor] = []
        dev.compute.hold()
        dev.compute.launch(lambda: seen.append(recv.clone()))  # an earlier reader of recv
        tr.start([], [(0, recv)], tag=4).wait()  # MPI is done; the H2D copy must still wait
        assert recv.eq(-1).all(), "the H2D copy overwrote a tensor an earlier kernel reads"
        dev.compute.release()
        assert seen[0].eq(-1).all() and recv.eq(7).all()


def test_nothing_to_do(comm):
    tr = StagedTransport(MPITransport(comm), SimDevice())
    assert tr.start([], [], tag=1).test()


def test_a_send_started_after_the_awaited_receive_still_goes_out(comm):
    """The pattern of a 1F1B stage with warm-up 2 (stage 0 of 3 stages): send act 0, post the
    receive of grad 0, send act 1, then wait for grad 0. Its peer needs act 1 before it sends
    grad 0. On a GPU act 1's D2H copy is still running when its send starts, so the send is
    held back; the waiting rank must still post it once the copy is done (SimDevice(lag):
    copies finish later, as on a GPU) instead of blocking in MPI with it unsent: a deadlock."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    if comm.rank > 1:
        return
    dev = SimDevice(lag=5)
    tr = StagedTransport(MPITransport(comm), dev)
    if comm.rank == 0:
        act0, act1, grad0 = torch.full((3,), 1.0), torch.full((3,), 2.0), torch.zeros(3)
        sends = [tr.start([(1, act0)], [], tag=1)]
        recv = tr.start([], [(1, grad0)], tag=2)
        sends.append(tr.start([(1, act1)], [], tag=1))
        recv.wait()
        dev.compute.record().synchronize()  # the host reads what the compute stream waited for
        assert grad0.eq(3.0).all()
        for r in sends:
            r.wait()
    else:
        got0, got1 = torch.zeros(3), torch.zeros(3)
        tr.start([], [(0, got0)], tag=1).wait()
        tr.start([], [(0, got1)], tag=1).wait()
        dev.compute.record().synchronize()
        assert got0.eq(1.0).all() and got1.eq(2.0).all()
        tr.start([(0, got0 + got1)], [], tag=2).wait()
