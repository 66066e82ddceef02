"""GradientReducer under real mpirun: bucketed all-reduce started during backward gives
ParallelContext.allreduce_gradients's gradients - with parameters used twice, parameters some
ranks (or no rank) use, gradient accumulation over micro-batches, any bucket size - and the
trainer (plain step and pipelined STEP) takes the same steps with either path.

Bit for bit at 1 and 2 ranks (a sum of two is the same in either order). At 3-4 ranks Open MPI
picks its reduction algorithm, hence the order it adds the ranks' values, by message size, and a
bucket is a smaller message than the flat buffer: the two paths then agree to float rounding
(measured: a few ulp), and every rank still holds identical gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.gradients import GradientReducer, GradientReducerError
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.train.config import parse_config
from sparsepipe_hpc.train.loop import Trainer


class Net(torch.nn.Module):
    """a used twice; b used only on even ranks; never: used by no rank; frozen: used, but
    requires no gradient; c, d always."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 5)
        self.b = torch.nn.Linear(5, 5)
        self.never = torch.nn.Parameter(torch.randn(3))
        self.frozen = torch.nn.Linear(5, 5).requires_grad_(False)
        self.c = torch.nn.Linear(5, 7)
        self.d = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))  # a second dtype

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.a(torch.tanh(self.frozen(self.a(x)))))
        if rank % 2 == 0:
            h = h + self.b(h)
        return (self.c(h).double() * self.d).sum()


