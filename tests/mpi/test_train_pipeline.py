"""The trainer's pipeline options (--stages, --balance, --micro-batches, --pipeline-schedule)
under real mpirun: a pipelined run equals the single-process run over the same micro-batches,
its checkpoint holds every stage's weights, a resumed run continues it, bad options fail on
every rank.

The single-process oracle runs ``--micro-batches m`` on one stage (the same micro-batches, so
BatchNorm sees the same statistics); with replicas, each holds its shard of every one of those
micro-batches (``ShardedBatches(micro_batches=m)``). SGD, as in test_train_parallel.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import ConfigError, parse_config
from sparsepipe_hpc.train.loop import SetupError, Trainer
from sparsepipe_hpc.train.metrics import read_metrics

# (stages, grid, balance) per world size, one replica each; seg (U-Net depth 2: 6 blocks).
LAYOUTS = {2: [(2, "1,1,1", "2,4")], 3: [(3, "1,1,1", "2,2,2")],
           4: [(2, "2,1,1", "3,3"), (4, "1,1,1", "1,1,2,2")]}


@pytest.fixture(scope="module")
def shared(shared_data) -> Path:
    return shared_data(scenes=dict(train=8, val=3, seed=1, objects=(2, 4), points=(1200, 2000)))


def config(shared: Path, out: Path, *extra: str):
    return parse_config([
        "--task", "seg", "--data", str(shared / "scenes"), "--out", str(out), "--width", "4",
        "--depth", "2", "--steps", "3", "--lr", "0.05", "--optimizer", "sgd", "--voxel-size",
        "0.25", "--batch-size", "4", "--micro-batches", "3", "--no-progress", *extra])


def curve(out: Path, comm) -> list[float]:
    return comm.bcast([r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
                      if comm.rank == 0 else None)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipelined_trainer_equals_single_process(comm, shared, tmp_path, kind):
    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    single_out = tmp_path / "single"
    single = Trainer(config(shared, single_out), MPI.COMM_SELF, log=None)
    res_s = single.run()
    ref = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    for stages, grid, balance in LAYOUTS[comm.size]:
        out = shared / f"pipe-{kind}-{comm.size}-{stages}"
        prefetch = ["--prefetch"] if kind == "1f1b" else []  # the next batch read ahead
        t = Trainer(config(shared, out, "--stages", str(stages), "--grid", grid, "--balance",
                           balance, "--pipeline-schedule", kind, *prefetch), comm, log=None)
        assert t.prefetch == (kind == "1f1b")
        assert t.layout.stages == stages and t.layout.replicas == 1
        res = t.run()
        assert curve(out, comm) == pytest.approx(curve(single_out, MPI.COMM_SELF), rel=1e-5)
        assert res["eval"]["oa"] == pytest.approx(res_s["eval"]["oa"], abs=1e-6)
        assert res["eval"]["voxels"] == res_s["eval"]["voxels"]
        # The checkpoint (rank 0 writes it) holds every stage's trained weights and buffers.
        saved = ck.load_checkpoint(out / "last.pt")
        assert len(saved["optimizer_stages"]) == stages
        for k, v in ref.items():
            assert torch.allclose(saved["model"][k].double(), v.double(), rtol=1e-4,
                                  atol=1e-5), k


# (stages, balance) with replicas filling the world; 6 samples in 2 micro-batches of 3, which 2
# replicas share unevenly (2 + 1 and 1 + 2 samples).
REPLICATED = {2: [(1, None)], 3: [(1, None)], 4: [(2, "2,4")]}


def test_replicas_with_micro_batches_equal_single_process(comm, shared, tmp_path):
    """Replicas x micro-batches (one stage or several): the replicas' micro-batch i together is
    one process's micro-batch i, so the loss curve and the weights equal the single process's
    with the same --micro-batches (BatchNorm normalizes each over the replicas)."""
    if comm.size not in REPLICATED:
        pytest.skip(f"no layout with replicas for {comm.size} rank(s)")
    opts = ("--batch-size", "6", "--micro-batches", "2")
    single_out = tmp_path / "single"
    single = Trainer(config(shared, single_out, *opts), MPI.COMM_SELF, log=None)
    single.run()
    ref = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    for stages, balance in REPLICATED[comm.size]:
        out = shared / f"replicated-{comm.size}-{stages}"
        extra = ("--stages", str(stages)) + (("--balance", balance) if balance else ())
        t = Trainer(config(shared, out, *opts, *extra), comm, log=None)
        assert t.layout.replicas == comm.size // stages > 1
        t.run()
        assert curve(out, comm) == pytest.approx(curve(single_out, MPI.COMM_SELF), rel=1e-5)
        saved = ck.load_checkpoint(out / "last.pt")
        for k, v in ref.items():
            assert torch.allclose(saved["model"][k].double(), v.double(), rtol=1e-4,
                                  atol=1e-5), k


def test_bf16_pipeline_tracks_fp32_with_bf16_carries(comm, shared):
    """--precision bf16 with stages: every stage's forward runs under autocast, so carries and
    their gradients travel in bf16 (about half the bytes of fp32's), master weights stay
    float32, and the loss curve tracks fp32's."""
    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    stages, grid, balance = LAYOUTS[comm.size][0]
    runs = {}
    for precision in ("fp32", "bf16"):
        out = shared / f"pipe-{precision}-{comm.size}"
        t = Trainer(config(shared, out, "--stages", str(stages), "--grid", grid, "--balance",
                           balance, "--precision", precision, "--engine", "torch"), comm,
                    log=None)
        t.run()
        sent = sum(v["bytes"] for k, v in t.pipe.executor.traffic().items()
                   if k.startswith("send"))
        runs[precision] = (curve(out, comm), comm.allreduce(sent), t)
    (a, bytes32, _), (b, bytes16, t16) = runs["fp32"], runs["bf16"]
    assert abs(a[0] - b[0]) < 0.02 * a[0], (a, b)  # the same first step, to bf16 rounding
    assert abs(a[-1] - b[-1]) < 0.1 * a[-1], (a, b)
    # feats and gradients halve; coordinates (int32) do not: well under fp32's bytes
    assert bytes16 < 0.8 * bytes32, (bytes16, bytes32)
    assert all(p.dtype == torch.float32 for p in t16.model.parameters())


def test_fp16_pipeline_equals_single_process_fp16(comm, shared, tmp_path):
    """--precision fp16 with stages: the last stage's loss is scaled, the scaled gradients
    travel back in fp16, every stage unscales with the same scale and skips with the others.
    The run equals one process's fp16 run over the same micro-batches (same casts, same order),
    and every rank ends with the same loss scale."""
    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    stages, grid, balance = LAYOUTS[comm.size][-1]
    fp16 = ("--precision", "fp16", "--engine", "torch")
    single_out, fp32_out = tmp_path / "single", tmp_path / "fp32"
    single = Trainer(config(shared, single_out, *fp16), MPI.COMM_SELF, log=None)
    single.run()
    # The one-process oracle is a one-stage pipeline too: fp32 checks it scales and unscales
    Trainer(config(shared, fp32_out, "--engine", "torch"), MPI.COMM_SELF, log=None).run()
    ref = curve(fp32_out, MPI.COMM_SELF)
    out = shared / f"pipe-fp16-{comm.size}"
    t = Trainer(config(shared, out, "--stages", str(stages), "--grid", grid, "--balance",
                       balance, *fp16), comm, log=None)
    t.run()
    a, b = curve(single_out, MPI.COMM_SELF), curve(out, comm)
    # grid 2,1,1 adds a halo's partial sums in another order, rounded to fp16 at each layer
    tol = 1e-5 if grid == "1,1,1" else 5e-3
    assert b == pytest.approx(a, rel=tol), (a, b)
    assert a == pytest.approx(ref, rel=2e-3), (a, ref)
    scales = comm.allgather(t.precision.scaler.get_scale())
    assert scales == [single.precision.scaler.get_scale()] * comm.size


def test_deferred_bn_running_stats_equal_unpipelined(comm, shared, tmp_path):
    """--deferred-bn with --micro-batches 4: the same losses as the default mode, and after the
    step the stem BatchNorm's running statistics equal the unpipelined single-process step's
    (whole batch); the default mode's (one update per micro-batch) do not."""
    if comm.size != 2:
        pytest.skip("a 2-stage layout on 2 ranks")
    opts = ("--steps", "1", "--micro-batches", "4", "--stages", "2", "--balance", "2,4")
    single_out = tmp_path / "single"
    Trainer(config(shared, single_out, "--steps", "1", "--micro-batches", "1"), MPI.COMM_SELF,
            log=None).run()
    ref = ck.load_checkpoint(single_out / "last.pt")["model"]
    saved, losses = {}, {}
    for mode in ("--deferred-bn", "--no-deferred-bn"):
        out = shared / f"deferred-{mode}"
        Trainer(config(shared, out, *opts, mode), comm, log=None).run()
        losses[mode] = curve(out, comm)
        saved[mode] = ck.load_checkpoint(out / "last.pt")["model"]
    assert losses["--deferred-bn"] == losses["--no-deferred-bn"]
    stem = "blocks.0.net.1."
    for k in ("running_mean", "running_var"):
        assert torch.allclose(saved["--deferred-bn"][stem + k], ref[stem + k], rtol=1e-5,
                              atol=1e-6), k
        assert not torch.allclose(saved["--no-deferred-bn"][stem + k], ref[stem + k], rtol=1e-3,
                                  atol=1e-4), k
    assert int(saved["--deferred-bn"][stem + "num_batches_tracked"]) == 1
    assert int(saved["--no-deferred-bn"][stem + "num_batches_tracked"]) == 4
    # Deeper BatchNorms: one update per mini-batch in deferred mode, on every stage.
    assert all(int(v) == 1 for k, v in saved["--deferred-bn"].items()
               if k.endswith("num_batches_tracked"))


TOP = {"forward", "backward", "send", "recv", "step", "input"}  # a rank's sequential actions


def test_trace_has_one_row_per_rank_with_the_schedule_actions(comm, shared, tmp_path):
    """--trace: rank 0 writes a Chrome trace, one row per rank; each row's top-level spans are
    its stage's schedule actions in program order (after each step's input distribution),
    never overlapping; all-reduce, send drains and halo waits nest inside them. It holds the
    first --trace-steps steps only."""
    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    stages, grid, balance = LAYOUTS[comm.size][0]
    path = Path(comm.bcast(str(tmp_path / "trace.json") if comm.rank == 0 else None))
    steps = 2   # of 3
    # --plot too where matplotlib (the plot extra) is installed
    png = path.with_suffix(".png") if importlib.util.find_spec("matplotlib") else None
    t = Trainer(config(shared, shared / f"trace-{comm.size}", "--stages", str(stages), "--grid",
                       grid, "--balance", balance, "--steps", "3", "--trace-steps", str(steps),
                       "--trace", str(path),
                       *(("--plot", str(png)) if png else ())),
                comm, log=None)
    t.run()
    if png is not None and comm.rank == 0:
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert t.pipe is not None
    programs = comm.allgather([str(a) for a in t.pipe.schedule.actions[t.pipe.stage]])
    positions = comm.allgather(t.ctx.position)
    comm.Barrier()
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names) == list(range(comm.size))
    for r in range(comm.size):
        assert names[r].startswith(f"rank {r}: stage {positions[r].stage}")
        row = sorted((e for e in events if e.get("tid") == r and e["ph"] == "X"),
                     key=lambda e: (e["ts"], -e["dur"]))
        top = [e for e in row if e["cat"] in TOP]
        assert [e["name"] for e in top] == (["distribute"] + programs[r]) * steps, r
        for a, b in zip(top, top[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (r, a, b)
        nested = [e for e in row if e["cat"] not in TOP]
        assert sum(e["name"] == "allreduce" for e in nested) == steps
        assert sum(e["name"] == "wait sends" for e in nested) == steps
        if grid != "1,1,1":
            assert any(e["cat"] == "halo" for e in nested)
        for e in nested:
            assert any(o["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                       + 1e-3 for o in top), (r, e)
        steps_at = [e for e in top if e["name"] == "STEP"]
        for e in nested:
            if e["name"] == "allreduce":
                assert any(o["ts"] - 1e-3 <= e["ts"] <= o["ts"] + o["dur"] for o in steps_at)


# --stage-order per world size: (stages, replicas, order, options beside the single run's,
# the single run's options).
ORDERED = {2: [(2, 1, "1,0", ("--balance", "2,4"), ())],
           3: [(3, 1, "2,0,1", ("--balance", "2,2,2"), ())],
           4: [(2, 2, "1,0", ("--balance", "2,4"), ("--batch-size", "6", "--micro-batches", "2")),
               (2, 1, "1,0", ("--balance", "3,3", "--grid", "2,1,1"), ())]}


def test_stage_order_moves_stages_and_equals_single_process(comm, shared, tmp_path):
    """--stage-order runs stage s on the processes launched as stage order[s] (each keeps its
    replica and spatial rank) and changes nothing else: the run equals one process's."""
    if comm.size not in ORDERED:
        pytest.skip(f"no pipeline to reorder on {comm.size} rank(s)")
    for case, (stages, replicas, order, extra, opts) in enumerate(ORDERED[comm.size]):
        single_out = tmp_path / f"single-{case}"
        single = Trainer(config(shared, single_out, *opts), MPI.COMM_SELF, log=None)
        single.run()
        ref = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
        out = shared / f"ordered-{comm.size}-{case}"
        t = Trainer(config(shared, out, "--stages", str(stages), "--stage-order", order, *extra,
                           *opts), comm, log=None)
        launched = t.layout.position(comm.rank)
        want = [int(s) for s in order.split(",")].index(launched.stage)
        assert t.ctx.position == (launched.replica, want, launched.spatial)
        assert t.layout.replicas == replicas
        t.run()
        assert curve(out, comm) == pytest.approx(curve(single_out, MPI.COMM_SELF), rel=1e-5)
        saved = ck.load_checkpoint(out / "last.pt")
        assert len(saved["optimizer_stages"]) == stages
        for key, v in ref.items():
            assert torch.allclose(saved["model"][key].double(), v.double(), rtol=1e-4,
                                  atol=1e-5), key
        t.close()


def test_a_resume_may_change_the_stage_order(comm, shared):
    """A checkpoint holds stages, not processes: a run stopped under one stage order resumes
    under another as if uninterrupted."""
    if comm.size != 2:
        pytest.skip("one case is enough: 2 ranks, 2 stages")
    opts = ("--stages", "2", "--balance", "2,4", "--schedule", "constant")
    full, part = shared / "order-full", shared / "order-part"
    Trainer(config(shared, full, *opts), comm, log=None).run()
    Trainer(config(shared, part, *opts, "--stage-order", "1,0", "--steps", "2"), comm,
            log=None).run()
    resumed = Trainer(config(shared, part, *opts, "--resume", "auto"), comm, log=None)
    assert resumed.step == 2
    resumed.run()
    assert curve(part, comm) == pytest.approx(curve(full, comm), rel=1e-6)
    a, b = ck.load_checkpoint(full / "last.pt"), ck.load_checkpoint(part / "last.pt")
    for k in a["model"]:
        assert torch.allclose(a["model"][k].double(), b["model"][k].double(), rtol=1e-5,
                              atol=1e-6), k


def test_a_stage_order_that_is_no_permutation_fails_on_every_rank(comm, shared):
    with pytest.raises(ConfigError, match="--stage-order 0,0 must list each of the 2 stage"):
        Trainer(config(shared, shared / "never", "--stages", "2", "--stage-order", "0,0"), comm,
                log=None)


def test_pipelined_resume_equals_uninterrupted(comm, shared):
    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    stages, grid, balance = LAYOUTS[comm.size][-1]
    # A constant rate: the cosine of a 2-step run is not the first 2 steps of a 3-step one.
    opts = ("--stages", str(stages), "--grid", grid, "--balance", balance, "--schedule",
            "constant")
    full, part = shared / f"full-{comm.size}", shared / f"part-{comm.size}"
    Trainer(config(shared, full, *opts), comm, log=None).run()
    Trainer(config(shared, part, *opts, "--steps", "2"), comm, log=None).run()
    resumed = Trainer(config(shared, part, *opts, "--resume", "auto"), comm, log=None)
    assert resumed.step == 2
    resumed.run()
    assert curve(part, comm) == curve(full, comm)  # bitwise: same ranks, same order
    a, b = ck.load_checkpoint(full / "last.pt"), ck.load_checkpoint(part / "last.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_bad_balance_fails_on_every_rank(comm, shared):
    if comm.size % 2:
        pytest.skip("needs an even world size")
    with pytest.raises(SetupError, match="--balance 2,3 sums to 5 but the model has 6 blocks"):
        Trainer(config(shared, shared / f"bad-{comm.size}", "--stages", "2", "--balance", "2,3",
                       "--grid", "1,1,1", "--micro-batches", "1"), comm, log=None)


def test_too_many_micro_batches_fail_on_every_rank(comm, shared):
    with pytest.raises(ConfigError, match="--micro-batches 5 needs at least that many samples"):
        Trainer(config(shared, shared / "never", "--micro-batches", "5", "--stages",
                       str(comm.size)), comm, log=None)


def test_stages_not_dividing_ranks_fail_on_every_rank(comm, shared):
    stages = 2 if comm.size % 2 else 3
    with pytest.raises(ConfigError, match=f"does not divide the {comm.size} ranks"):
        Trainer(config(shared, shared / "never", "--stages", str(stages)), comm, log=None)


def test_a_step_fp16_skips_changes_nothing_on_any_stage(comm, shared, tmp_path):
    """A pipelined fp16 step whose forward overflows (step 2's features x 1e5): every stage's
    rank skips it together, and its weights and BatchNorm statistics stay those after step 1
    (the last stage's overflow had put NaN into the running statistics of its layers)."""
    import dataclasses

    if comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    stages, grid, balance = LAYOUTS[comm.size][0]
    out = Path(comm.bcast(str(tmp_path / "fp16") if comm.rank == 0 else None))
    t = Trainer(config(shared, out, "--stages", str(stages), "--grid", grid, "--balance",
                       balance, "--steps", "2", "--precision", "fp16"), comm, log=None)
    read, after_first = t._train_batch, {}

    def train_batch(indices, epoch):
        batch = read(indices, epoch)
        if t.step == 1:
            after_first.update({k: v.clone() for k, v in t.pipe.blocks.state_dict().items()})
            batch = dataclasses.replace(batch, x=batch.x.replace(feats=batch.x.feats * 1e5))
        return batch

    t._train_batch = train_batch
    t.run()
    assert comm.allgather(t.precision.skipped) == [True] * comm.size
    own = t.pipe.blocks.state_dict()   # (the last checkpoint gathers the other stages')
    assert any("running_mean" in k for k in own)
    for k, v in own.items():
        assert torch.equal(v, after_first[k]), (comm.rank, k)
    t.close()


@pytest.mark.parametrize("layout", ["stages", "grid"])
def test_fp16_updates_skipped_on_one_rank_stop_every_rank_together(comm, shared, tmp_path,
                                                                   monkeypatch, layout):
    """Gradients inf at every loss scale on rank 0's parameters only (the loss finite): every
    rank's scaler skips together, and every rank raises DivergedError at the same step after
    MAX_SKIPPED_UPDATES of them (patched to 3), pipelined or on a spatial grid; none hangs."""
    import sparsepipe_hpc.train.loop as loop

    if layout == "stages" and comm.size not in LAYOUTS:
        pytest.skip(f"no one-replica pipeline layout for {comm.size} ranks")
    if layout == "grid" and comm.size == 1:
        pytest.skip("a grid of one rank is the serial run")
    monkeypatch.setattr(loop, "MAX_SKIPPED_UPDATES", 3)
    if layout == "stages":
        stages, grid, balance = LAYOUTS[comm.size][0]
        extra = ("--stages", str(stages), "--grid", grid, "--balance", balance)
    else:
        extra = ("--grid", f"{comm.size},1,1")
    out = Path(comm.bcast(str(tmp_path / "skips") if comm.rank == 0 else None))
    t = Trainer(config(shared, out, *extra, "--steps", "20", "--precision", "fp16"), comm,
                log=None)
    model = t.pipe.blocks if t.pipe is not None else t.model
    if comm.rank == 0:
        next(model.parameters()).register_hook(lambda g: g * float("inf"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(loop.DivergedError, match="skipped the last 3 updates in a row"):
        t.run()
    assert comm.allgather(t.step) == [3] * comm.size
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), (comm.rank, k)
    t.close()
