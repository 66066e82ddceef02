"""The stream/event stand-in and the staging pool (halo.transport.streams), without MPI or a GPU:
work runs in stream order, waits hold later work back, buffers are reused only after their event."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from halo.transport.select import choose_transport, make_transport
from halo.transport.base import TransportError
from halo.transport.streams import SimDevice, StagingPool, StreamError


def test_copy_reads_its_source_when_it_runs_not_when_enqueued():
    dev = SimDevice()
    comm = dev.new_stream("comm")
    src, dst = torch.zeros(3), torch.full((3,), -1.0)
    dev.compute.hold()  # a busy GPU: the producer has not run yet
    dev.compute.launch(lambda: src.fill_(7.0))
    comm.wait_event(dev.compute.record())
    comm.copy_(dst, src)
    assert dst.tolist() == [-1.0] * 3  # the copy waits for the producer's event
    dev.compute.release()
    assert dst.tolist() == [7.0] * 3


def test_a_lagging_device_finishes_work_some_ticks_later_in_order():
    """SimDevice(lag=k): work runs k ticks (host enqueues or queries) after it was enqueued,
    still in stream order and after its waits; synchronize ticks until it is done."""
    dev = SimDevice(lag=3)
    comm = dev.new_stream("comm")
    src, dst = torch.zeros(3), torch.full((3,), -1.0)
    dev.compute.launch(lambda: src.fill_(7.0))
    comm.wait_event(dev.compute.record())
    comm.copy_(dst, src)
    done = comm.record()
    assert dst.tolist() == [-1.0] * 3 and not done.query()  # enqueued, not run yet
    done.synchronize()
    assert done.query() and dst.tolist() == [7.0] * 3
    dev.compute.hold()
    dev.compute.launch(lambda: src.fill_(1.0))
    with pytest.raises(StreamError, match="held"):  # lag or not, a held stream never gets there
        dev.compute.record().synchronize()


def test_without_the_wait_the_copy_races_ahead():
    """The failure the transports' wait_event prevents: shows the stand-in can catch it."""
    dev = SimDevice()
    comm = dev.new_stream("comm")
    src, dst = torch.zeros(3), torch.full((3,), -1.0)
    dev.compute.hold()
    dev.compute.launch(lambda: src.fill_(7.0))
    comm.copy_(dst, src)  # no wait_event: runs at once, reads the stale source
    dev.compute.release()
    assert dst.tolist() == [0.0] * 3


def test_a_pause_holds_its_stream_back_and_nothing_else():
    """stream.delay(s): later work on that stream runs s after the stream got there; the host
    and the other streams go on meanwhile, and synchronize waits the pause out."""
    import time

    dev = SimDevice()
    slow, other = dev.new_stream("slow"), dev.new_stream("other")
    x, y = torch.zeros(1), torch.zeros(1)
    t0 = time.monotonic()
    slow.delay(0.2)
    slow.launch(lambda: x.fill_(1.0))
    done = slow.record()
    other.launch(lambda: y.fill_(2.0))
    dev.compute.wait_event(done)
    dev.compute.launch(lambda: y.fill_(3.0))
    assert time.monotonic() - t0 < 0.15  # enqueueing did not block the host
    assert y.item() == 2.0 and x.item() == 0.0 and not done.query()  # "other" ran, "slow" waits
    done.synchronize()
    assert time.monotonic() - t0 >= 0.2 and x.item() == 1.0
    dev.compute.record().synchronize()
    assert y.item() == 3.0  # the compute stream's work after its wait ran after the pause


def test_an_autonomous_device_runs_its_work_while_the_host_is_away():
    """SimDevice(autonomous=True) ticks from a thread of its own, as a GPU runs without its
    host: lagged work completes with no enqueue or query from the host."""
    import time

    dev = SimDevice(lag=3, autonomous=True)
    x = torch.zeros(2)
    dev.compute.launch(lambda: x.fill_(5.0))
    deadline = time.monotonic() + 10
    while x[0] != 5.0 and time.monotonic() < deadline:
        time.sleep(0.001)  # the host does nothing with the device
    assert x.tolist() == [5.0, 5.0]


def test_a_peer_event_waits_for_its_latest_record_before_the_wait(tmp_path):
    """SimIPCMemory's events between two stand-in devices (two processes on a GPU): a wait holds
    a stream back until the peer's stream has run the record issued last before the wait; a
    record issued after the wait does not hold it back."""
    from halo.transport.ipc_memory import SimIPCMemory

    mine, theirs = SimIPCMemory(str(tmp_path)), SimIPCMemory(str(tmp_path))
    sender, receiver = SimDevice(), SimDevice()
    event, handle = mine.event()
    sender.compute.hold()  # the sender's work before the record has not run
    mine.record(event, sender.compute)
    theirs.wait(receiver.compute, handle)
    ran: list[int] = []
    receiver.compute.launch(lambda: ran.append(1))
    receiver.pump()
    assert not ran, "ran before the peer's recorded work"
    sender.compute.release()
    receiver.compute.record().synchronize()
    assert ran == [1]
    theirs.wait(receiver.compute, handle)  # waits for record 1, which has run
    sender.compute.hold()
    mine.record(event, sender.compute)  # record 2, after the wait: not waited for
    receiver.compute.launch(lambda: ran.append(2))
    assert ran == [1, 2]
    theirs.close_opened()
    mine.free_own()
    assert not list(tmp_path.iterdir())


