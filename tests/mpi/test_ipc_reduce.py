"""IPCReducer under real mpirun, on the CPU stand-in (SimDevice streams, SimIPCMemory buffers and
events in shared memory): the host never waits for the device; the sum waits for every rank's
producer and the consumer for the sum; all-reduces started in one order and waited for in another
still match; every rank holds the same bits; buffers are reused; gradient buckets started in
different orders do not hang (bad buffers and a ReduceGroup routing to it:
tests/mpi/test_collectives.py). On a
GPU the same reducer runs on CudaDevice and CUDA IPC (the last test)."""

from __future__ import annotations

import pytest
import torch

from helpers import reduce_input

from halo.transport.collectives import ReduceGroup, allreduce_
from halo.transport.ipc_reduce import IPCReducer
from halo.transport.streams import SimDevice


@pytest.fixture
def make(comm):
    """IPCReducer factory on the stand-in; each is closed (collective) once the test is done."""
    made: list[IPCReducer] = []

    def build(lag: int = 0) -> IPCReducer:
        made.append(IPCReducer(comm, SimDevice(lag=lag, autonomous=lag > 0)))
        return made[-1]

    yield build
    for red in made:
        red.close()


def expected(comm, make_t, op: str) -> torch.Tensor:
    """What ``op`` over every rank's ``make_t(rank)`` gives (computed locally, in float64)."""
    vals = torch.stack([make_t(r).double() for r in range(comm.size)])
    out = {"sum": vals.sum(0), "max": vals.amax(0), "min": vals.amin(0)}[op]
    return out.to(make_t(0).dtype)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce_in_stream_order_without_the_host_waiting(comm, make, op):
    red = make()
    dev = red.device
    make_t = lambda r: torch.arange(6.0).reshape(2, 3) * (r + 1) - r  # noqa: E731
    t = torch.zeros(2, 3)
    dev.compute.hold()  # the producer of t is still queued on every rank
    dev.compute.launch(lambda: t.copy_(make_t(comm.rank)))
    req = red.iallreduce_(t, op)
    req.wait()  # returns: the host does not wait for the device
    seen: list[torch.Tensor] = []
    dev.compute.launch(lambda: seen.append(t.clone()))  # the consumer, after wait()
    assert not seen
    dev.compute.release()
    dev.compute.record().synchronize()  # and the peers' producers, through their events
    assert torch.equal(seen[0], expected(comm, make_t, op))
    assert torch.equal(t, expected(comm, make_t, op))


@pytest.mark.parametrize("lag", [0, 3])
def test_out_of_order_waits_match_and_every_rank_holds_the_same_bits(comm, make, lag):
    """Ten all-reduces of different sizes and dtypes, waited for in reverse on even ranks and in
    order on odd ones: each gets its own result; random float32 sums agree bit for bit on every
    rank and with MPI's to rounding; steady state registers no new buffer."""
    red = make(lag)
    dtypes = [torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16,
              torch.bool]

    def make_t(k: int, r: int) -> torch.Tensor:
        return reduce_input(k, r, dtypes)

    ts = [make_t(k, comm.rank) for k in range(8)]
    ops = ["sum", "max", "min", "sum"] * 2
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank))
    reqs = [red.iallreduce_(t, op) for t, op in zip(ts, ops)] + [red.iallreduce_(noise)]
    for req in (reversed(reqs) if comm.rank % 2 == 0 else reqs):
        req.wait()
    red.device.compute.record().synchronize()
    for k, (t, op) in enumerate(zip(ts, ops)):
        want = expected(comm, lambda r: make_t(k, r), op)
        assert torch.equal(t, want), (k, op, t, want)
    everyone = comm.allgather(noise.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), "ranks hold different sums"
    mpi = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank))
    allreduce_(mpi, comm)
    torch.testing.assert_close(noise, mpi, rtol=1e-6, atol=1e-6)
    made = red.transport.registered
    for _ in range(3):
        red.iallreduce_(ts[0]).wait()
        red.device.compute.record().synchronize()
    assert red.transport.registered == made


def test_buckets_started_in_different_orders_around_blocking_all_reduces(comm, make):
    """Gradient buckets through an IPCReducer, with a BatchNorm-like blocking all-reduce (on
    another IPCReducer) in backward, and one bucket that rank 0 starts in backward and the other
    ranks only in ``finish`` (they did not use its parameters): no start waits for a peer's,
    so nothing hangs, and the sums are MPI's."""
    import copy

    from sparsepipe_hpc.parallel.gradients import GradientReducer

    stats = ReduceGroup(comm, make())

    class Stats(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            n = torch.ones(1)
            allreduce_(n, stats)  # blocking, as BatchNorm's statistics
            assert n.item() == comm.size
            return g

    torch.manual_seed(0)
    head, tail = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def step(head, tail):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(comm.rank))
        y = Stats.apply(head(x))
        out = tail(y) if comm.rank == 0 else y * 1.0  # the others leave `tail` unused
        out.sum().backward()

    ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
    step(ref_head, ref_tail)
    want = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for p in [*ref_head.parameters(), *ref_tail.parameters()]]
    for w in want:
        allreduce_(w, comm)
    r = GradientReducer([*head.parameters(), *tail.parameters()], comm, 1,
                        reducer=lambda c: IPCReducer(c, SimDevice()))
    r.arm()
    step(head, tail)
    r.finish()
    r.close()
    for p, w in zip([*head.parameters(), *tail.parameters()], want):
        torch.testing.assert_close(p.grad, w)


def test_on_cuda_sums_agree_and_the_host_never_waits(comm):
    """On a GPU (CudaDevice, CUDA IPC; the ranks may share one): several dtypes and ops equal
    MPI's, the float32 sums bit for bit on every rank. Rank 0 makes its tensors behind a long
    kernel: every host goes on, and every rank's sum waits for rank 0's through its events."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        pytest.skip("no CUDA device or no CuPy: CUDA IPC runs on GPU machines only")
    from halo.transport.streams import CudaDevice

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    red = IPCReducer(comm, CudaDevice())
    g = torch.Generator().manual_seed(comm.rank)
    host = [torch.randn(4096, generator=g), (torch.arange(100) * (comm.rank + 1)),
            torch.randn(333, generator=g).half()]
    ops = ["sum", "max", "sum"]
    made = [h.cuda() for h in host]
    ts = [torch.zeros_like(m) for m in made]
    torch.cuda.synchronize()
    if comm.rank == 0:
        torch.cuda._sleep(1 << 31)  # about a second of device time before the tensors are made
    for t, m in zip(ts, made):
        t.copy_(m)  # on the device: the host goes on
    reqs = [red.iallreduce_(t, op) for t, op in zip(ts, ops)]
    for req in reversed(reqs):
        req.wait()
    if comm.size > 1:
        assert not torch.cuda.current_stream().query(), "an all-reduce waited for the device"
    for h, t, op in zip(host, ts, ops):
        want = h.double() if h.is_floating_point() else h.clone()
        allreduce_(want, comm, op)
        torch.testing.assert_close(t.cpu(), want.to(h.dtype), rtol=1e-3, atol=1e-3)
    everyone = comm.allgather(ts[0].cpu().numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), "ranks hold different sums"
    torch.cuda.synchronize()
    red.close()
