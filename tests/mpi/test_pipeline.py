"""Pipelined training steps equal the single-process run (float64), under real mpirun.

Every rank builds the same model and the same global batch, runs the single-process oracle on it,
then runs its own part of the pipeline (its stage's blocks, its replica's samples, its box under
a spatial grid) through the executor and compares loss, parameter gradients (after the stage's
all-reduce) and BatchNorm running statistics.

BatchNorm in training mode normalizes each micro-batch by its own statistics (GPipe's semantics),
so the training-mode oracle runs the serial model on the same micro-batches (micro-batch i of the
global batch = every replica's micro-batch i) and accumulates; the eval-mode test compares with
the plain unpipelined full-batch step (micro-batching is then invisible).
"""

from __future__ import annotations

import copy
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from halo.transport.mpi import MPITransport
from sparsepipe_hpc.nn import SparseResNet, SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import LayoutError, RankLayout
from sparsepipe_hpc.pipeline import make_schedule
from sparsepipe_hpc.pipeline.carry import PipelineError, plan_carry
from sparsepipe_hpc.pipeline.executor import StageExecutor, sample_bounds
from sparsepipe_hpc.pipeline.p2p import StageLink
from sparsepipe_hpc.sparse import SparseTensor

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
    """[replica][micro-batch] -> global sample indices."""
    per = GLOBAL_BATCH // replicas
    return [[list(range(r * per + lo, r * per + hi)) for lo, hi in sample_bounds(per, m)]
            for r in range(replicas)]


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


def _pipelined(comm, model, batch, name, stages, grid, kind, m):
    """This rank's part of the pipelined step; returns (position, carry plan, global loss)."""
    layout = RankLayout.from_world(comm.size, grid=grid, stages=stages)
    ctx = ParallelContext(comm, layout)
    pos = ctx.position
    x, vlab, slab = batch
    plan = plan_carry([b.carry_arity for b in model.blocks], BALANCE[name][stages])
    sched = make_schedule(kind, stages, m, skips=plan.skips)
    a, b = plan.stages[pos.stage].blocks
    inputs, contexts, labels = [], [], []
    for samples in micro_samples(layout.replicas, m)[pos.replica]:
        xi, vi, si = select(x, vlab, slab, samples)
        xl, vl = ctx.distribute(xi, vi, align=model.total_stride)
        inputs.append(xl)
        contexts.append(xl.context)
        labels.append((vl, si))
    link = StageLink(MPITransport(comm))
    ex = StageExecutor(model.blocks[a:b], plan, sched, pos.stage, link,
                       lambda s: layout.rank_of(pos.replica, s, pos.spatial))
    params = list(model.blocks[a:b].parameters())

    def loss_fn(i, out):
        return loss_of(out, *labels[i], name, len(x.coords), layout.spatial_size)

    shares = ex.run(inputs if pos.stage == 0 else [None] * m, contexts,
                    loss_fn if pos.stage == stages - 1 else None,
                    step=lambda: ctx.allreduce_gradients(params))
    loss = comm.allreduce(float(sum(shares)) if shares else 0.0)
    return pos, plan, loss


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


def test_bad_balance_fails_on_every_rank(comm):
    model = build("unet")
    arities = [b.carry_arity for b in model.blocks]
    with pytest.raises(PipelineError) as err:
        plan_carry(arities, [2, 3])
    msg = str(err.value)
    assert "sums to 5 but the model has 6 blocks" in msg
    assert len(set(comm.allgather(msg))) == 1


def test_stages_not_dividing_ranks_fail_on_every_rank(comm):
    stages = 2 if comm.size % 2 else 3
    with pytest.raises(LayoutError) as err:
        RankLayout.from_world(comm.size, stages=stages)
    assert f"does not divide the {comm.size} ranks" in str(err.value)
    assert comm.allreduce(1) == comm.size  # every rank got here, nobody hangs
