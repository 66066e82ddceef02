"""Pipelined training steps equal the single-process run (float64), under real mpirun.

Every rank builds the same model and the same global batch, runs the single-process oracle on it,
then runs its own part of the pipeline (its stage's blocks, its replica's samples, its box under
a spatial grid) through the executor and compares loss, parameter gradients (after the stage's
all-reduce) and BatchNorm running statistics.

BatchNorm in training mode normalizes each micro-batch by its own statistics (GPipe's semantics),
so the training-mode oracle runs the serial model on one process's micro-batches (the contiguous
parts of the global batch; every replica's micro-batch i is its shard of part i, as
``ShardedBatches(micro_batches=m)`` deals them to the trainer) and accumulates; the eval-mode
test compares with the plain unpipelined full-batch step (micro-batching is then invisible).
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from sparsepipe_hpc.data.sharding import local_micro_bounds, replica_micro_bounds
from sparsepipe_hpc.nn import (BatchNorm, SparseResNet, SparseUNet, commit_batchnorm,
                               set_deferred_batchnorm)
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import LayoutError, RankLayout
from sparsepipe_hpc.pipeline.carry import PipelineError, plan_carry
from sparsepipe_hpc.pipeline.executor import sample_bounds, split_batch
from sparsepipe_hpc.pipeline.runner import Pipeline
from sparsepipe_hpc.sparse import SparseTensor
from sparsepipe_hpc.train.transport import DeviceComm

SHAPE = (16, 16, 16)
GLOBAL_BATCH = 4
CLASSES = 4
TOL = dict(rtol=1e-9, atol=1e-11)
# (stages, grid) per world size; replicas fill the rest.
LAYOUTS = {1: [(1, (1, 1, 1))], 2: [(2, (1, 1, 1))], 3: [(3, (1, 1, 1))],
           4: [(2, (1, 1, 1)), (2, (2, 1, 1)), (4, (1, 1, 1))]}
# Balances: U-Net depth 2 = stem down1 down2 up2 up1 head; ResNet depth 2 = stem down1 down2 head.
BALANCE = {"unet": {1: [6], 2: [2, 4], 3: [2, 2, 2], 4: [1, 1, 2, 2]},
           "resnet": {1: [4], 2: [2, 2], 3: [1, 2, 1], 4: [1, 1, 1, 1]}}


def layouts(comm):
    return LAYOUTS.get(comm.size, [])


def make_batch(seed: int):
    """A global batch of GLOBAL_BATCH random clouds, per-voxel and per-sample labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(GLOBAL_BATCH):
        n = 120 + 40 * b
        xyz = (torch.rand(n, 3, generator=g) * torch.tensor(SHAPE)).long()
        rows.append(torch.cat([torch.full((n, 1), b), xyz], 1))
    coords = torch.unique(torch.cat(rows), dim=0).int()
    feats = torch.randn(len(coords), 3, generator=g, dtype=torch.float64)
    voxel_labels = torch.randint(0, CLASSES, (len(coords),), generator=g)
    sample_labels = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    return SparseTensor(coords, feats, SHAPE, GLOBAL_BATCH), voxel_labels, sample_labels


def select(x: SparseTensor, vlab, slab, samples):
    """The given samples of a batch, renumbered 0.. in the order given."""
    cs, fs, ls = [], [], []
    for new, b in enumerate(samples):
        rows = x.coords[:, 0] == b
        c = x.coords[rows].clone()
        c[:, 0] = new
        cs.append(c)
        fs.append(x.feats[rows])
        ls.append(vlab[rows])
    return (SparseTensor(torch.cat(cs), torch.cat(fs), x.spatial_shape, len(samples)),
            torch.cat(ls), slab[list(samples)])


def build(name: str):
    torch.manual_seed(3)
    cls = SparseUNet if name == "unet" else SparseResNet
    return cls(3, CLASSES, width=4, depth=2).double()


