"""The training loop on tiny synthetic data: learning, exact resume, checkpoints, stop, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from sparsepipe_hpc.data.synth import generate_objects, generate_scenes
from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import parse_config
from sparsepipe_hpc.train.loop import LrSchedule, SetupError, Trainer
from sparsepipe_hpc.train.metrics import read_metrics
from sparsepipe_hpc.train.output import OutputError

from helpers import FillsUp, repo_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Tiny rooms (a few hundred voxels at 0.2 m) and tiny objects, made once per module."""
    root = tmp_path_factory.mktemp("data")
    seg = generate_scenes(root, train=8, val=2, seed=0, objects=(2, 4), points=(1500, 2500))
    cls = generate_objects(root, train=24, test=12, points=96, seed=0)
    return {"seg": seg, "cls": cls}


def tiny(data, out, *extra, task="seg"):
    args = ["--task", task, "--data", str(data[task]), "--out", str(out), "--width", "4",
            "--depth", "2", "--voxel-size", "0.2" if task == "seg" else "0.25",
            "--batch-size", "2" if task == "seg" else "6", "--no-progress", *extra]
    return parse_config(args)


def train(cfg, **kw):
    return Trainer(cfg, MPI.COMM_SELF, log=None, **kw).run()


def losses(out):
    return [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl", "train")]


def test_loss_drops_seg(data, tmp_path):
    res = train(tiny(data, tmp_path, "--steps", "40", "--lr", "0.01", "--schedule", "constant",
                     "--eval-every", "20"))
    curve = losses(tmp_path)
    assert len(curve) == 40 and res["step"] == 40 and not res["stopped"]
    first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
    assert last < 0.6 * first, curve
    evals = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [20, 40]
    assert 0 <= evals[-1]["miou"] <= 1 and evals[-1]["oa"] > 0.3
    assert len(evals[-1]["iou"]) == 8
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["options"]["steps"] == 40 and cfg["layout"]["world_size"] == 1
    assert "torch" in cfg["versions"] and cfg["grid"]["total_stride"] == 4
    assert ck.load_checkpoint(tmp_path / "last.pt")["step"] == 40


def test_loss_drops_cls(data, tmp_path):
    res = train(tiny(data, tmp_path, "--steps", "24", "--lr", "0.01", "--schedule", "constant",
                     task="cls"))
    curve = losses(tmp_path)
    assert sum(curve[-4:]) < 0.8 * sum(curve[:4]), curve
    assert 0 <= res["eval"]["acc"] <= 1 and res["eval"]["samples"] == 12
    assert read_metrics(tmp_path / "metrics.jsonl", "train")[0]["epoch"] == 0


def state(out):
    return ck.load_checkpoint(Path(out) / "last.pt")


def test_resume_equals_uninterrupted(data, tmp_path):
    opts = ("--steps", "9", "--eval-every", "4", "--lr", "0.01")  # 4 steps per epoch: crosses two
    train(tiny(data, tmp_path / "a", *opts))
    holder = {}
    stopper = Trainer(tiny(data, tmp_path / "b", *opts), MPI.COMM_SELF, log=None,
                      should_stop=lambda: holder["t"].step >= 5)
    holder["t"] = stopper
    res = stopper.run()
    assert res["stopped"] and res["step"] == 5 and state(tmp_path / "b")["step"] == 5
    torch.manual_seed(1234)  # a resumed process starts from other RNG states: they are restored
    res = train(tiny(data, tmp_path / "b", *opts, "--resume", "auto"))
    assert res["step"] == 9 and not res["stopped"]
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # bitwise: == on the floats
    ev_a = read_metrics(tmp_path / "a" / "metrics.jsonl", "eval")
    ev_b = read_metrics(tmp_path / "b" / "metrics.jsonl", "eval")
    assert ev_a == ev_b and [e["step"] for e in ev_a] == [4, 8, 9]
    a, b = state(tmp_path / "a"), state(tmp_path / "b")
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["loader"] == b["loader"] and a["scheduler"] == b["scheduler"]


def test_prefetch_trains_the_same_run_reading_on_a_worker(data, tmp_path):
    """--prefetch (on by default on a GPU): every batch after the first is read on the worker
    while the step before computes; losses, evaluations and weights equal those read in line,
    bit for bit, across epoch ends and a stop and resume."""
    opts = ("--steps", "9", "--eval-every", "4", "--lr", "0.01")  # 4 steps per epoch
    train(tiny(data, tmp_path / "a", *opts))
    reads: list[tuple[str, bool]] = []

    class Watched(Trainer):
        def _batch(self, dataset, indices, epoch):
            reads.append((threading.current_thread().name, epoch is not None))
            return super()._batch(dataset, indices, epoch)

    holder = {}
    first = Watched(tiny(data, tmp_path / "b", *opts, "--prefetch"), MPI.COMM_SELF, log=None,
                    should_stop=lambda: holder["t"].step >= 5)
    holder["t"] = first
    assert first.run()["stopped"]
    res = Watched(tiny(data, tmp_path / "b", *opts, "--prefetch", "--resume", "auto"),
                  MPI.COMM_SELF, log=None).run()
    assert res["step"] == 9
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert (read_metrics(tmp_path / "a" / "metrics.jsonl", "eval")
            == read_metrics(tmp_path / "b" / "metrics.jsonl", "eval"))
    a, b = state(tmp_path / "a"), state(tmp_path / "b")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    train_reads = [name for name, training in reads if training]
    main = threading.current_thread().name
    # Steps 1-5 (plus step 6's read ahead, dropped at the stop), then 6-9: one in line each run.
    assert [name == main for name in train_reads] == [True] + [False] * 5 + [True] + [False] * 3
    assert all(name == main for name, training in reads if not training)  # evaluation


def test_resume_explicit_path_and_mismatch(data, tmp_path):
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    ckpt = tmp_path / "a" / "last.pt"
    res = train(tiny(data, tmp_path / "c", "--steps", "3", "--resume", str(ckpt)))
    assert res["step"] == 3 and [r["step"] for r in read_metrics(tmp_path / "c" / "metrics.jsonl",
                                                                 "train")] == [1, 2, 3]
    with pytest.raises(SetupError, match=r"other options \(--width 4 -> 8\)"):
        Trainer(tiny(data, tmp_path / "d", "--width", "8", "--resume", str(ckpt)), MPI.COMM_SELF,
                log=None)
    with pytest.raises(SetupError, match="no such checkpoint"):
        Trainer(tiny(data, tmp_path / "d", "--resume", str(tmp_path / "nope.pt")), MPI.COMM_SELF,
                log=None)
    res = train(tiny(data, tmp_path / "e", "--steps", "1", "--resume", "auto"))  # nothing there
    assert res["step"] == 1


def test_an_out_rank_0_cannot_look_into_is_a_setup_error(data, tmp_path):
    """--resume auto looks for <out>/last.pt on rank 0 alone; an error there other than 'no
    such file' (a name too long here; permissions or a stale handle elsewhere) was a traceback
    on rank 0 while the others waited in their broadcast."""
    with pytest.raises(SetupError, match="File name too long"):
        Trainer(tiny(data, tmp_path / ("x" * 300), "--resume", "auto"), MPI.COMM_SELF, log=None)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_nan_loss_stops_the_run_before_a_checkpoint_keeps_it(data, tmp_path, monkeypatch,
                                                               precision):
    """A NaN loss from step 2 on stops fp32 at step 2, with <out>/last.pt kept at step 1 (the
    run finished with exit 0 and NaN weights in its checkpoint); fp16, whose loss scaler skips
    such steps, stops after MAX_SKIPPED_STEPS of them in a row."""
    import sparsepipe_hpc.train.loop as loop

    trainer = Trainer(tiny(data, tmp_path / "o", "--steps", "30", "--checkpoint-every", "1"),
                      MPI.COMM_SELF, log=None)
    real = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda indices, epoch: real(indices, epoch)
                        if trainer.step == 0 else (float("nan"), 1))
    if precision == "fp16":  # (the scaler's skip is taken as given)
        monkeypatch.setattr(trainer.precision, "scaler", object())  # only its presence is read
        monkeypatch.setattr(trainer, "train_step", lambda indices, epoch: (float("nan"), 1))
        monkeypatch.setattr(trainer, "save_checkpoint", lambda: None)
        with pytest.raises(loop.DivergedError, match="for 10 steps in a row under --precision "
                                                     "fp16.*the weights are finite"):
            trainer.run()
        assert trainer.step == loop.MAX_SKIPPED_STEPS
        return
    with pytest.raises(loop.DivergedError, match=r"step 2: the training loss is nan \(--precision "
                                                 r"fp32\).*are not saved \(.*last.pt keeps"):
        trainer.run()
    saved = torch.load(tmp_path / "o" / "last.pt", weights_only=False)
    assert saved["step"] == 1
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())