def same(comm, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise at <= 2 ranks; to float rounding beyond (see the module docstring)."""
    if comm.size <= 2:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=4 * torch.finfo(a.dtype).eps, atol=0)


def grads_after(comm, micro: int, reduce) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    rank = comm.rank
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, 5, generator=g) * (10.0 ** (rank - 1)) for _ in range(micro)]
    reduce(net, xs, rank)
    return [p.grad.clone() if p.grad is not None else None for p in net.parameters()]


@pytest.mark.parametrize("bucket_bytes", [1, 60, 200, 1 << 30])
@pytest.mark.parametrize("micro", [1, 3])
def test_bucketed_equals_flat_bit_for_bit(comm, bucket_bytes, micro):
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))

    def flat(net, xs, rank):
        for x in xs:
            net(x, rank).backward()
        ctx.allreduce_gradients(net)

    def bucketed(net, xs, rank):
        r = ctx.gradient_reducer(net, bucket_bytes)
        for k, x in enumerate(xs):
            if k == len(xs) - 1:
                r.arm()
            net(x, rank).backward()
        r.finish()
        r.close()

    want = grads_after(comm, micro, flat)
    got = grads_after(comm, micro, bucketed)
    names = [name for name, _ in Net().named_parameters()]
    for name, w, g in zip(names, want, got):
        # No rank's gradient (never), or none wanted (frozen): None, as in one process, so
        # that an optimizer leaves them alone (AdamW's weight decay too).
        none = name == "never" or name.startswith("frozen")
        assert (w is None) == (g is None) == none, name
        assert none or same(comm, w, g), (name, w, g)
    if comm.size > 1:  # the sum really happened: every rank holds the same gradients
        flat_g = torch.cat([g.double().reshape(-1) for g in got if g is not None])
        assert all(torch.equal(flat_g, o) for o in comm.allgather(flat_g))


def test_buckets_start_during_backward(comm):
    if comm.size == 1:
        pytest.skip("one rank: the reducer has nothing to do")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))
    torch.manual_seed(0)
    net = Net()
    started: list[int] = []
    net.never.requires_grad_(False)  # frozen: ready from arm(), does not hold its bucket back
    r = ctx.gradient_reducer(net, 1)
    net.a.weight.register_hook(lambda g: started.append(r._next))  # runs inside backward
    r.arm()
    net(torch.randn(4, 5), 0).backward()  # rank 0's graph on every rank: no unused bucket early
    assert started and started[0] > 0, "no bucket had started when a's gradient was computed"
    r.finish()
    r.close()


def test_two_backwards_while_armed_is_an_error(comm):
    if comm.size == 1:
        pytest.skip("one rank: the reducer has nothing to do")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))
    net = torch.nn.Linear(5, 3)  # every parameter used: the one bucket starts in backward
    r = ctx.gradient_reducer(net, 1 << 30)
    r.arm()
    net(torch.randn(4, 5)).sum().backward()
    with pytest.raises(GradientReducerError, match="after its bucket's all-reduce started"):
        net(torch.randn(4, 5)).sum().backward()
    with pytest.raises(GradientReducerError, match="arm.. called twice"):
        r.arm()
    r.finish()
    r.close()
    r.close()  # again: nothing
    # Inactive once closed, a finish would leave every gradient unsummed: refused instead.
    with pytest.raises(GradientReducerError, match="used after close"):
        r.finish()
    with pytest.raises(GradientReducerError, match="used after close"):
        r.arm()


def test_ranks_with_unlike_parameters_are_refused_on_every_rank(comm):
    """One rank's model differs (a larger first layer): the flat all-reduce would add unrelated
    numbers or truncate on some ranks, the buckets hang; both raise on every rank instead."""
    if comm.size == 1:
        pytest.skip("one rank: nothing is summed")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))
    a = torch.nn.Parameter(torch.ones(6 if comm.rank == comm.size - 1 else 4))
    b = torch.nn.Parameter(torch.ones(3))
    (a.sum() + b.sum()).backward()
    with pytest.raises(ValueError, match="allreduce_gradients: the ranks that sum these "
                                         "gradients pass different parameters"):
        ctx.allreduce_gradients([a, b])
    with pytest.raises(ValueError, match="GradientReducer: the ranks .* different parameters"):
        ctx.gradient_reducer([a, b])
    with pytest.raises(ValueError, match="different parameters"):  # the order matters too
        ctx.allreduce_gradients([b, a] if comm.rank == 0 else [a, b])
    ctx.allreduce_gradients([b])  # alike: fine
    ctx.close()


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer; got 0"):
        GradientReducer([], None, 0)


@pytest.fixture(scope="module")
def shared(shared_data) -> Path:
    return shared_data(scenes=dict(train=8, val=2, seed=1, objects=(2, 4), points=(1200, 2000)))


# Layouts with more than one rank per stage, so the gradient all-reduce has something to sum.
TRAIN_LAYOUTS = {1: [()], 2: [(), ("--micro-batches", "2")],
                 3: [("--grid", "3,1,1")],
                 4: [("--grid", "2,1,1"), ("--stages", "2", "--balance", "3,3",
                                           "--micro-batches", "2")]}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_trainer_bucketed_equals_flat(comm, shared, optimizer):
    for extra in TRAIN_LAYOUTS[comm.size]:
        states = []
        for mb in ("0", "0.0001"):  # flat; buckets of ~100 bytes (many buckets)
            out = shared / f"t-{optimizer}-{comm.size}-{'-'.join(extra)}-{mb}"
            cfg = parse_config(["--task", "seg", "--data", str(shared / "scenes"), "--out",
                                str(out), "--width", "4", "--depth", "2", "--steps", "2",
                                "--optimizer", optimizer, "--voxel-size", "0.25",
                                "--batch-size", "4", "--no-progress", "--eval-every", "0",
                                "--grad-bucket-mb", mb, *extra])
            t = Trainer(cfg, comm, log=None)
            assert (t.reducer is None) == (mb == "0")
            t.run()
            states.append({k: v.clone() for k, v in t.model.state_dict().items()})
        for k in states[0]:
            a, b = states[0][k], states[1][k]
            if a.is_floating_point() and comm.size > 2:  # rounding differences, then 2 steps
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (extra, k)
            else:
                assert torch.equal(a, b), (extra, k)


@pytest.mark.parametrize("bad_rank", [0, -1])
def test_fp16_skip_verdict_is_agreed_over_the_communicator(comm, bad_rank):
    """Each rank holds other parameters (as pipeline stages do); one rank's gradient is inf.
    Precision("fp16", cpu, comm) skips the step on every rank and halves every rank's scale;
    the next step, all finite, is taken everywhere, unscaled by the same scale."""
    from sparsepipe_hpc.train.device import Precision

    bad = bad_rank % comm.size
    w = torch.nn.Parameter(torch.full((3,), float(comm.rank)))
    opt = torch.optim.SGD([w], lr=1.0)
    prec = Precision("fp16", torch.device("cpu"), comm)
    scale = prec.scaler.get_scale()
    w.grad = torch.full((3,), scale)  # as if the scaled loss's gradient (1 each) came back
    if comm.rank == bad:
        w.grad[1] = float("inf")
    prec.step(opt)
    assert torch.equal(w.detach(), torch.full((3,), float(comm.rank)))  # skipped everywhere
    assert comm.allgather(prec.scaler.get_scale()) == [scale / 2] * comm.size
    w.grad = torch.full((3,), scale / 2)
    prec.step(opt)
    assert torch.equal(w.detach(), torch.full((3,), comm.rank - 1.0))  # unscaled: grad 1