def micro_samples(replicas: int, m: int) -> list[list[list[int]]]:
    """[replica][micro-batch] -> global sample indices, as the trainer deals them; together, the
    replicas' micro-batch i is one process's micro-batch i."""
    out = [[list(range(lo, hi)) for lo, hi in rs]
           for rs in replica_micro_bounds(GLOBAL_BATCH, replicas, m)]
    assert [sorted(sum((out[r][i] for r in range(replicas)), [])) for i in range(m)] == \
        [list(range(lo, hi)) for lo, hi in sample_bounds(GLOBAL_BATCH, m)]
    return out


def loss_of(task_out, vlab, slab, name, total_voxels, spatial_size=1):
    if name == "unet":
        return F.cross_entropy(task_out.feats, vlab, reduction="sum") / total_voxels
    return F.cross_entropy(task_out, slab, reduction="sum") / (GLOBAL_BATCH * spatial_size)


def oracle(model, batch, name, groups):
    """Serial forward+backward over ``groups`` (lists of samples), accumulated; returns loss."""
    x, vlab, slab = batch
    total = 0.0
    for samples in groups:
        xi, vi, si = select(x, vlab, slab, samples)
        share = loss_of(model(xi), vi, si, name, len(x.coords))
        if torch.is_grad_enabled():
            share.backward()
        total += float(share.detach())
    return total