def test_sim_ipc_files_go_with_their_owner_though_never_freed(tmp_path):
    """A transport that never reached its collective close (an exception on the way) leaves no
    files behind once its memory object is gone, or at the latest when the process exits."""
    import gc

    from halo.transport.ipc_memory import SimIPCMemory

    memory = SimIPCMemory(str(tmp_path))
    memory.alloc(64)
    memory.event()
    assert len(list(tmp_path.iterdir())) == 2
    del memory
    gc.collect()
    assert not list(tmp_path.iterdir())


def test_event_query_and_synchronize_on_a_held_stream():
    dev = SimDevice()
    dev.compute.hold()
    ev = dev.compute.record()
    assert not ev.query()
    with pytest.raises(StreamError, match="held"):
        ev.synchronize()
    dev.compute.release()
    assert ev.query()
    ev.synchronize()


def test_pool_reuses_a_buffer_only_after_its_event():
    dev = SimDevice()
    comm = dev.new_stream("comm")
    pool = StagingPool(dev)
    a = pool.acquire(100)
    assert a.numel() >= 100 and pool.allocated == 1
    comm.hold()
    pool.release(a, comm.record())
    b = pool.acquire(100)  # a's copy has not run: a fresh buffer
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    comm.release()
    c = pool.acquire(50)  # now a (or b's size class) is free again: no new allocation
    assert c.data_ptr() == a.data_ptr() and pool.allocated == 2


def test_choose_transport():
    assert choose_transport("auto", "cpu") == "mpi"
    assert choose_transport("mpi", "cpu") == "mpi"
    assert choose_transport("auto", "cuda", nccl=True) == "nccl"
    assert choose_transport("auto", "cuda", nccl=True, shared_gpu=True) == "ipc"
    assert choose_transport("auto", "cuda") == "staged"
    assert choose_transport("nccl", None) == "nccl"  # device not known yet
    for name in ("nccl", "ipc", "staged"):
        with pytest.raises(TransportError, match=f"--transport {name} moves CUDA device tensors"):
            choose_transport(name, "cpu")
    with pytest.raises(TransportError, match="Duplicate GPU"):
        choose_transport("nccl", "cuda", nccl=True, shared_gpu=True)
    with pytest.raises(TransportError, match="must be one of auto, nccl, ipc, staged, mpi"):
        choose_transport("gloo", "cpu")


def test_make_transport_builds_the_resolved_name():
    from mpi4py import MPI

    from halo.transport.mpi import MPITransport
    from halo.transport.staged import StagedTransport

    comm = MPI.COMM_SELF
    assert isinstance(make_transport("mpi", comm), MPITransport)
    dev = SimDevice()
    staged = make_transport("staged", comm, dev)
    assert isinstance(staged, StagedTransport) and staged.device is dev
    send, recv = torch.arange(6.0), torch.zeros(6)
    staged.start([(0, send)], [(0, recv)], tag=1).wait()  # to itself, through host staging
    assert torch.equal(recv, send)
    with pytest.raises(TransportError, match=r"the staged transport moves device tensors .* "
                                             r"pass device="):
        make_transport("staged", comm)
    with pytest.raises(TransportError, match=r"'auto' is not a transport; .* choose_transport"):
        make_transport("auto", comm, dev)


def test_make_reducer_builds_the_resolved_name():
    from mpi4py import MPI

    from halo.transport.ipc_reduce import IPCReducer
    from halo.transport.select import make_reducer
    from halo.transport.staged_reduce import StagedReducer

    comm = MPI.COMM_SELF
    dev = SimDevice()
    assert make_reducer("mpi", comm, dev) is None
    assert isinstance(make_reducer("staged", comm, dev), StagedReducer)
    ipc = make_reducer("ipc", comm, dev)
    assert isinstance(ipc, IPCReducer) and ipc.device is dev
    t = torch.arange(4.0)
    ipc.iallreduce_(t).wait()  # one rank: nothing to add
    assert torch.equal(t, torch.arange(4.0))
    ipc.close()
    with pytest.raises(TransportError, match=r"the ipc transport reduces device tensors .* "
                                             r"pass device="):
        make_reducer("ipc", comm)