def test_fp16_updates_skipped_at_finite_losses_stop_the_run(data, tmp_path, monkeypatch):
    """Gradients that are inf at every loss scale (here by a hook), the loss finite: the scaler
    skipped every update, halving its scale, and the run went on to its end without training.
    It now stops after MAX_SKIPPED_UPDATES skips in a row, weights as they were, by name."""
    import sparsepipe_hpc.train.loop as loop

    monkeypatch.setattr(loop, "MAX_SKIPPED_UPDATES", 3)
    trainer = Trainer(tiny(data, tmp_path / "o", "--steps", "30", "--precision", "fp16",
                           "--eval-every", "0"), MPI.COMM_SELF, log=None)
    weight = next(trainer.model.parameters())
    weight.register_hook(lambda g: g * float("inf"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(loop.DivergedError, match=r"step 3: the loss scaler skipped the last 3 "
                                                 r"updates in a row .*loss was finite \(loss "
                                                 r"scale now 8192\).*the weights are finite"):
        trainer.run()
    assert all(math.isfinite(r) for r in losses(tmp_path / "o"))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    trainer.close()


def test_fp16_skips_in_a_row_go_into_the_checkpoint():
    """The count of skipped updates is part of the loss scaler's state, so a resume goes on
    counting; a checkpoint from before it counts from 0."""
    from sparsepipe_hpc.train.device import Precision

    a = Precision("fp16", torch.device("cpu"))
    a.skipped_in_a_row = 5
    state = a.state_dict()
    b = Precision("fp16", torch.device("cpu"))
    b.load_state_dict(state)
    assert b.skipped_in_a_row == 5 and b.state_dict() == state
    b.load_state_dict({k: v for k, v in state.items() if k != "skipped_in_a_row"})
    assert b.skipped_in_a_row == 0
    assert Precision("fp32", torch.device("cpu")).state_dict() is None


def test_a_step_fp16_skips_leaves_batchnorms_statistics_as_they_were(data, tmp_path):
    """A forward that overflows float16 (step 2's features x 1e5) makes the loss scaler skip the
    step; BatchNorm had already folded its inf/NaN batch statistics into the running ones, so
    evaluation saw NaN logits everywhere (and a high accuracy from argmax of NaN) while
    training went on. A skipped step now changes nothing: weights and buffers as after step 1."""
    trainer = Trainer(tiny(data, tmp_path / "o", "--steps", "2", "--precision", "fp16",
                           "--eval-every", "0"), MPI.COMM_SELF, log=None)
    real, after_first = trainer._forward, {}

    def forward(batch):
        if trainer.step == 1:
            after_first.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
            batch = dataclasses.replace(batch, x=batch.x.replace(feats=batch.x.feats * 1e5))
        return real(batch)

    trainer._forward = forward
    trainer.run()
    assert losses(tmp_path / "o")[1] is None          # step 2's loss overflowed: skipped
    assert trainer.precision.skipped
    state = trainer.model.state_dict()
    assert any("running_mean" in k for k in state)
    for k, v in state.items():
        assert torch.equal(v, after_first[k]), k
    trainer.model.eval()
    logits, _ = trainer._eval_logits(trainer._batch(trainer.val_set, [0], None))
    assert torch.isfinite(logits).all()
    trainer.close()


def test_a_library_trainer_resolves_plan_auto_once(data, tmp_path, monkeypatch):
    """Trainer(cfg) with --plan auto applies the planner's layout (it trained the options as
    given, silently); a cfg auto_plan has resolved already is not planned again."""
    import functools
    import types

    import sparsepipe_hpc.plan.auto as auto
    calls = []

    def plan_for_config(cfg, world_size, data_dir, **kw):
        calls.append(world_size)
        memory, = kw["memory"]  # what this one rank has free: the search plans within it
        assert 0 < memory < float("inf")
        return types.SimpleNamespace(replicas=1, stages=1, grid=(1, 1, 1), micro_batches=2,
                                     balance=(), ranks=1, step_time=1.0, moves_stages=False,
                                     trainer_args=functools.partial(list, ["--micro-batches",
                                                                           "2"]))

    monkeypatch.setattr(auto, "plan_for_config", plan_for_config)
    cfg = tiny(data, tmp_path / "o", "--steps", "1", "--plan", "auto")
    trainer = Trainer(cfg, MPI.COMM_SELF, log=None)
    assert calls == [1] and trainer.cfg.micro_batches == 2 and trainer.cfg.plan_ranks == 1
    trainer.close()
    resolved = auto.auto_plan(cfg, MPI.COMM_SELF, log=None)
    Trainer(resolved, MPI.COMM_SELF, log=None).close()
    assert calls == [1, 1]       # auto_plan once more, the Trainer not again


def test_plan_auto_plans_within_each_ranks_memory(data, tmp_path):
    """--plan auto's search keeps to the memory each rank has (plan_for_config's ``memory``):
    below the roomy plan's need it picks a plan that fits, and with none that fits it says so."""
    from sparsepipe_hpc.plan.auto import plan_for_config
    from sparsepipe_hpc.plan.search import SearchError

    cfg = tiny(data, tmp_path / "o", "--plan", "auto")
    roomy = plan_for_config(cfg, 2, data["seg"], repeats=1)
    limit = 0.99 * max(roomy.memory)
    tight = plan_for_config(cfg, 2, data["seg"], repeats=1, memory=[limit, limit])
    assert max(tight.memory) <= limit
    with pytest.raises(SearchError, match="no plan fits 2 ranks"):
        plan_for_config(cfg, 2, data["seg"], repeats=1, memory=[1.0, 1.0])


def test_resume_on_other_training_data_is_refused(data, tmp_path):
    """A resume continues the same run: the checkpoint records its training data (sample count,
    files and sizes, points per sample) and another data set of the same classes is refused by
    name, where it would have continued with another epoch length and data order."""
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    other = generate_scenes(tmp_path / "other", train=9, val=2, seed=3, objects=(2, 4),
                            points=(1500, 2500))
    cfg = tiny({"seg": other}, tmp_path / "b", "--steps", "3", "--resume",
               str(tmp_path / "a" / "last.pt"))
    with pytest.raises(SetupError, match=r"written for other training data \(.*samples 8 -> 9.*"
                                         r"pass its --data, or start a new run"):
        Trainer(cfg, MPI.COMM_SELF, log=None)


def test_a_resume_into_another_runs_directory_keeps_its_own_log(data, tmp_path):
    """--resume a/last.pt --out b, where b holds another run: b's log kept that run's steps 1-2
    under this run's 3 (a spliced loss curve, and a false note that steps were lost). It now
    holds a's records up to the checkpoint, then this run's."""
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    train(tiny(data, tmp_path / "b", "--steps", "4", "--lr", "0.1"))
    said = []
    Trainer(tiny(data, tmp_path / "b", "--steps", "3", "--resume", str(tmp_path / "a" / "last.pt")),
            MPI.COMM_SELF, log=said.append).run()
    assert losses(tmp_path / "b")[:2] == losses(tmp_path / "a")
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl", "train")] == [1, 2, 3]
    assert any("held the records of another run" in line for line in said)
    assert not any("were lost" in line for line in said)


def test_a_resume_compares_the_balance_meant_not_as_written(data, tmp_path):
    """No --balance means the even split: resuming with it written out is the same run (it was
    refused as "--balance None -> '6'"), and so is the way back."""
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    ckpt = str(tmp_path / "a" / "last.pt")
    assert train(tiny(data, tmp_path / "b", "--steps", "3", "--balance", "6", "--resume",
                      ckpt))["step"] == 3
    assert train(tiny(data, tmp_path / "c", "--steps", "3", "--resume",
                      str(tmp_path / "b" / "last.pt")))["step"] == 3
    said = []
    Trainer(tiny(data, tmp_path / "d", "--steps", "3", "--no-augment", "--resume", ckpt),
            MPI.COMM_SELF, log=said.append).close()
    assert any("trained with augmentation, this one without" in line for line in said), said


def test_resume_with_other_validation_data_is_refused(data, tmp_path):
    """The voxel grid spans the training and the validation split: larger validation rooms move
    its origin and grow it, which changes which voxels merge down the network. The same
    training split passed its check and the run went on, silently another run."""
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    bigger = generate_scenes(tmp_path / "big", train=2, val=2, seed=5, size=(6.0, 5.0, 3.0),
                             objects=(2, 4), points=(1500, 2500))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(data["seg"] / "train.h5", mixed / "train.h5")
    shutil.copy(bigger / "val.h5", mixed / "val.h5")
    cfg = tiny({"seg": mixed}, tmp_path / "b", "--steps", "3", "--resume",
               str(tmp_path / "a" / "last.pt"))
    with pytest.raises(SetupError, match=r"trained on another voxel grid \(origin .* -> origin "
                                         r".*the validation data differ"):
        Trainer(cfg, MPI.COMM_SELF, log=None)


@pytest.mark.parametrize("task", ["seg", "cls"])
def test_resume_on_data_changed_in_place_is_refused(data, tmp_path, task):
    """Labels rewritten in place (same files, sizes and point counts) are other data too: the
    record holds a digest of the values the full check read, and the resume is refused."""
    copy = tmp_path / "copy"
    shutil.copytree(data[task], copy)
    train(tiny({task: copy}, tmp_path / "a", "--steps", "1", task=task))
    h5 = sorted(copy.glob("*train*.h5"))[0]
    size = h5.stat().st_size
    with h5py.File(h5, "r+") as f:
        labels = f["scenes"][sorted(f["scenes"])[0]]["label"] if task == "seg" else f["label"]
        labels[0] = (labels[0] + 1) % 2
    assert h5.stat().st_size == size
    cfg = tiny({task: copy}, tmp_path / "b", "--steps", "2", "--resume",
               str(tmp_path / "a" / "last.pt"), task=task)
    with pytest.raises(SetupError, match=r"written for other training data \(content '"):
        Trainer(cfg, MPI.COMM_SELF, log=None)


def test_a_resume_refused_for_a_grown_default_batch_says_why(tmp_path):
    """A default batch grows with the replicas (4 -> 6 on 3): resuming a 1-process run on 3 is
    refused, and the message says the default grew and which replica counts divide the batch;
    where nothing grew (a checkpoint of a given batch, resumed at the default), no such hint."""
    saved = parse_config([]).to_dict()
    now = dataclasses.replace(parse_config([]), batch_size=6).to_dict()
    with pytest.raises(ck.CheckpointError, match=r"--batch-size 4 -> 6.*left at its default 4, "
                                                 r"which grew.*pass --batch-size 4 and run a "
                                                 r"number of replicas that divides it: 1, 2, 4\)"):
        ck.check_compatible({"config": saved}, now, tmp_path / "last.pt")
    for saved, now in ((saved, parse_config(["--batch-size", "6"]).to_dict()),
                       (parse_config(["--batch-size", "8"]).to_dict(), parse_config([]).to_dict())):
        with pytest.raises(ck.CheckpointError) as info:
            ck.check_compatible({"config": saved}, now, tmp_path / "last.pt")
        assert "left at its default" not in str(info.value)


def test_atomic_save_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ck.atomic_save({"format": ck.FORMAT, "version": ck.VERSION, "step": 1}, path)
    real_save = torch.save

    def crash_midway(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt("simulated crash while writing")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        ck.atomic_save({"step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left
    assert ck.load_checkpoint(path)["step"] == 1                       # the old one, intact

    def no_rename(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        ck.atomic_save({"step": 3}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    assert ck.load_checkpoint(path)["step"] == 1


def test_load_rejects_torn_and_foreign_files(tmp_path):
    good = ck.atomic_save({"format": ck.FORMAT, "version": ck.VERSION, "step": 1},
                          tmp_path / "good.pt")
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ck.CheckpointError, match="torn.pt: not a readable checkpoint"):
        ck.load_checkpoint(torn)
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(ck.CheckpointError, match="not a sparsepipe_hpc training checkpoint"):
        ck.load_checkpoint(tmp_path / "other.pt")


def test_bad_data_path_is_a_clear_error(data, tmp_path):
    cfg = parse_config(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    with pytest.raises(SetupError, match="--data .*missing: not a directory"):
        Trainer(cfg, MPI.COMM_SELF, log=None)
    # scene files are not in the ModelNet layout
    cfg = parse_config(["--task", "cls", "--data", str(data["seg"]), "--out", str(tmp_path)])
    with pytest.raises(SetupError, match="train.h5: missing dataset 'data'"):
        Trainer(cfg, MPI.COMM_SELF, log=None)


def run_cli(args, **kw):
    env = repo_env(OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "sparsepipe_hpc.train", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def test_cli_bad_input_exits_2():
    proc = run_cli(["--batch-size", "0"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "sparsepipe_hpc.train: error: argument --batch-size: must be >= 1; got 0" in err
    assert "Traceback" not in err


def test_cli_sigterm_checkpoints_and_exits_0(data, tmp_path):
    out = tmp_path / "run"
    args = [a for a in tiny_args(data, out)] + ["--steps", "100000", "--progress"]
    proc = run_cli(args)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text()
                                                                   .splitlines()) < 2):
        time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGTERM received" in stderr and "stop requested: checkpoint at step" in stdout
    saved = ck.load_checkpoint(out / "last.pt")
    assert saved["step"] == losses_count(out) >= 2
    assert "done: step" in stdout


def tiny_args(data, out):
    return ["--data", str(data["seg"]), "--out", str(out), "--width", "4", "--depth", "2",
            "--voxel-size", "0.2", "--batch-size", "2"]


def losses_count(out):
    return len(losses(out))


# --- resume with another --steps (issue 9, item 4) -----------------------------------------------
def test_resume_with_more_steps_continues_the_cosine(data, tmp_path):
    train(tiny(data, tmp_path, "--steps", "4", "--lr", "0.01"))
    said: list[str] = []
    res = Trainer(tiny(data, tmp_path, "--steps", "8", "--lr", "0.01", "--resume", "auto"),
                  MPI.COMM_SELF, log=said.append).run()
    assert res["step"] == 8
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")}
    assert sorted(lrs) == list(range(1, 9))
    # Steps 5..8 follow the cosine over 8 steps (not the old one's final rate of 0).
    new = LrSchedule("cosine", 8)
    assert [lrs[s] for s in range(5, 9)] == [0.01 * new(s - 1) for s in range(5, 9)]
    assert min(lrs[s] for s in range(5, 9)) > 0
    banner = " ".join(said)
    assert "the checkpoint's run planned cosine over 4 steps" in banner
    assert "cosine over 8 steps" in banner and "step 5 runs at lr 0.005" in banner
    assert state(tmp_path)["scheduler"]["lr_lambdas"][0]["total"] == 8


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
def test_a_failed_config_write_leaves_no_metrics_log_open(data, tmp_path):
    (tmp_path / "config.json").mkdir()  # config.json cannot be written
    with pytest.raises(SetupError, match="cannot write the run configuration") as info:
        Trainer(tiny(data, tmp_path, "--steps", "1"), MPI.COMM_SELF, log=None)
    # While the error (and its frames) is still held: nothing holds metrics.jsonl open.
    assert info.value is not None
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not [p for p in opened if p == str(tmp_path / "metrics.jsonl")]  # (this run's)


def test_resume_takes_the_current_weight_decay(data, tmp_path):
    """The optimizer's state from the checkpoint brings its settings with it; the current
    --weight-decay replaces the saved one (as the learning rate does), with a note."""
    train(tiny(data, tmp_path, "--steps", "2", "--weight-decay", "0.0001"))
    said: list[str] = []
    t = Trainer(tiny(data, tmp_path, "--steps", "3", "--weight-decay", "0.5", "--resume", "auto"),
                MPI.COMM_SELF, log=said.append)
    try:
        assert [g["weight_decay"] for g in t.optimizer.param_groups] == [0.5]
        assert "weight decay from the current options: 0.5; the checkpoint's run used 0.0001" \
            in " ".join(said)
    finally:
        t.close()


def test_resume_in_another_precision_says_so(data, tmp_path):
    train(tiny(data, tmp_path, "--steps", "2", "--precision", "bf16"))
    said: list[str] = []
    t = Trainer(tiny(data, tmp_path, "--steps", "3", "--resume", "auto"), MPI.COMM_SELF,
                log=said.append)
    try:
        assert "the checkpoint's run trained in bf16, this one in fp32" in " ".join(said)
    finally:
        t.close()


# --- temporary files, manifest (issue 9, item 7 and "checkpoint manifest") -----------------------
def test_start_removes_temp_files_left_by_a_killed_save(data, tmp_path):
    """A process SIGKILLed inside torch.save leaves .last.pt.tmp-<pid>; the next start removes
    it (and only files named like ours)."""
    out = tmp_path / "run"
    script = (
        "import os, signal, torch\n"
        "from sparsepipe_hpc.train import checkpoint as ck\n"
        "def dying_save(obj, f, *a, **k):\n"
        "    f.write(b'PK' + bytes(1 << 20)); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "torch.save = dying_save\n"
        f"ck.atomic_save({{'step': 1}}, {str(out / 'last.pt')!r})\n")
    env = repo_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in out.iterdir()]  # what the killed save left behind, for ever (before)
    assert len(left) == 1 and left[0].startswith(".last.pt.tmp-") and left[0][13:].isdigit()
    assert (out / left[0]).stat().st_size > 1 << 20
    (out / ".last.pt.tmp-mine").write_bytes(b"not ours")
    said: list[str] = []
    Trainer(tiny(data, out, "--steps", "1"), MPI.COMM_SELF, log=said.append)
    assert sorted(p.name for p in out.iterdir()) == [".last.pt.tmp-mine", "config.json",
                                                     "metrics.jsonl"]
    assert any(f"removed 1 temporary file(s) left in {out}" in m and left[0] in m for m in said)


def test_manifest_records_and_verifies_the_checkpoint(data, tmp_path):
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    path = tmp_path / "a" / "last.pt"
    manifest = json.loads(ck.manifest_path(path).read_text())
    cur = manifest["current"]
    assert manifest["format"] == ck.MANIFEST_FORMAT and manifest["checkpoint"] == "last.pt"
    assert cur["step"] == 2 and cur["total_steps"] == 2 and cur["config"]["width"] == 4
    assert cur["layout"]["world_size"] == 1 and cur["layout"]["grid"] == [1, 1, 1]
    assert "torch" in cur["versions"] and "mpi" in cur["versions"]
    good = path.read_bytes()
    assert cur["files"]["last.pt"] == {"bytes": len(good),
                                       "sha256": hashlib.sha256(good).hexdigest()}
    assert ck.load_checkpoint(path)["manifest"] == cur

    def resume():
        return Trainer(tiny(data, tmp_path / "b", "--steps", "3", "--resume", str(path)),
                       MPI.COMM_SELF, log=None)

    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF  # one bit-rotted byte inside the weights: torch loads it
    path.write_bytes(flipped)
    with pytest.raises(SetupError, match=r"last.pt: the file does not match its manifest .*"
                                         r"manifest.json \(step 2\): its contents changed"):
        resume()
    path.write_bytes(good[: len(good) // 3])
    with pytest.raises(SetupError, match=rf"truncated: {len(good) // 3:,} of the {len(good):,} "
                                         r"bytes recorded"):
        resume()
    path.write_bytes(good)
    assert resume().run()["step"] == 3


def test_crash_between_manifest_and_rename_leaves_a_loadable_checkpoint(data, tmp_path,
                                                                      monkeypatch):
    from sparsepipe_hpc.train import output

    train(tiny(data, tmp_path, "--steps", "2"))
    real_commit = output.commit

    def killed_before_rename(tmp, path, what):
        if Path(path).name == "last.pt":
            raise KeyboardInterrupt("killed between the manifest and the rename")
        return real_commit(tmp, path, what)

    monkeypatch.setattr(output, "commit", killed_before_rename)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(data, tmp_path, "--steps", "4", "--resume", "auto"))
    monkeypatch.setattr(output, "commit", real_commit)
    manifest = json.loads(ck.manifest_path(tmp_path / "last.pt").read_text())
    assert manifest["current"]["step"] == 4 and manifest["previous"]["step"] == 2
    assert ck.load_checkpoint(tmp_path / "last.pt")["step"] == 2  # the old file, still accepted
    assert any(p.name.startswith(".last.pt.tmp-") for p in tmp_path.iterdir())
    # Killed at the same place again, resumed from step 2: "previous" must name what is on disk
    # (step 2), not the step-4 entry whose file never landed.
    monkeypatch.setattr(output, "commit", killed_before_rename)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(data, tmp_path, "--steps", "3", "--resume", "auto"))
    monkeypatch.setattr(output, "commit", real_commit)
    manifest = json.loads(ck.manifest_path(tmp_path / "last.pt").read_text())
    assert manifest["current"]["step"] == 3 and manifest["previous"]["step"] == 2
    assert ck.load_checkpoint(tmp_path / "last.pt")["step"] == 2
    assert train(tiny(data, tmp_path, "--steps", "3", "--resume", "auto"))["step"] == 3
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_a_setup_that_fails_after_the_context_frees_what_it_built(data, tmp_path, monkeypatch):
    """An agreed setup error after the communicators exist (here the run directory, the last
    step of setup) closes the context, pipelines and data files before it propagates, so a
    caller that goes on keeps none of them."""
    from sparsepipe_hpc.parallel.context import ParallelContext

    closed = []
    real = ParallelContext.close
    monkeypatch.setattr(ParallelContext, "close", lambda self: closed.append(self) or real(self))
    (tmp_path / "file").write_text("x")
    with pytest.raises(SetupError, match=r"file is a file, not a directory"):
        Trainer(tiny(data, tmp_path / "file" / "run", "--micro-batches", "2"), MPI.COMM_SELF,
                log=None)
    assert len(closed) == 1
    with pytest.raises(RuntimeError, match="used after close"):
        closed[0].global_count(1)


# --- --out that cannot take the run (issue 9, item 6) ---------------------------------------------
def test_out_not_writable_or_too_full_is_refused_before_step_1(data, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SetupError, match=r"--out .*file/run: .*file is a file, not a directory"):
        Trainer(tiny(data, tmp_path / "file" / "run"), MPI.COMM_SELF, log=None)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 30, (1 << 30) - 1000, 1000))
    with pytest.raises(SetupError, match=r"--out .*run: its file system has 1000 bytes free, but "
                                         r"a checkpoint of this model needs about \d"):
        Trainer(tiny(data, tmp_path / "run"), MPI.COMM_SELF, log=None)


def test_checkpoint_write_failure_is_a_clear_error(data, tmp_path, monkeypatch):
    trainer = Trainer(tiny(data, tmp_path, "--steps", "2"), MPI.COMM_SELF, log=None)
    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        if isinstance(f, io.BytesIO):  # pickling a tensor (the RNG-state gather) uses torch.save
            return real_save(obj, f, *a, **k)
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SetupError, match=rf"cannot write the checkpoint {tmp_path}/last.pt: "
                                         r"RuntimeError: .*unexpected pos"):
        trainer.run()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "metrics.jsonl"]


def test_metrics_write_failure_stops_the_run(data, tmp_path):
    trainer = Trainer(tiny(data, tmp_path, "--steps", "8", "--checkpoint-every", "0"),
                      MPI.COMM_SELF, log=None)
    trainer.metrics._file = FillsUp(trainer.metrics._file, ok=2)
    with pytest.raises(OutputError, match=rf"cannot write the metrics log {tmp_path}/metrics.jsonl"
                                          r": OSError: \[Errno 28\]"):
        trainer.run()
    assert trainer.step == 4  # step 3's record failed; step 4's agreement stopped every rank


# --- bad data, found before step 1 (issue 9, items 5 and 6) ---------------------------------------
def bad_copy(data, tmp_path, split, edit):
    d = tmp_path / "data"
    shutil.copytree(data["seg"], d)
    with h5py.File(d / f"{split}.h5", "r+") as f:
        edit(f)
    return d


def swap_classes(f):
    names = [n.decode() if isinstance(n, bytes) else n for n in f.attrs["class_names"]]
    names[1], names[2] = names[2], names[1]
    f.attrs["class_names"] = np.array(names, dtype=h5py.string_dtype())


def stale_bounds(f):
    hi = f.attrs["bounds_max"]
    hi[0] -= 0.3
    f.attrs["bounds_max"] = hi


def outlier(f):
    g = f["scenes"][sorted(f["scenes"])[1]]
    for key, extra in (("xyz", [[5000.0, 1.0, 1.0]]), ("label", [0]), ("rgb", [[1, 2, 3]])):
        values = np.concatenate([g[key][()], np.asarray(extra, dtype=g[key].dtype)])
        del g[key]
        g.create_dataset(key, data=values)
    hi = f.attrs["bounds_max"]
    hi[0] = 5000.0
    f.attrs["bounds_max"] = hi


@pytest.mark.parametrize("split, edit, voxel, words", [
    ("val", swap_classes, "0.2", ["train.h5", "val.h5", "'class_names'", "another order"]),
    ("train", stale_bounds, "0.2", ["train.h5", "outside the box of the root attributes", "stale"]),
    ("train", outlier, "0.05", ["train.h5", "x = 5000 m in scene 'room_0001'", "--voxel-size"]),
    ("train", lambda f: None, "0.00005", ["65536 voxels per axis", "--voxel-size"]),
])
def test_bad_data_is_refused_before_step_1(data, tmp_path, split, edit, voxel, words):
    d = bad_copy(data, tmp_path, split, edit)
    cfg = parse_config(["--data", str(d), "--out", str(tmp_path / "o"), "--width", "4",
                        "--depth", "2", "--voxel-size", voxel, "--batch-size", "2",
                        "--no-progress", "--steps", "2"])
    with pytest.raises(SetupError) as info:
        Trainer(cfg, MPI.COMM_SELF, log=None)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_cli_outlier_exits_2_before_training(data, tmp_path):
    d = bad_copy(data, tmp_path, "train", outlier)
    proc = run_cli(tiny_args({"seg": d}, tmp_path / "o")[:-4] + [
        "--voxel-size", "0.05", "--batch-size", "2", "--steps", "2", "--no-progress"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.startswith("sparsepipe_hpc.train: error: the points span") and "Traceback" not in err
    assert "room_0001" in err and "--voxel-size" in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()  # refused before step 1


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(data, tmp_path):
    """--depth 12 doubles the channels twelve times (110 GiB of weights): the trainer measures
    the model on the meta device first and stops with the sizes, where it used to be killed by
    the kernel while building it; a model that fits is not affected."""
    from sparsepipe_hpc.nn import build_model
    from sparsepipe_hpc.train.agreement import check_model_fits, free_memory

    cfg = tiny(data, tmp_path / "a", "--depth", "12")
    with torch.device("meta"):
        probe = build_model("unet", 3, 5, width=4, depth=12)
    with pytest.raises(SetupError, match=r"--depth 12 has [\d,]+ parameters: .* GiB for its "
                                         r"float32 weights, gradients and adamw's state \(4x the "
                                         r"weights\), .* use a smaller --width or --depth"):
        check_model_fits(probe, cfg, 2**30)
    check_model_fits(probe, cfg, None)  # unknown free memory: no verdict
    with torch.device("meta"):
        small = build_model("unet", 3, 5, width=4, depth=2)
    check_model_fits(small, cfg, 2**30)
    # The whole state counts, not the weights alone (--depth 10: 6.9 GiB of weights, 27.6 GiB
    # with AdamW's, which the kernel killed on a 24 GiB machine), and a node's CPU ranks share.
    weights = 4 * sum(p.numel() for p in small.parameters())
    with pytest.raises(SetupError, match="4x the weights"):
        check_model_fits(small, cfg, 3 * weights)
    check_model_fits(small, cfg, 4 * weights)
    with pytest.raises(SetupError, match=r"free for each of its 2 ranks"):
        check_model_fits(small, cfg, 4 * weights, ranks_sharing=2)
    staged = tiny(data, tmp_path / "s", "--stages", "2")  # a rank holds one stage's part
    check_model_fits(small, staged, weights)
    assert free_memory(torch.device("cpu")) is None or free_memory(torch.device("cpu")) > 0
    # Depth 14: 1.7 TiB of weights, more than any machine here (GPU or host) has free.
    with pytest.raises(SetupError, match="--depth 14 has"):
        Trainer(tiny(data, tmp_path / "b", "--depth", "14"), MPI.COMM_SELF, log=None)


def test_a_batch_too_small_for_batchnorm_is_a_setup_error_naming_the_fix(tmp_path):
    """A one-point scene at --batch-size 1 gives BatchNorm one voxel: every rank shares the
    statistics, so the trainer reports it (the step, the samples, what to change) as a user
    error, not a traceback."""
    from sparsepipe_hpc.data.scenes import write_scenes

    rng = np.random.default_rng(0)
    scenes = [(f"s{i}", rng.uniform(0, 2, (1, 3)), None, np.zeros(1, int)) for i in range(2)]
    root = tmp_path / "one"
    root.mkdir()
    write_scenes(root / "train.h5", scenes, ["a", "b"])
    write_scenes(root / "val.h5", scenes, ["a", "b"])
    cfg = parse_config(["--data", str(root), "--out", str(tmp_path / "run"), "--width", "4",
                        "--depth", "2", "--batch-size", "1", "--steps", "1", "--no-progress"])
    with pytest.raises(SetupError, match=r"^step 1: BatchNorm in training needs at least 2 "
                                         r"voxels .* got 1 .*training split indices \[\d\]\) are "
                                         r"too small .* use a larger --batch-size"):
        Trainer(cfg, MPI.COMM_SELF, log=None).run()
    # With stages the stage that fails is alone (the others wait for its messages): the job
    # aborts, with the same message, instead of hanging.
    from test_mpi import mpi_env, mpirun_command, run_bounded
    proc = run_bounded(mpirun_command(2) + [
        sys.executable, "-m", "sparsepipe_hpc.train", "--data", str(root), "--out",
        str(tmp_path / "staged"), "--width", "4", "--depth", "2", "--batch-size", "1", "--steps",
        "1", "--no-progress", "--stages", "2"], 120, env=repo_env(mpi_env()))
    assert proc.returncode != 0
    assert "too small for this model" in proc.stderr and "aborting all 2 ranks" in proc.stderr
    fewer = parse_config(["--data", str(root), "--out", str(tmp_path / "run2"), "--width", "4",
                          "--depth", "2", "--batch-size", "3", "--steps", "1", "--no-progress"])
    with pytest.raises(SetupError, match=r"the training split .*train.h5.* has 2 sample\(s\), "
                                         r"fewer than one global batch \(--batch-size 3\)"):
        Trainer(fewer, MPI.COMM_SELF, log=None)


def test_a_balance_that_does_not_fit_the_model_is_refused_without_a_pipeline(data, tmp_path):
    """--balance with one stage and one micro-batch builds no pipeline, but a block count that
    is not the model's is still a mistake to name (it was silently ignored)."""
    with pytest.raises(SetupError, match="--balance 3 sums to 3 but the model has 6 blocks"):
        Trainer(tiny(data, tmp_path / "a", "--balance", "3"), MPI.COMM_SELF, log=None)
    Trainer(tiny(data, tmp_path / "b", "--balance", "6"), MPI.COMM_SELF, log=None).close()


def test_the_log_holds_each_step_once_across_stops_requeues_and_reruns(data, tmp_path):
    """A stop right after an eval step's training (before its eval) gets the eval when resumed;
    a finished run resumed logs no second final eval; a requeued --resume auto job that died
    before its first checkpoint starts the log again (it appended to the dead run's)."""
    opts = ("--steps", "4", "--eval-every", "2", "--lr", "0.01")
    train(tiny(data, tmp_path / "a", *opts))
    holder = {}
    stopper = Trainer(tiny(data, tmp_path / "b", *opts), MPI.COMM_SELF, log=None,
                      should_stop=lambda: holder["t"].step >= 2)
    holder["t"] = stopper
    assert stopper.run()["stopped"]
    said: list[str] = []
    train(tiny(data, tmp_path / "b", *opts, "--resume", "auto"))  # the eval at step 2 first
    records = [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert records == [("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4),
                       ("eval", 4)]
    assert read_metrics(tmp_path / "b" / "metrics.jsonl", "eval") == \
        read_metrics(tmp_path / "a" / "metrics.jsonl", "eval")
    res = Trainer(tiny(data, tmp_path / "b", *opts, "--resume", "auto"), MPI.COMM_SELF,
                  log=said.append).run()  # finished: nothing to train, the eval once
    assert res["eval"] is not None
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] \
        == records
    # A run that left records but no checkpoint, requeued with --resume auto: one log again.
    dead = tmp_path / "c"
    dead.mkdir()
    (dead / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n'
                                        '{"kind": "train", "step": 2, "lo')
    said.clear()
    Trainer(tiny(data, dead, *opts, "--resume", "auto"), MPI.COMM_SELF, log=said.append).run()
    assert [r["step"] for r in read_metrics(dead / "metrics.jsonl", "train")] == [1, 2, 3, 4]
    assert losses(dead) == losses(tmp_path / "a")
    assert any("held the records of an earlier run" in s for s in said)


def test_resume_refuses_other_micro_batches(data, tmp_path):
    train(tiny(data, tmp_path / "a", "--steps", "1", "--micro-batches", "2"))
    with pytest.raises(SetupError, match=r"other options \(--micro-batches 2 -> 1\)"):
        Trainer(tiny(data, tmp_path / "a", "--steps", "2", "--resume", "auto"), MPI.COMM_SELF,
                log=None)


def test_a_plans_balance_for_another_model_names_the_plan():
    import dataclasses

    from sparsepipe_hpc.pipeline.carry import PipelineError
    from sparsepipe_hpc.train.loop import _check_balance

    cfg = parse_config(["--width", "4", "--depth", "3"])
    _check_balance(dataclasses.replace(cfg, balance="5,3"), 8)
    with pytest.raises(SetupError, match=r"--plan p\.json sets --balance 5,1, for a model of 6 "
                                         r"blocks, but --model unet --width 4 --depth 3 has 8: "
                                         r"make the plan for this model"):
        _check_balance(dataclasses.replace(cfg, balance="5,1", plan="p.json"), 8)
    with pytest.raises(PipelineError, match="--balance 5,1 sums to 6 but the model has 8"):
        _check_balance(dataclasses.replace(cfg, balance="5,1"), 8)
