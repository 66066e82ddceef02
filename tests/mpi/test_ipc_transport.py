"""IPCTransport's protocol under real mpirun, on the CPU stand-in: SimDevice streams and POSIX
shared memory for the registered buffers and events (SimIPCMemory), so ranks write into each
other's buffers and wait for each other's events as CUDA IPC does. Neither ``start`` nor ``wait``
waits for the device; the copy into a peer's buffer waits for the compute stream's producer; the
receiver's copy out waits for the sender's event, and its consumer for the copy out; a rank
blocked in MPI does not hold up what its device sends; buffers are reused, not leaked. On a GPU
the same transport runs on CudaDevice and CUDA IPC (the last test here,
tests/test_transport_gpu.py, tests/mpi/test_spatial_gpu.py)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from halo.transport.base import TransportError
from halo.transport.ipc import MAX_PENDING, IPCTransport
from halo.transport.ipc_memory import SimIPCMemory
from halo.transport.streams import SimDevice


@pytest.fixture
def make(comm):
    """IPCTransport factory on the stand-in; every transport is closed once all ranks are done
    with it (a peer may write into our buffers until its last request completes)."""
    made: list[IPCTransport] = []

    def build(lag: int = 0, autonomous: Optional[bool] = None) -> IPCTransport:
        """A lagging device runs on its own, as a GPU does, unless told not to."""
        own = lag > 0 if autonomous is None else autonomous
        made.append(IPCTransport(comm, SimDevice(lag=lag, autonomous=own), SimIPCMemory()))
        return made[-1]

    yield build
    for tr in made:
        tr.close()  # collective
    assert not leftover_files(), "shared-memory files left behind"


def leftover_files() -> list[str]:
    """This process's SimIPCMemory files still in /dev/shm."""
    import glob
    import os

    from halo.transport.ipc_memory import PREFIX

    return glob.glob(f"/dev/shm/{PREFIX}{os.getpid()}-*")


def ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def test_neither_start_nor_wait_waits_for_the_device(comm, make):
    """Every rank's producer is still queued (its compute stream held) through start and wait:
    the host goes on, and the consumer runs only once the producers on both sides have run."""
    tr = make()
    dev = tr.device
    right, left = ring(comm)
    send = torch.zeros(4, 3)
    recv = torch.full((4, 3), -1.0)
    dev.compute.hold()
    dev.compute.launch(lambda: send.fill_(float(comm.rank)))  # the producer
    req = tr.start([(right, send)], [(left, recv)], tag=3)  # would block forever if it waited
    req.wait()  # so would this
    seen: list[torch.Tensor] = []
    dev.compute.launch(lambda: seen.append(recv.clone()))  # the consumer
    assert not seen and recv.eq(-1).all()
    dev.compute.release()
    dev.compute.record().synchronize()  # also waits for the peer's copy into our buffer
    assert seen and seen[0].eq(float(left)).all()


def test_copy_out_runs_after_earlier_readers_and_before_later_ones(comm, make):
    """The copy out overwrites the receive tensor: it runs after the compute stream's earlier
    work, which may still read the old contents, and work enqueued after ``wait`` reads the new."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make()
    if comm.rank == 0:
        tr.start([(1, torch.full((5,), 7.0))], [], tag=4).wait()
    elif comm.rank == 1:
        recv = torch.full((5,), -1.0)
        seen: list[torch.Tensor] = []
        compute = tr.device.compute
        compute.hold()
        compute.launch(lambda: seen.append(recv.clone()))  # an earlier reader
        tr.start([], [(0, recv)], tag=4).wait()
        compute.launch(lambda: seen.append(recv.clone()))  # a consumer
        assert recv.eq(-1).all(), "the copy out overwrote a tensor an earlier kernel reads"
        compute.release()
        assert len(seen) == 2 and seen[0].eq(-1).all(), "the earlier reader saw the new data"
        assert seen[1].eq(7.0).all(), "the consumer ran before the copy out"


@pytest.mark.parametrize("lag", [0, 3])
def test_many_requests_any_completion_order_and_buffer_reuse(comm, make, lag):
    tr = make(lag)
    right, left = ring(comm)
    dtypes = [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool]
    sends = [(torch.arange(k + 1, dtype=torch.float64) + 100 * comm.rank).to(dtypes[k % 5])
             for k in range(10)]
    recvs = [torch.empty_like(s) for s in sends]
    reqs = [tr.start([(right, s)], [(left, r)], tag=5) for s, r in zip(sends, recvs)]
    for req in reversed(reqs):  # the last started is waited for first: "done"s still in order
        req.wait()
    tr.device.compute.record().synchronize()
    for k, r in enumerate(recvs):
        want = (torch.arange(k + 1, dtype=torch.float64) + 100 * left).to(dtypes[k % 5])
        assert torch.equal(r, want), k
    made = tr.registered
    for _ in range(3):  # every copy out has run: steady state registers nothing new
        tr.start([(right, sends[0])], [(left, recvs[0])], tag=5).wait()
        tr.device.compute.record().synchronize()
    assert tr.registered == made


def test_a_buffer_is_not_offered_again_before_its_copy_out_ran(comm, make):
    """A receiver whose copy out of a buffer is still queued must offer a new one for the next
    exchange: the sender would overwrite data not yet copied out."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make()
    if comm.rank == 0:
        for v in (1.0, 2.0):
            tr.start([(1, torch.full((8,), v))], [], tag=7).wait()
    elif comm.rank == 1:
        first, second = torch.zeros(8), torch.zeros(8)
        req = tr.start([], [(0, first)], tag=7)
        tr.stream.hold()  # the copy out of the first buffer is enqueued, not run
        req.wait()
        assert tr.registered == 1
        req = tr.start([], [(0, second)], tag=7)
        assert tr.registered == 2, "the first buffer was offered again before its copy out ran"
        tr.stream.release()
        req.wait()
        tr.device.compute.record().synchronize()
        assert first.eq(1.0).all() and second.eq(2.0).all()