def test_staged_reducer_all_reduces_on_a_communicator_of_its_own():
    """Its MPI all-reduces start whenever their copies have run: on the caller's communicator a
    blocking collective of the caller's (GradientReducer's check for gradients anywhere) could
    come before one on one rank and after it on another, and MPI would match the two."""
    from mpi4py import MPI

    from halo.transport.staged_reduce import StagedReducer

    red = StagedReducer(MPI.COMM_SELF, SimDevice())
    assert MPI.Comm.Compare(red.comm, MPI.COMM_SELF) == MPI.CONGRUENT  # a duplicate
    t = torch.arange(3.0)
    red.iallreduce_(t).wait()
    red.close()
    red.close()  # again: nothing
    with pytest.raises(TransportError, match="used after close"):
        red.iallreduce_(t)


def test_ipc_reduces_through_the_host_across_nodes(monkeypatch):
    """A group spanning nodes (data-parallel replicas) cannot reach its peers by CUDA IPC: with
    --transport ipc it reduces host-staged."""
    from mpi4py import MPI

    from halo.transport import select
    from halo.transport.staged_reduce import StagedReducer

    assert select.one_node(MPI.COMM_SELF)
    monkeypatch.setattr(select, "one_node", lambda comm: False)
    assert isinstance(select.make_reducer("ipc", MPI.COMM_SELF, SimDevice()), StagedReducer)


def test_ipc_transport_is_refused_across_nodes(monkeypatch):
    """A group spanning nodes cannot exchange halos by CUDA IPC: a TransportError naming the
    remedy, before any buffer is registered."""
    from mpi4py import MPI

    from halo.transport import select

    monkeypatch.setattr(select, "one_node", lambda comm: False)
    with pytest.raises(TransportError, match="the ipc transport connects the ranks of one node, "
                                             "but this group of 1 ranks spans nodes; pass "
                                             "--transport staged"):
        select.make_transport("ipc", MPI.COMM_SELF, SimDevice())


def test_trainer_stage_payloads_go_by_ipc_on_one_node_else_host_staged(monkeypatch):
    """--transport ipc: the pipeline's stage payloads through CUDA IPC where the job is on one
    node, host-staged where it spans nodes; every other device transport stages them."""
    from mpi4py import MPI

    from halo.transport import select, streams
    from halo.transport.ipc import IPCTransport
    from halo.transport.staged import StagedTransport
    from sparsepipe_hpc.train import transport

    monkeypatch.setattr(streams, "CudaDevice", lambda device: SimDevice())
    cuda = torch.device("cuda", 0)
    made = transport.device_comm("ipc", cuda).stages(MPI.COMM_SELF)
    assert isinstance(made, IPCTransport)
    made.close()
    assert isinstance(transport.device_comm("staged", cuda).stages(MPI.COMM_SELF),
                      StagedTransport)
    monkeypatch.setattr(transport, "one_node", lambda comm: False)
    monkeypatch.setattr(select, "one_node", lambda comm: False)
    assert isinstance(transport.device_comm("ipc", cuda).stages(MPI.COMM_SELF), StagedTransport)


def test_importing_the_packages_does_not_import_cupy():
    code = ("import sys, sparsepipe_hpc, halo, halo.transport, halo.transport.streams, "
            "halo.transport.staged, halo.transport.collectives, sparsepipe_hpc.train.loop, "
            "sparsepipe_hpc.parallel.gradients; "
            "import halo.transport.nccl, halo.transport.ipc, halo.transport.ipc_reduce, "
            "halo.transport.ipc_memory; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cupy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("available", [False, True])
def test_nccl_available_reads_cupys_flag_not_the_import(monkeypatch, available):
    """CuPy built without NCCL still imports cupy.cuda.nccl (with available = False and no
    functions): that import alone must not count as NCCL, or --transport nccl fails later with an
    AttributeError instead of the ConfigError naming the remedy."""
    import types

    from halo.transport.nccl import NCCLTransport, nccl_available

    cupy, cuda, nccl = (types.ModuleType(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.nccl"))
    nccl.available = available  # type: ignore[attr-defined]
    cupy.cuda, cuda.nccl = cuda, nccl  # type: ignore[attr-defined]
    for m in (cupy, cuda, nccl):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    assert nccl_available() is available
    if not available:
        with pytest.raises(TransportError, match=r"needs CuPy with NCCL .* has none"):
            NCCLTransport(object(), SimDevice())
        with pytest.raises(TransportError, match="--transport nccl needs CuPy with NCCL"):
            choose_transport("nccl", "cuda", nccl=nccl_available())


def test_every_transport_says_its_kind():
    """A transport names itself as --transport does: the trainer's start line says by which
    one the pipeline's stage transfers move where it is not the halos' (nccl)."""
    from halo.transport.delay import DelayedTransport
    from halo.transport.ipc import IPCTransport
    from halo.transport.mpi import MPITransport
    from halo.transport.nccl import NCCLTransport
    from halo.transport.staged import StagedTransport

    kinds = {cls.kind for cls in (MPITransport, StagedTransport, IPCTransport, NCCLTransport)}
    assert kinds == {"mpi", "staged", "ipc", "nccl"}
    from mpi4py import MPI
    assert DelayedTransport(MPITransport(MPI.COMM_SELF), 0.0).kind == "mpi"
