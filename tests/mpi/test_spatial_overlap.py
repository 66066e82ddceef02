"""Overlap: the local convolution progresses the halo exchange, and turning overlap off does not
change a single number. (How much time overlap hides is a benchmark figure, not a test.)"""

from __future__ import annotations

import pytest
import torch

from halo.exchange import EXCHANGE_TAG
from halo.transport.base import Request, Transport
from halo.transport.delay import DelayedTransport
from halo.transport.mpi import MPITransport
from halo.transport.streams import SimDevice
from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout

from test_spatial import make_cloud


class SpyRequest(Request):
    def __init__(self, inner: Request, log: dict):
        self.inner, self.log = inner, log
        self.waited = False

    def test(self) -> bool:
        done = self.inner.test()
        if not self.waited:
            self.log["tests_before_wait"] += 1
            self.log["done_before_wait"] += int(done)
        return done

    def wait(self) -> None:
        self.waited = True
        self.inner.wait()


class SpyTransport(Transport):
    def __init__(self, inner: Transport):
        self.inner = inner
        self.log = {"starts": 0, "tests_before_wait": 0, "done_before_wait": 0}

    def start(self, sends, recvs, tag):
        req = self.inner.start(sends, recvs, tag)
        if tag not in (EXCHANGE_TAG, EXCHANGE_TAG + 1):  # a plan build: blocking by design
            return req
        self.log["starts"] += 1
        return SpyRequest(req, self.log)


def run(comm, overlap: bool, transport_factory):
    grid = (comm.size, 1, 1)
    ctx = ParallelContext(comm, RankLayout(1, 1, grid), overlap=overlap,
                          transport=lambda grid_comm: transport_factory(MPITransport(grid_comm)))
    transport = ctx.group.transport
    torch.manual_seed(0)
    net = SparseUNet(3, 4, width=4, depth=2, engine="torch").double()
    x, = ctx.distribute(make_cloud(2, "random"), align=4)
    f = x.feats.clone().requires_grad_()
    y = net(x.replace(feats=f))
    (y.feats ** 2).sum().backward()
    return y.feats.detach(), f.grad, [p.grad for p in net.parameters()], transport


def test_local_work_progresses_the_exchange(comm):
    if comm.size < 2:
        pytest.skip("needs neighbours")
    _, _, _, spy = run(comm, True, SpyTransport)
    assert spy.log["starts"] > 0
    # Request.test() (MPI_Testall) is called between kernel offsets while messages travel.
    assert spy.log["tests_before_wait"] >= spy.log["starts"]
    _, _, _, spy_off = run(comm, False, SpyTransport)
    assert spy_off.log["tests_before_wait"] == 0


def test_overlap_on_off_and_delay_give_identical_results(comm):
    if comm.size < 2:
        pytest.skip("needs neighbours")
    a = run(comm, True, lambda t: t)
    b = run(comm, False, lambda t: t)
    c = run(comm, True, lambda t: DelayedTransport(t, 0.002))
    d = run(comm, True, lambda t: DelayedTransport(t, 0.002, device=SimDevice()))  # a pause
    for other in (b, c, d):
        assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])
        assert all(torch.equal(p, q) for p, q in zip(a[2], other[2]))


def test_a_profile_names_the_parts_of_each_distributed_convolution(comm):
    """Under torch's profiler, the local part, the halo part, the exchange's start, its progress
    calls and its wait are labelled ranges, in forward and in backward (where the profile has no
    Python frames to put a kernel or a blocking call down to); outside a profile they dispatch
    nothing."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    if comm.size < 2:
        pytest.skip("needs neighbours")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(comm, True, lambda t: t)
    found = set()
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):
            p, backward = e.cpu_parent, False
            while p is not None:
                backward, p = backward or "Backward" in p.name, p.cpu_parent
            found.add((e.name, backward))
    parts = ("dist_conv local part", "dist_conv halo part", "dist_conv halo start", "halo wait",
             "dist_conv halo progress")
    assert {(n, b) for n in parts for b in (False, True)} <= found, sorted(found)
    ops: list[str] = []  # a dispatch mode sees every op, record_function's included

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Ops():
        run(comm, True, lambda t: t)
    assert not any("record_function" in o for o in ops)


def test_the_overlap_benchmark_says_a_device_pause_is_read_by_step_time(comm):
    """``bench gpu-comm``'s overlap section over a transport whose delay runs on the device (here
    the CPU stand-in's): it says so, and leaves out the fraction of the host's exposed wait, which
    a pause on the device never shows in."""
    from sparsepipe_hpc.bench._gpu_comm_steps import overlap_section
    from sparsepipe_hpc.bench.common import synthetic_room

    if comm.size < 2:
        pytest.skip("needs neighbours")
    x = synthetic_room(voxel_size=0.2, points=5000)

    def unet():
        torch.manual_seed(0)
        return SparseUNet(x.num_channels, 4, width=2, depth=2)

    dev = SimDevice()
    ov = overlap_section(comm, x, unet, torch.device("cpu"),
                         lambda d: lambda c: DelayedTransport(MPITransport(c), d, device=dev),
                         [0.001], repeats=1, align=4)
    assert ov["delay_on"] == "device"
    assert ov["variants"]["overlap_delay1ms"]["halo_exchanges_per_step"] > 0
    assert [d["hidden_fraction_of_wait"] for d in ov["delays"]] == [None]
