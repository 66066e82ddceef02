"""Data-parallel training on n ranks equals the single-process run with the same global batch.

Runs on every rank at once (``tests/test_mpi.py`` starts it under ``mpirun -n 1..4``). Each rank
trains in-process over COMM_WORLD, then repeats the run alone over COMM_SELF, and compares.

The comparison uses SGD: the summed gradients equal the single-process ones to float rounding, and
SGD carries that rounding into the parameters unchanged. AdamW divides by sqrt(v), so a gradient
entry that is zero up to rounding (the first convolution on constant features, followed by
BatchNorm, has such directions) becomes a full +-lr step whose sign is the rounding noise.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from helpers import FillsUp

from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import parse_config
from sparsepipe_hpc.train.loop import SetupError, Trainer
from sparsepipe_hpc.train.metrics import read_metrics
from sparsepipe_hpc.train.output import OutputError

GLOBAL_BATCH = {"seg": 12, "cls": 12}  # divisible by 1, 2, 3 and 4 ranks


@pytest.fixture(scope="module")
def shared(shared_data) -> Path:
    """A directory every rank sees (rank 0's temp dir), holding tiny data made by rank 0."""
    return shared_data(scenes=dict(train=12, val=3, seed=1, objects=(2, 4), points=(1200, 2000)),
                       objects=dict(train=24, test=6, points=64, seed=1))


def config(shared: Path, out: Path, task: str, *extra: str):
    return parse_config([
        "--task", task, "--data", str(shared / ("scenes" if task == "seg" else "modelnet")),
        "--out", str(out), "--width", "4", "--depth", "2", "--steps", "3", "--lr", "0.05",
        "--optimizer", "sgd",
        "--voxel-size", "0.25" if task == "seg" else "0.3", "--batch-size",
        str(GLOBAL_BATCH[task]), "--no-progress", *extra])


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("task", ["seg", "cls"])
def test_data_parallel_equals_single_process(comm, shared, tmp_path, task):
    if GLOBAL_BATCH[task] % comm.size:
        pytest.skip(f"global batch {GLOBAL_BATCH[task]} does not split over {comm.size} ranks")
    out = shared / f"dp-{task}-{comm.size}"
    # The replicas read each next batch ahead on a worker thread (--prefetch), the single
    # process in line: the same batches either way, while MPI runs on the main thread.
    multi = Trainer(config(shared, out, task, "--prefetch"), comm, log=None)
    assert multi.ctx.num_replicas == comm.size
    res_multi = multi.run()
    single = Trainer(config(shared, tmp_path / "single", task), MPI.COMM_SELF, log=None)
    res_single = single.run()

    curve_single = [r["loss"] for r in read_metrics(tmp_path / "single" / "metrics.jsonl",
                                                     "train")]
    # Every rank reports the same global loss; rank 0 wrote it.
    curve_multi = comm.bcast([r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
                             if comm.rank == 0 else None)
    assert len(curve_multi) == len(curve_single) == 3
    assert curve_multi == pytest.approx(curve_single, rel=1e-5, abs=1e-6)
    p_multi, p_single = params(multi), params(single)
    for k in p_single:
        assert torch.allclose(p_multi[k].double(), p_single[k].double(), rtol=1e-4, atol=1e-5), k
    # Ranks hold identical replicas (gradients are summed, not left to drift).
    flat = torch.cat([v.double().reshape(-1) for v in p_multi.values()])
    all_flat = comm.allgather(flat)
    assert all(torch.equal(all_flat[0], f) for f in all_flat)
    # Evaluation counts every validation sample exactly once, whatever the layout.
    ev_m, ev_s = res_multi["eval"], res_single["eval"]
    key = "oa" if task == "seg" else "acc"
    assert ev_m[key] == pytest.approx(ev_s[key], abs=1e-6)
    if task == "seg":
        assert ev_m["voxels"] == ev_s["voxels"]


def test_stop_on_one_rank_stops_all(comm, shared):
    """A stop flag (SIGTERM) raised on the last rank only: every rank checkpoints at the same
    step boundary and leaves run() — none waits in a collective."""
    if GLOBAL_BATCH["seg"] % comm.size:
        pytest.skip("batch does not split")
    out = shared / f"stop-{comm.size}"
    holder: dict[str, Trainer] = {}
    last = comm.size - 1
    trainer = Trainer(config(shared, out, "seg", "--steps", "50"), comm, log=None,
                      should_stop=lambda: comm.rank == last and holder["t"].step >= 2)
    holder["t"] = trainer
    res = trainer.run()
    assert res["stopped"] and res["step"] == 2
    assert ck.load_checkpoint(out / "last.pt")["step"] == 2
    assert len(ck.load_checkpoint(out / "last.pt")["rng"]) == comm.size
    resumed = Trainer(config(shared, out, "seg", "--steps", "3", "--resume", "auto"), comm,
                      log=None)
    assert resumed.step == 2 and resumed.run()["step"] == 3


def test_setup_error_is_raised_on_every_rank(comm, shared, tmp_path):
    """A checkpoint path that exists on rank 0 only fails on every rank, not just the others."""
    bad = tmp_path / "only-here.pt"
    if comm.rank == 0:
        bad.write_bytes(b"not a checkpoint")
    path = comm.bcast(str(bad))
    with pytest.raises(SetupError, match="not a readable checkpoint|no such checkpoint"):
        Trainer(config(shared, shared / f"err-{comm.size}", "seg", "--resume", path), comm,
                log=None)


def test_checkpoint_write_failure_on_rank_0_reaches_every_rank(comm, shared, monkeypatch):
    """Rank 0 alone writes; a full disk there ("unexpected pos" inside torch.save) must end
    every rank with the same clear error, not leave the others in a barrier."""
    if GLOBAL_BATCH["seg"] % comm.size:
        pytest.skip("batch does not split")
    out = shared / f"full-{comm.size}"
    trainer = Trainer(config(shared, out, "seg", "--steps", "2"), comm, log=None)
    if comm.rank == 0:
        real_save = torch.save

        def disk_full(obj, f, *a, **k):
            if isinstance(f, io.BytesIO):  # pickling tensors for MPI also goes through torch.save
                return real_save(obj, f, *a, **k)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

        monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SetupError, match=rf"cannot write the checkpoint {out}/last.pt: "
                                         r"RuntimeError: .*unexpected pos"):
        trainer.run()


def test_metrics_write_failure_on_rank_0_reaches_every_rank(comm, shared):
    if GLOBAL_BATCH["seg"] % comm.size:
        pytest.skip("batch does not split")
    out = shared / f"metrics-full-{comm.size}"
    trainer = Trainer(config(shared, out, "seg", "--steps", "6", "--checkpoint-every", "0"), comm,
                      log=None)
    if comm.rank == 0:
        trainer.metrics._file = FillsUp(trainer.metrics._file, ok=1)
    with pytest.raises(OutputError, match=r"cannot write the metrics log .*metrics.jsonl: "
                                          r"OSError: \[Errno 28\]"):
        trainer.run()
    assert trainer.step == 3  # step 2's record failed on rank 0; step 3's all-reduce told all


def test_corrupt_checkpoint_is_refused_on_every_rank(comm, shared):
    if GLOBAL_BATCH["seg"] % comm.size:
        pytest.skip("batch does not split")
    out = shared / f"corrupt-{comm.size}"
    Trainer(config(shared, out, "seg", "--steps", "1"), comm, log=None).run()
    if comm.rank == 0:
        data = bytearray((out / "last.pt").read_bytes())
        data[len(data) // 2] ^= 0x01
        (out / "last.pt").write_bytes(data)
    comm.Barrier()
    with pytest.raises(SetupError, match=r"last.pt: the file does not match its manifest"):
        Trainer(config(shared, out, "seg", "--steps", "2", "--resume", "auto"), comm, log=None)