@pytest.fixture
def pipelined(request):
    """The pipelined step; an exception aborts the job at once (traceback on the terminal),
    since the ranks of the other stages would otherwise wait for this rank's messages until the
    test's timeout."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def run(*args):
        try:
            return _pipelined(*args)
        except BaseException:
            with capman.global_and_fixture_disabled():
                print(f"[rank {MPI.COMM_WORLD.rank}] {traceback.format_exc()}", file=sys.stderr,
                      flush=True)
            MPI.COMM_WORLD.Abort(1)

    return run


def _pipelined(comm, model, batch, name, stages, grid, kind, m, backward=True, deferred_bn=None,
               device_comm=None, balance=None):
    """This rank's part of the pipelined step; returns (position, carry plan, global loss).
    ``device_comm``: the trainer's DeviceComm (halo, reducer and stage-payload makers);
    ``balance``: blocks per stage (default BALANCE's)."""
    layout = RankLayout.from_world(comm.size, grid=grid, stages=stages)
    dc = device_comm or DeviceComm()
    ctx = ParallelContext(comm, layout, transport=dc.halo, reducer=dc.reducer)
    pos = ctx.position
    x, vlab, slab = batch
    pipe = Pipeline(model, ctx, balance=",".join(map(str, balance or BALANCE[name][stages])),
                    schedule=kind, micro_batches=m, deferred_bn=deferred_bn,
                    transport=dc.stages)
    xr, vr, sr = select(x, vlab, slab, sum(micro_samples(layout.replicas, m)[pos.replica], []))
    local = local_micro_bounds(GLOBAL_BATCH, layout.replicas, pos.replica, m)
    inputs, contexts, labels = [], [], []
    for (xi, vi), (lo, hi) in zip(split_batch(xr, m, vr, bounds=local), local):
        xl, vl = ctx.distribute(xi, vi, align=model.total_stride)
        inputs.append(xl)
        contexts.append(xl.context)
        labels.append((vl, sr[lo:hi]))

    def loss_fn(i, out):
        return loss_of(out, *labels[i], name, len(x.coords), layout.spatial_size)

    params = list(pipe.parameters())
    shares = pipe.run(inputs, contexts, loss_fn, step=lambda: ctx.allreduce_gradients(params),
                      backward=backward)
    assert len(shares) == (m if pipe.is_last else 0)
    loss = comm.allreduce(float(sum(shares)) if shares else 0.0)
    pipe.close()  # collective: the stage link's transport and communicator,
    with pytest.raises(RuntimeError, match="Pipeline.run after close"):  # before any block ran
        pipe.run(inputs, contexts, loss_fn)
    ctx.close()   # then the context's (IPC buffers and shared-memory files among them)
    return pos, pipe.plan, loss


def compare(model, ref, plan_stage, pos):
    a, b = plan_stage.blocks
    mine = {f"blocks.{a + k}.{n}" for k in range(b - a)
            for n, _ in model.blocks[a + k].named_parameters()}
    ref_params = dict(ref.named_parameters())
    assert mine
    for n, p in model.named_parameters():
        if n in mine:
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, ref_params[n].grad, **TOL, msg=n)
        else:
            assert p.grad is None, f"{n} belongs to another stage but got a gradient"
    ref_bufs = dict(ref.named_buffers())
    for n, t in model.named_buffers():
        if any(n.startswith(f"blocks.{a + k}.") for k in range(b - a)):
            torch.testing.assert_close(t, ref_bufs[n], **TOL, msg=n)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_pipeline_equals_micro_batched_serial(comm, pipelined, name, kind):
    """Training-mode BatchNorm: gradients, loss and running stats equal the serial run over
    the same micro-batches, for every layout that fits this world size."""
    if not layouts(comm):
        pytest.skip(f"no pipeline layout for {comm.size} ranks")
    batch = make_batch(11)
    for stages, grid in layouts(comm):
        replicas = comm.size // (stages * grid[0] * grid[1] * grid[2])
        m = min(3, GLOBAL_BATCH // replicas)
        ref = build(name)
        model = copy.deepcopy(ref)
        groups = [sum((micro_samples(replicas, m)[r][i] for r in range(replicas)), [])
                  for i in range(m)]
        ref_loss = oracle(ref, batch, name, groups)
        pos, plan, loss = pipelined(comm, model, batch, name, stages, grid, kind, m)
        assert loss == pytest.approx(ref_loss, rel=1e-10), (stages, grid)
        compare(model, ref, plan.stages[pos.stage], pos)


class StandIn:
    """The trainer's device path on the CPU stand-in device: halos and stage payloads through
    StagedTransport, reductions through StagedReducer, or all of them through CUDA IPC's
    transport and reducer with buffers and events in shared memory (``ipc``; one SimDevice),
    every one kept."""

    def __init__(self, name: str = "staged") -> None:
        from halo.transport.streams import SimDevice

        self.name, self.dev, self.transports, self.reducers = name, SimDevice(), [], []

    def transport(self, comm):
        from halo.transport.mpi import MPITransport
        from halo.transport.staged import StagedTransport

        self.transports.append(CountingIPC(comm, self.dev) if self.name == "ipc" else
                               StagedTransport(MPITransport(comm), self.dev))
        return self.transports[-1]

    def reducer(self, comm):
        from halo.transport.ipc_reduce import IPCReducer
        from halo.transport.staged_reduce import StagedReducer

        self.reducers.append(IPCReducer(comm, self.dev) if self.name == "ipc" else
                             StagedReducer(comm, self.dev))
        return self.reducers[-1]

    def used(self, transport) -> bool:
        """Whether ``transport`` moved anything on this rank."""
        return transport.started > 0 if self.name == "ipc" else transport.pool.allocated > 0

    def device_comm(self) -> DeviceComm:
        return DeviceComm(halo=self.transport, reducer=self.reducer, stages=self.transport)


def CountingIPC(comm, device):
    """An IPCTransport that counts the transfers started through it (``started``)."""
    from halo.transport.ipc import IPCTransport

    class Counting(IPCTransport):
        started = 0

        def start(self, sends, recvs, tag):
            self.started += bool(sends or recvs)
            return super().start(sends, recvs, tag)

    return Counting(comm, device)


def random_layouts(size: int) -> list[tuple[int, tuple[int, int, int], int]]:
    """Every (stages, grid, replicas) with ``size`` ranks whose replicas divide the batch."""
    out = []
    for stages in (s for s in range(1, size + 1) if size % s == 0):
        rest = size // stages
        for grid in itertools.product(range(1, rest + 1), repeat=3):
            if rest % math.prod(grid) == 0 and GLOBAL_BATCH % (rest // math.prod(grid)) == 0:
                out.append((stages, grid, rest // math.prod(grid)))
    return out


@pytest.mark.parametrize("case", range(12))
def test_random_pipelines_equal_micro_batched_serial(comm, pipelined, case):
    """Drawn layouts (stages x grid x replicas of this world), balances (any contiguous split of
    the blocks), micro-batch counts and schedules, on drawn batches: loss, gradients and running
    statistics equal the serial run over the same micro-batches."""
    rng = np.random.default_rng(100 * comm.size + case)
    name = str(rng.choice(["unet", "resnet"]))
    blocks = 6 if name == "unet" else 4
    fits = [lay for lay in random_layouts(comm.size) if lay[0] <= blocks]
    if not fits:
        pytest.skip(f"no layout of {comm.size} ranks has at most {blocks} stages")
    stages = int(rng.choice(sorted({lay[0] for lay in fits})))  # stages first, then the rest
    fits = [lay for lay in fits if lay[0] == stages]
    stages, grid, replicas = fits[int(rng.integers(len(fits)))]
    cuts = sorted(int(c) for c in rng.choice(np.arange(1, blocks), stages - 1, replace=False))
    balance = np.diff([0, *cuts, blocks]).tolist()
    m = int(rng.integers(1, GLOBAL_BATCH // replicas + 1))
    kind = str(rng.choice(["gpipe", "1f1b"]))
    batch = make_batch(int(rng.integers(1 << 30)))
    ref = build(name)
    model = copy.deepcopy(ref)
    groups = [sum((micro_samples(replicas, m)[r][i] for r in range(replicas)), [])
              for i in range(m)]
    ref_loss = oracle(ref, batch, name, groups)
    pos, plan, loss = pipelined(comm, model, batch, name, stages, grid, kind, m, True, None, None,
                                balance)
    where = f"{name}, {stages} stages {balance}, grid {grid}, {replicas} replicas, m={m}, {kind}"
    assert loss == pytest.approx(ref_loss, rel=1e-10), where
    compare(model, ref, plan.stages[pos.stage], pos)


@pytest.mark.parametrize("transport", ["staged", "ipc"])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipeline_on_the_device_path_equals_micro_batched_serial(comm, pipelined, kind,
                                                                  transport):
    """Stage payloads (headers through host MPI), halos and every reduction through the device
    paths the trainer takes on a GPU (host-staged copies, or CUDA IPC, ordered by stream events,
    here on the stand-in device): the micro-batched serial run's loss, gradients and running
    statistics."""
    if not layouts(comm):
        pytest.skip(f"no pipeline layout for {comm.size} ranks")
    batch = make_batch(11)
    for stages, grid in layouts(comm):
        replicas = comm.size // (stages * grid[0] * grid[1] * grid[2])
        m = min(3, GLOBAL_BATCH // replicas)
        ref = build("unet")
        model = copy.deepcopy(ref)
        groups = [sum((micro_samples(replicas, m)[r][i] for r in range(replicas)), [])
                  for i in range(m)]
        ref_loss = oracle(ref, batch, "unet", groups)
        stand_in = StandIn(transport)
        pos, plan, loss = pipelined(comm, model, batch, "unet", stages, grid, kind, m, True,
                                    None, stand_in.device_comm())
        assert loss == pytest.approx(ref_loss, rel=1e-10), (stages, grid)
        compare(model, ref, plan.stages[pos.stage], pos)
        if stages > 1:  # the stage link's transport is the last one made
            assert stand_in.used(stand_in.transports[-1]), "no stage payload went through it"


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipeline_eval_bn_equals_full_batch(comm, pipelined, kind):
    """With BatchNorm in eval mode micro-batching is invisible: the pipelined step equals the
    plain full-batch serial step (U-Net, skips crossing stages where the layout has 3+)."""
    if not layouts(comm):
        pytest.skip(f"no pipeline layout for {comm.size} ranks")
    batch = make_batch(12)
    for stages, grid in layouts(comm):
        replicas = comm.size // (stages * grid[0] * grid[1] * grid[2])
        ref = build("unet").eval()
        model = copy.deepcopy(ref)
        ref_loss = oracle(ref, batch, "unet", [list(range(GLOBAL_BATCH))])
        pos, plan, loss = pipelined(comm, model, batch, "unet", stages, grid, kind,
                                    GLOBAL_BATCH // replicas)
        assert loss == pytest.approx(ref_loss, rel=1e-10)
        compare(model, ref, plan.stages[pos.stage], pos)


def bns(model):
    return (m for m in model.modules() if isinstance(m, BatchNorm))


FIRST_BN = "blocks.0.net.1."  # the stem's BatchNorm: its input does not depend on any other BN


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_deferred_bn_running_stats(comm, pipelined, name, kind):
    """Deferred BatchNorm: loss and gradients are those of the per-micro-batch mode (the serial
    run over the same micro-batches); every BatchNorm's running statistics take one update over
    all the voxels it saw in the mini-batch (the serial deferred run's), so the first one equals
    the unpipelined full-batch step's. The default mode updates per micro-batch and does not."""
    if not layouts(comm):
        pytest.skip(f"no pipeline layout for {comm.size} ranks")
    batch = make_batch(14)
    full = build(name)
    oracle(full, batch, name, [list(range(GLOBAL_BATCH))])
    full_bufs = dict(full.named_buffers())
    for stages, grid in layouts(comm):
        replicas = comm.size // (stages * grid[0] * grid[1] * grid[2])
        m = GLOBAL_BATCH // replicas
        groups = [sum((micro_samples(replicas, m)[r][i] for r in range(replicas)), [])
                  for i in range(m)]
        for deferred in (True, False):
            ref = build(name)
            set_deferred_batchnorm(ref, deferred)
            ref_loss = oracle(ref, batch, name, groups)
            assert commit_batchnorm(ref) == (len(list(bns(ref))) if deferred else 0)
            model = build(name)
            pos, plan, loss = pipelined(comm, model, batch, name, stages, grid, kind, m, True,
                                        deferred)
            assert loss == pytest.approx(ref_loss, rel=1e-10), (stages, grid, deferred)
            compare(model, ref, plan.stages[pos.stage], pos)
            first = {n: t for n, t in model.named_buffers() if n.startswith(FIRST_BN)}
            assert len(first) == 3
            if pos.stage == 0:
                if deferred or m == 1:
                    for n, t in first.items():
                        torch.testing.assert_close(t, full_bufs[n], **TOL, msg=n)
                else:
                    assert not torch.allclose(first[FIRST_BN + "running_var"],
                                              full_bufs[FIRST_BN + "running_var"])
                    assert int(first[FIRST_BN + "num_batches_tracked"]) == m


@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_forward_only_pipeline_equals_serial_eval(comm, pipelined, name):
    """Evaluation: forward actions only, no gradients anywhere, the serial eval loss."""
    if not layouts(comm):
        pytest.skip(f"no pipeline layout for {comm.size} ranks")
    batch = make_batch(13)
    for stages, grid in layouts(comm):
        replicas = comm.size // (stages * grid[0] * grid[1] * grid[2])
        ref = build(name).eval()
        model = copy.deepcopy(ref)
        with torch.no_grad():
            ref_loss = oracle(ref, batch, name, [list(range(GLOBAL_BATCH))])
        _, _, loss = pipelined(comm, model, batch, name, stages, grid, "1f1b",
                               min(3, GLOBAL_BATCH // replicas), False)
        assert loss == pytest.approx(ref_loss, rel=1e-10)
        assert all(p.grad is None for p in model.parameters())


def test_bad_balance_fails_on_every_rank(comm):
    model = build("unet")
    arities = [b.carry_arity for b in model.blocks]
    with pytest.raises(PipelineError) as err:
        plan_carry(arities, [2, 3])
    msg = str(err.value)
    assert "sums to 5 but the model has 6 blocks" in msg
    assert len(set(comm.allgather(msg))) == 1


def test_balance_not_matching_stages_fails_on_every_rank(comm):
    model = build("unet")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))  # one stage, n replicas
    with pytest.raises(PipelineError) as err:
        Pipeline(model, ctx, balance="3,3", schedule="gpipe", micro_batches=2)
    msg = str(err.value)
    assert "--balance 3,3 names 2 stage(s) but --stages is 1" in msg
    assert len(set(comm.allgather(msg))) == 1


def test_more_micro_batches_than_message_tags_fail_at_construction_on_every_rank(comm):
    """Stage 0 would raise only when it sent micro-batch 10901, the others at once."""
    model = build("unet")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size))
    with pytest.raises(PipelineError, match="micro-batch 10901 needs tag 32769, above MPI's "
                                            "guaranteed upper bound 32767; use at most 10901"):
        Pipeline(model, ctx, schedule="gpipe", micro_batches=10902)
    ctx.close()


def test_a_rank_with_another_balance_stops_every_rank(comm):
    """A balance that fails on one rank only hung the others in the communicator's Dup; one
    that differs made ranks own other blocks (a block no stage ran): every rank raises."""
    if comm.size < 2 or comm.size % 2:
        pytest.skip("two stages")
    model = build("unet")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size, stages=2))
    with pytest.raises(PipelineError, match=r"sums to 7 but the model has 6 blocks.* \(rank 1\)"):
        Pipeline(model, ctx, balance="4,3" if comm.rank == 1 else "3,3", schedule="gpipe")
    with pytest.raises(PipelineError, match=r"same balance, schedule, micro-batches and model; "
                                            r"got rank 0 and others like it: \(\(3, 3\)"):
        Pipeline(model, ctx, balance="4,2" if comm.rank == 1 else "3,3", schedule="gpipe")
    ctx.close()


def test_run_without_a_loss_fn_or_with_too_few_inputs_fails_on_every_rank(comm):
    """Checked only on the stage that needed them (the last for loss_fn, stage 0 for the
    inputs): that stage raised while the other waited for its messages. Stages that do not
    read them may still pass None (``loss_fn if pipe.is_last else None``)."""
    if comm.size < 2 or comm.size % 2:
        pytest.skip("two stages")
    model = build("unet")
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size, stages=2))
    pipe = Pipeline(model, ctx, schedule="gpipe", micro_batches=2)
    with pytest.raises(PipelineError, match="the last stage \\(1\\) needs a loss_fn"):
        pipe.run([None, None], [None, None], None)
    with pytest.raises(PipelineError, match="2 micro-batches but run\\(\\) got 1 inputs and 2 "
                                            "contexts on stage 0"):
        pipe.run([None], [None, None], lambda i, o: o)
    assert comm.allreduce(1) == comm.size  # every rank got here, nobody hangs
    pipe.close()
    ctx.close()


def test_stages_not_dividing_ranks_fail_on_every_rank(comm):
    stages = 2 if comm.size % 2 else 3
    with pytest.raises(LayoutError) as err:
        RankLayout.from_world(comm.size, stages=stages)
    assert f"does not divide the {comm.size} ranks" in str(err.value)
    assert comm.allreduce(1) == comm.size  # every rank got here, nobody hangs


def test_stage_link_round_trip(comm):
    """A carry (sparse with a strided kernel map, an empty box, a dense tensor) crosses from
    rank 0 to rank 1 with its sizes, the map is rebuilt equal, and gradients come back."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    from halo.transport.mpi import MPITransport
    from sparsepipe_hpc.nn import SparseConv3d
    from sparsepipe_hpc.pipeline.p2p import StageLink

    def carry():
        x, _, _ = make_batch(5)
        x.feats.requires_grad_(True)
        SparseConv3d(3, 2, 2, 2, indice_key="down1").double()(x)  # fills x.kmaps["down1"]
        empty = SparseTensor(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 5), SHAPE, 1, 2)
        return [x, empty, torch.arange(6.0).reshape(2, 3)]

    link = StageLink(MPITransport(comm.Dup()))
    mine = carry()
    if comm.rank == 0:
        sends = link.send_carry(1, 7, mine)
        pending = link.post_grads(1, 7, mine)
        grads = link.finish_grads(pending)
        for r in sends:
            r.wait()
        torch.testing.assert_close(grads[0], 2 * mine[0].feats.detach(), rtol=0, atol=0)
        assert grads[1] is None and grads[2] is None
    elif comm.rank == 1:
        got = link.finish_carry(link.post_carry(0, 7))
        x, empty, dense = got
        assert torch.equal(x.coords, mine[0].coords) and torch.equal(x.feats, mine[0].feats)
        assert (x.spatial_shape, x.batch_size, x.stride) == (SHAPE, GLOBAL_BATCH, 1)
        assert x.feats.requires_grad and not empty.feats.requires_grad
        assert empty.num_voxels == 0 and empty.num_channels == 5 and empty.stride == 2
        assert torch.equal(dense, mine[2])
        assert x.kmaps is empty.kmaps and set(x.kmaps) == {"down1"}
        want, rebuilt = mine[0].kmaps["down1"], x.kmaps["down1"]
        assert rebuilt.in_coords is x.coords
        assert torch.equal(rebuilt.out_coords, want.out_coords)
        for f in ("in_rows", "out_rows", "ptr"):
            assert torch.equal(getattr(rebuilt.kmap, f), getattr(want.kmap, f)), f
        for r in link.send_grads(0, 7, [2 * x.feats.detach(), None, None]):
            r.wait()


def test_a_rank_waiting_for_a_header_hands_on_its_held_back_payloads(comm):
    """Rank 1 sends gradients, then waits for a carry header; rank 0 sends that carry only once
    it has the gradients. With payloads host-staged on a device whose copies lag (as a GPU's),
    the gradients' send is still held back when rank 1 starts waiting: it must hand it on
    while waiting (StageLink.finish_carry -> Transport.progress), else both wait forever."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    from halo.transport.mpi import MPITransport
    from halo.transport.staged import StagedTransport
    from halo.transport.streams import SimDevice
    from sparsepipe_hpc.pipeline.p2p import StageLink

    pair = comm.Split(int(comm.rank > 1), comm.rank)  # collective: before any rank returns
    if comm.rank > 1:
        return
    dev = SimDevice(lag=5)
    link = StageLink(StagedTransport(MPITransport(pair.Dup()), dev), MPITransport(pair.Dup()))
    dense = torch.arange(6.0).reshape(2, 3).requires_grad_()
    if comm.rank == 0:
        grads = link.finish_grads(link.post_grads(1, 0, [dense]))
        sends = link.send_carry(1, 1, [dense.detach()])
        for r in sends:
            r.wait()
        dev.compute.record().synchronize()  # the host reads what the compute stream waited for
        assert torch.equal(grads[0], torch.full((2, 3), 5.0))
    else:
        sends = link.send_grads(0, 0, [torch.full((2, 3), 5.0)])
        got = link.finish_carry(link.post_carry(0, 1))
        for r in sends:
            r.wait()
        dev.compute.record().synchronize()
        assert torch.equal(got[0], dense.detach())


def slot_bytes(model, x):
    """(activation, gradient) payload bytes of every carry slot of the serial model on ``x``
    (slot ids as plan_carry numbers them: the input is 0, then every push in block order); a
    gradient message carries the features' gradient only."""
    def nbytes(e):
        return (e.coords.numel() * 4 + e.feats.numel() * 8, e.feats.numel() * 8)

    carry, ids, out = [x], [0], {0: nbytes(x)}
    with torch.no_grad():
        for blk in model.blocks:
            pops, pushes = blk.carry_arity
            carry = blk(carry)
            del ids[len(ids) - pops:]
            for e in carry[len(carry) - pushes:]:
                ids.append(len(out))
                out[ids[-1]] = nbytes(e)
    return out


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_skip_is_sent_once_and_its_bytes_counted_once(comm, kind):
    """A U-Net skip crossing two or more stage boundaries (the stem's output, used by the last
    decoder level) goes once per micro-batch from the stage that makes it to the stage that uses
    it; every stage message's payload bytes (Transfer, traffic(), the trace span's args) are
    those of the slots it carries, each cross-stage slot counted in exactly one send."""
    from sparsepipe_hpc.tracing import Recorder, recording

    fits = [(s, g) for s, g in layouts(comm) if s >= 3 and g == (1, 1, 1)]
    if not fits:
        pytest.skip(f"no layout with 3+ stages and no spatial split for {comm.size} ranks")
    batch = make_batch(15)
    m = 2
    for stages, grid in fits:
        layout = RankLayout.from_world(comm.size, grid=grid, stages=stages)
        ctx = ParallelContext(comm, layout)
        model = build("unet")
        pipe = Pipeline(model, ctx, balance=",".join(map(str, BALANCE["unet"][stages])),
                        schedule=kind, micro_batches=m)
        skip = [sl for p in pipe.plan.stages for sl in p.outputs
                if sl.consumer is not None and sl.consumer >= sl.producer + 2]
        assert len(skip) == 1, pipe.plan  # the stem's output, crossing two or more boundaries
        (skip,) = skip
        x, vlab, _ = batch
        parts = split_batch(x, m, vlab)
        local = [ctx.distribute(xi, align=model.total_stride)[0] for xi, _ in parts]
        want = [slot_bytes(build("unet"), xi) for xi, _ in parts]
        rec = Recorder.start(comm)
        with recording(rec):
            pipe.run(local, [t.context for t in local],
                     lambda i, out: F.cross_entropy(out.feats, parts[i][1], reduction="sum"))
        me = pipe.stage
        for t in pipe.executor.transfers:
            k = 0 if t.kind == "act" else 1
            assert t.bytes == sum(want[t.micro_batch][sid][k] for sid in t.slots), t
            for sid in t.slots:  # never relayed: the sender made it, the receiver uses it
                sl = next(sl for p in pipe.plan.stages for sl in p.outputs if sl.id == sid)
                src, dst = (me, t.peer) if (t.direction == "send") == (t.kind == "act") \
                    else (t.peer, me)
                assert (sl.producer, sl.consumer) == (src, dst), (t, sl)
        traced = sorted((s.cat, s.args["micro_batch"], s.args["peer"], tuple(s.args["slots"]),
                         s.args["bytes"]) for s in rec.spans if "bytes" in s.args)
        assert traced == sorted((t.direction, t.micro_batch, t.peer, t.slots, t.bytes)
                                for t in pipe.executor.transfers)
        every = comm.allgather((me, pipe.executor.transfers, pipe.executor.traffic()))
        sent = [(s, t) for s, ts, _ in every for t in ts if t.direction == "send" and t.kind == "act"]
        for i in range(m):
            for sl in (sl for p in pipe.plan.stages for sl in p.outputs if sl.consumer is not None):
                carriers = [(s, t.peer) for s, t in sent if t.micro_batch == i and sl.id in t.slots]
                assert carriers == [(sl.producer, sl.consumer)], (i, sl, carriers)
        got = [t for s, ts, _ in every for t in ts if t.direction == "recv" and t.kind == "act"]
        assert sum(t.bytes for _, t in sent) == sum(t.bytes for t in got)
        # traffic(): the skip's edge carries its bytes and nothing else (U-Net: only the skip)
        skip_bytes = sum(want[i][skip.id][0] for i in range(m))
        maker = next(tr for s, _, tr in every if s == skip.producer)
        assert maker[f"send act -> {skip.consumer}"] == {"messages": m, "bytes": skip_bytes}
        user = next(tr for s, _, tr in every if s == skip.consumer)
        assert user[f"recv act <- {skip.producer}"] == {"messages": m, "bytes": skip_bytes}
        assert comm.allreduce(1) == comm.size