def test_a_rank_blocked_in_mpi_does_not_hold_up_what_it_sent(comm, make):
    """Rank 0 sends on tag 1, then waits for what rank 1 sends on tag 2 - which rank 1 sends only
    after its data of tag 1 has landed. Rank 0's copy still lags when its host blocks in MPI; its
    device (running on its own, as a GPU does) carries it out, and rank 1's copy out waits for
    it through rank 0's event, not for a message rank 0's host would have to send."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make(lag=4)
    if comm.rank == 0:
        first = tr.start([(1, torch.full((3,), 1.0))], [], tag=1)
        got = torch.zeros(3)
        tr.start([], [(1, got)], tag=2).wait()
        first.wait()
        tr.device.compute.record().synchronize()
        assert got.eq(2.0).all()
    elif comm.rank == 1:
        got = torch.zeros(3)
        tr.start([], [(0, got)], tag=1).wait()
        tr.device.compute.record().synchronize()
        assert got.eq(1.0).all()
        tr.start([(0, got * 2)], [], tag=2).wait()
        tr.device.compute.record().synchronize()  # the copy ran: got * 2 may go


def test_a_host_runs_at_most_max_pending_buffers_ahead_of_its_device(comm, make):
    """A receiver whose copies out have not run (a slow device, the host running ahead) offers
    new buffers for up to MAX_PENDING of them per peer, then waits for the oldest copy
    out instead of registering more."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    if comm.rank == 0:
        tr = make()
        for v in range(3 * MAX_PENDING):
            tr.start([(1, torch.full((8,), float(v)))], [], tag=8).wait()
    elif comm.rank == 1:
        tr = make(lag=1000, autonomous=False)  # runs only when the host makes it
        got = [torch.zeros(8) for _ in range(3 * MAX_PENDING)]
        for g in got:
            tr.start([], [(0, g)], tag=8).wait()
        assert tr.registered == MAX_PENDING
        tr.device.compute.record().synchronize()
        assert all(g.eq(float(v)).all() for v, g in enumerate(got))
    else:
        make()


