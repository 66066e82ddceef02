"""The training loop on tiny synthetic data: learning, exact resume, checkpoints, stop, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from sparsepipe_hpc.data.synth import generate_objects, generate_scenes
from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import parse_config
from sparsepipe_hpc.train.loop import SetupError, Trainer
from sparsepipe_hpc.train.metrics import read_metrics

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


def test_resume_explicit_path_and_mismatch(data, tmp_path):
    train(tiny(data, tmp_path / "a", "--steps", "2"))
    ckpt = tmp_path / "a" / "last.pt"
    res = train(tiny(data, tmp_path / "c", "--steps", "3", "--resume", str(ckpt)))
    assert res["step"] == 3 and [r["step"] for r in read_metrics(tmp_path / "c" / "metrics.jsonl",
                                                                 "train")] == [3]
    with pytest.raises(SetupError, match=r"other options \(--width 4 -> 8\)"):
        Trainer(tiny(data, tmp_path / "d", "--width", "8", "--resume", str(ckpt)), MPI.COMM_SELF,
                log=None)
    with pytest.raises(SetupError, match="no such checkpoint"):
        Trainer(tiny(data, tmp_path / "d", "--resume", str(tmp_path / "nope.pt")), MPI.COMM_SELF,
                log=None)
    res = train(tiny(data, tmp_path / "e", "--steps", "1", "--resume", "auto"))  # nothing there
    assert res["step"] == 1


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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
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
