"""The run directory's writers: clear OutputErrors on full/read-only disks; no debris left."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest
import torch

from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train import output
from sparsepipe_hpc.train.metrics import MetricsLog
from sparsepipe_hpc.train.output import OutputError


def test_full_disk_in_torch_save_names_the_checkpoint(tmp_path, monkeypatch):
    """A disk that fills inside torch.save shows up as RuntimeError('... unexpected pos ...')."""
    path = tmp_path / "last.pt"

    def full(obj, f, *a, **k):
        f.write(b"PK\x03\x04 part of a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 30, 1 << 30, 0))
    with pytest.raises(OutputError) as info:
        ck.atomic_save({"step": 1}, path)
    msg = str(info.value)
    assert msg.startswith(f"cannot write the checkpoint {path}: RuntimeError")
    assert "unexpected pos" in msg and "is full (0 bytes free)" in msg and "--out" in msg
    assert list(tmp_path.iterdir()) == []  # the temporary file went with the failure


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "is full"),
                                         (errno.EROFS, "not writable"),
                                         (errno.EACCES, "not writable")])
def test_os_errors_say_why_and_what_to_do(tmp_path, monkeypatch, code, words):
    real_open = open

    def failing_open(file, mode="r", *a, **k):
        if "w" in mode and str(file).startswith(str(tmp_path)):
            raise OSError(code, os.strerror(code), str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(OutputError, match=words) as info:
        output.atomic_write(tmp_path / "config.json", lambda f: f.write(b"{}"),
                            "run configuration")
    assert f"cannot write the run configuration {tmp_path / 'config.json'}" in str(info.value)
    assert isinstance(info.value, OSError)  # the closest builtin: callers catching OSError see it


def test_check_out_dir(tmp_path, monkeypatch):
    output.check_out_dir(tmp_path / "run", need_bytes=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # the probe cleans up
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=r"--out .*file/run: .*file is a file, not a "
                                          r"directory; pass --out with a directory"):
        output.check_out_dir(tmp_path / "file" / "run", need_bytes=1)
    with pytest.raises(OutputError, match=r"file is a file, not a directory"):
        output.check_out_dir(tmp_path / "file", need_bytes=1)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 30, (1 << 30) - 5000, 5000))
    with pytest.raises(OutputError, match=r"--out .*run: its file system has 4.9 KiB free, "
                                          r"but a checkpoint of this model needs about 2.0 MiB"):
        output.check_out_dir(tmp_path / "run", need_bytes=2 << 20)


def test_stale_temps_of_this_run_are_removed_and_nothing_else(tmp_path):
    stale = [".last.pt.tmp-12345", ".last.pt.manifest.json.tmp-7", ".config.json.tmp-99",
             ".metrics.jsonl.tmp-3"]
    keep = ["last.pt", ".last.pt.tmp-abc", ".last.pt.tmp-", ".other.pt.tmp-12", "notes.txt",
            "last.pt.tmp-5", ".last.pt.tmp-12.bak"]
    for name in stale + keep:
        (tmp_path / name).write_bytes(b"x" * 10)
    removed = ck.remove_stale_temps(tmp_path)
    assert sorted(p.name for p, _ in removed) == sorted(stale)
    assert all(n == 10 for _, n in removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)
    assert output.parse_temp_name(output.temp_path(tmp_path / "last.pt").name) == \
        ("last.pt", os.getpid())
    assert ck.remove_stale_temps(tmp_path / "missing") == []


def test_metrics_write_failure_is_kept_and_raised_at_sync(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"kind": "train", "step": 1})

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    log._file = Full()
    log.write({"kind": "train", "step": 2})  # does not raise here (rank 0 alone would leave)
    assert log.failed and "metrics log" in str(log.error) and "is full" in str(log.error)
    log.write({"kind": "train", "step": 3})  # a no-op now
    with pytest.raises(OutputError, match=r"cannot write the metrics log .*metrics.jsonl"):
        log.sync()
    with pytest.raises(OutputError):
        log.close()