def test_buffers_serve_every_tag_of_a_peer(comm, make):
    """A pipeline's micro-batches each have a tag: once a copy out has run, the next tag's
    receive reuses its buffer instead of registering one per tag (kept until close)."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tags = range(100, 106)
    if comm.rank == 0:
        tr = make()
        for tag in tags:
            tr.start([(1, torch.full((8,), float(tag)))], [], tag=tag).wait()
    elif comm.rank == 1:
        tr = make()
        for tag in tags:
            got = torch.zeros(8)
            tr.start([], [(0, got)], tag=tag).wait()
            tr.device.compute.record().synchronize()
            assert got.eq(float(tag)).all()
        assert tr.registered == 1
    else:
        make()


def test_a_size_mismatch_is_an_error_not_garbage(comm, make):
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make()
    if comm.rank == 0:
        tr.start([(1, torch.zeros(2))], [], tag=9).wait()
    elif comm.rank == 1:
        with pytest.raises(TransportError, match="a peer sent 8 bytes where the receive tensor "
                                                 "has 16; start exchanges in the same order"):
            tr.start([], [(0, torch.zeros(4))], tag=9).wait()


def test_a_send_larger_than_the_receive_raises_on_both_ranks_and_later_ones_keep_order(comm,
                                                                                      make):
    """A send too large for the buffer its receiver offered is refused on the sender and
    reported to the receiver (its wait raises rather than hangs); the next message of the same
    tag still lands in the next receive."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make()
    if comm.rank == 0:
        with pytest.raises(TransportError, match="rank 1 offered 256 bytes for a send of 2000"):
            tr.start([(1, torch.zeros(500))], [], tag=11).wait()
        tr.start([(1, torch.full((4,), 7.0))], [], tag=11).wait()
    elif comm.rank == 1:
        first, second = torch.zeros(4), torch.zeros(4)
        r1 = tr.start([], [(0, first)], tag=11)
        r2 = tr.start([], [(0, second)], tag=11)
        with pytest.raises(TransportError, match="a peer sent 2000 bytes where the receive "
                                                 "tensor has 16"):
            r1.wait()
        r2.wait()
        tr.device.compute.record().synchronize()
        assert second.eq(7.0).all()


def test_closing_with_a_send_not_carried_out_is_an_error_on_every_rank(comm, make):
    """A send still waiting for its peer's start would be lost (and the peer hang): close
    refuses on every rank (so none waits for the others in its barrier), frees nothing, and the
    exchange completes once the peer starts it."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    tr = make()
    if comm.rank == 0:
        req = tr.start([(1, torch.ones(3))], [], tag=10)
    with pytest.raises(TransportError, match=r"close with send\(s\) still waiting for their "
                                             r"peer's start or failed \(rank 0: 1\)"):
        tr.close()
    if comm.rank == 0:
        req.wait()
    elif comm.rank == 1:
        got = torch.zeros(3)
        tr.start([], [(0, got)], tag=10).wait()
        tr.device.compute.record().synchronize()
        assert got.eq(1.0).all()


def test_tensors_on_another_device_type_are_refused(comm, make):
    tr = make()
    tr.device.type = "cuda"  # the stand-in posing as a GPU: CPU tensors are then wrong
    with pytest.raises(TransportError, match="must be a contiguous cuda tensor; got a tensor "
                                             "on cpu"):
        tr.start([(0, torch.zeros(2))], [], tag=0)


def test_on_cuda_ring_of_many_requests_and_buffer_reuse(comm):
    """The same protocol on a GPU (CudaDevice, CUDA IPC through CuPy, interprocess events; the
    ranks may share one GPU): requests waited in reverse, several dtypes, no new buffers in
    steady state. Rank 0 makes its sends behind a long kernel: every host goes on (no wait
    waits for a device), and its receiver gets the data only through rank 0's events."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        pytest.skip("no CUDA device or no CuPy: CUDA IPC runs on GPU machines only")
    from halo.transport.streams import CudaDevice

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    tr = IPCTransport(comm, CudaDevice())
    right, left = ring(comm)
    dtypes = [torch.float32, torch.float16, torch.int64, torch.bool]

    def values(k: int, rank: int) -> torch.Tensor:
        return (torch.arange(1000 * k + 1, dtype=torch.float64, device="cuda")
                + 100 * rank).to(dtypes[k % 4])

    sends = [torch.zeros_like(values(k, 0)) for k in range(8)]
    recvs = [torch.empty_like(s) for s in sends]
    torch.cuda.synchronize()
    if comm.rank == 0:
        torch.cuda._sleep(1 << 31)  # about a second of device time before the sends are made
    for k, s in enumerate(sends):
        s.copy_(values(k, comm.rank))
    reqs = [tr.start([(right, s)], [(left, r)], tag=6) for s, r in zip(sends, recvs)]
    for req in reversed(reqs):
        req.wait()
    if comm.size > 1 and comm.rank in (0, 1):  # rank 0 and its receiver
        assert not torch.cuda.current_stream().query(), "a start or wait waited for the device"
    for k, r in enumerate(recvs):
        assert torch.equal(r, values(k, left)), k  # read after the compute stream's wait
    made = tr.registered
    for _ in range(3):
        tr.start([(right, sends[1])], [(left, recvs[1])], tag=6).wait()
    torch.cuda.synchronize()
    assert tr.registered == made
    tr.close()  # collective
