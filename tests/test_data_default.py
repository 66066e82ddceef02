"""default_data: made once into the cache and reused; under MPI made by rank 0 only, and a failure
there raises on every rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from launch.env import prefer_shared_memory
from sparsepipe_hpc.data import DataGenerationError, ModelNetDataset, SceneDataset, default
from sparsepipe_hpc.data import default_data

torch.set_num_threads(1)

SMALL = dict(train_scenes=2, val_scenes=1, train_objects=12, test_objects=6, points_per_object=64)


@pytest.fixture
def counted(monkeypatch):
    """Count the generator's runs."""
    calls = []
    real = default._generate

    def spy(params, out):
        calls.append(params["task"])
        real(params, out)

    monkeypatch.setattr(default, "_generate", spy)
    return calls


def test_made_once_then_reused(tmp_path, counted):
    seg = default_data("seg", cache_dir=tmp_path, **SMALL)
    assert counted == ["seg"]
    assert seg.name == "scenes" and (seg / "train.h5").is_file() and (seg / "val.h5").is_file()
    params = json.loads((seg.parent / "params.json").read_text())
    assert params["train"] == 2 and params["generator_version"] >= 1
    assert len(SceneDataset(seg, "train")) == 2 and len(SceneDataset(seg, "val")) == 1
    mtime = (seg / "train.h5").stat().st_mtime_ns
    assert default_data("seg", cache_dir=tmp_path, **SMALL) == seg
    assert counted == ["seg"] and (seg / "train.h5").stat().st_mtime_ns == mtime
    # Another parameter is another entry; no temporary directory is left behind.
    other = default_data("seg", cache_dir=tmp_path, **{**SMALL, "val_scenes": 2})
    assert other != seg and counted == ["seg", "seg"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cls_and_env_cache(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("SPARSEPIPE_CACHE", str(tmp_path / "env"))
    cls = default_data("cls", **SMALL)
    assert cls.parent.parent == tmp_path / "env" and cls.name == "modelnet"
    train, test = ModelNetDataset(cls, "train"), ModelNetDataset(cls, "test")
    assert (len(train), len(test), train.num_classes) == (12, 6, 6)
    assert default_data("cls", **SMALL) == cls and counted == ["cls"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="task must be 'seg' or 'cls'"):
        default_data("both", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="train must be >= 1; got 0"):
        default_data("seg", cache_dir=tmp_path, train_scenes=0)


def test_serial_comm(tmp_path, counted):
    from mpi4py import MPI

    path = default_data("seg", comm=MPI.COMM_SELF, cache_dir=tmp_path, **SMALL)
    assert (path / "train.h5").is_file() and counted == ["seg"]


def test_generation_failure_leaves_no_entry(tmp_path, monkeypatch):
    def boom(params, out):
        (out / "partial.h5").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(default, "_generate", boom)
    with pytest.raises(DataGenerationError, match="disk full"):
        default_data("seg", cache_dir=tmp_path, **SMALL)
    assert list(tmp_path.iterdir()) == []


class FakeComm:
    """A stand-in for one rank of a 2-rank communicator whose collectives return ``answers``."""

    def __init__(self, rank, bcast_answer=None, seen=(True, True)):
        self.rank, self.bcast_answer, self.seen = rank, bcast_answer, seen
        self.sent = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def bcast(self, obj, root=0):
        self.sent.append(obj)
        return obj if self.rank == root else self.bcast_answer

    def allgather(self, obj):
        return list(self.seen)


def test_rank0_failure_is_broadcast(tmp_path, monkeypatch):
    def boom(params, out):
        raise RuntimeError("generator crashed")

    monkeypatch.setattr(default, "_generate", boom)
    comm = FakeComm(0)
    with pytest.raises(DataGenerationError, match="failed on rank 0 of 2.*generator crashed"):
        default_data("seg", comm=comm, cache_dir=tmp_path, **SMALL)
    assert comm.sent == [(False, "RuntimeError: generator crashed")]
    # What rank 1 does with that message: raise too, without generating anything.
    monkeypatch.setattr(default, "_generate", lambda *a: pytest.fail("rank 1 generated"))
    with pytest.raises(DataGenerationError, match="generator crashed"):
        default_data("seg", comm=FakeComm(1, comm.sent[0]), cache_dir=tmp_path, **SMALL)


def test_other_ranks_wait_for_rank0_path(tmp_path, monkeypatch, counted):
    made = default_data("seg", cache_dir=tmp_path, **SMALL)
    assert default_data("seg", comm=FakeComm(1, (True, str(made))), cache_dir="/nonexistent",
                        **SMALL) == made
    with pytest.raises(DataGenerationError, match=r"rank\(s\) \[1\] cannot see"):
        default_data("seg", comm=FakeComm(0, seen=(True, False)), cache_dir=tmp_path, **SMALL)
    assert counted == ["seg"]


SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mpi4py import MPI
    import torch
    torch.set_num_threads(1)
    from sparsepipe_hpc.data import default, default_data, DataGenerationError
    comm = MPI.COMM_WORLD
    calls = []
    real = default._generate
    default._generate = lambda p, o: (calls.append(1), real(p, o))
    small = dict(train_scenes=2, val_scenes=1)
    path = default_data("seg", comm, cache_dir=sys.argv[1], **small)
    print(f"rank {comm.rank} path {path} generated {len(calls)}", flush=True)
    try:
        default_data("seg", comm, cache_dir=sys.argv[2], **small)
    except DataGenerationError as e:
        print(f"rank {comm.rank} raised {e}", flush=True)
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_under_mpirun(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")  # rank 0 cannot make a cache here
    cmd = ["mpirun", "-n", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prefer_shared_memory(env)  # the shared-memory transport under this Open MPI's name for it
    proc = subprocess.run(cmd + [sys.executable, str(script), str(tmp_path / "cache"),
                                 str(blocked)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(proc.stdout.splitlines())
    paths = {line.split()[3] for line in lines if " path " in line}
    assert len(paths) == 1
    assert sorted(line.split()[-1] for line in lines if " path " in line) == ["0", "1"]
    raised = [line for line in lines if " raised " in line]
    assert len(raised) == 2 and all("failed on rank 0 of 2" in line for line in raised), lines
