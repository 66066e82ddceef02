"""launch.device: round-robin GPU choice by local rank, respecting CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.device import (gpu_for_local_rank, physical_gpu, select_gpu, visible_devices,
                           visible_gpu_count)
from launch.env import Placement

REPO = Path(__file__).resolve().parent.parent


def _placement(local_rank, local_size=8):
    return Placement(rank=local_rank, size=local_size, local_rank=local_rank,
                     local_size=local_size, node="n", launcher="openmpi")


def test_one_gpu_per_rank_when_ranks_equal_gpus():
    assert [select_gpu(_placement(r, 4), count=4) for r in range(4)] == [0, 1, 2, 3]


def test_round_robin_when_ranks_outnumber_gpus():
    assert [select_gpu(_placement(r), count=4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_scheduler_gave_each_rank_its_own_gpu():
    # srun --gpus-per-task=1: one visible device per rank, so every rank takes index 0.
    assert [select_gpu(_placement(r), count=1) for r in range(8)] == [0] * 8


def test_no_gpu_is_none():
    assert select_gpu(_placement(3), count=0) is None
    assert gpu_for_local_rank(0, 0) is None


def test_negative_inputs_rejected():
    with pytest.raises(ValueError, match="-1"):
        gpu_for_local_rank(-1, 4)


@pytest.mark.parametrize("value, entries", [
    ("0,1,2,3", ["0", "1", "2", "3"]), ("2, 3", ["2", "3"]), ("", []), ("-1", []),
    ("1,-1,3", ["1"]), ("NoDevFiles", []),
    ("GPU-8d1c2f6e-aaaa-bbbb-cccc-0123456789ab,1",
     ["GPU-8d1c2f6e-aaaa-bbbb-cccc-0123456789ab", "1"]),
    ("MIG-GPU-8d1c2f6e/1/0", ["MIG-GPU-8d1c2f6e/1/0"]),
])
def test_visible_devices_parse_like_cuda(value, entries):
    assert visible_devices(value) == entries


def test_visible_devices_unset(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices() is None


def test_empty_visible_devices_means_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0
    assert select_gpu(_placement(0)) is None


def test_physical_gpu_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [physical_gpu(i) for i in range(4)] == ["4", "5", "6", "7"]
    assert physical_gpu(None) == "-"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu(2) == "2"


def test_count_asks_torch_when_a_driver_is_present(monkeypatch):
    class FakeCuda:
        @staticmethod
        def device_count():
            return 4

    class FakeTorch:
        cuda = FakeCuda

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    assert visible_gpu_count() == 4
    assert select_gpu(_placement(6)) == 2


def _python(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get(
        "PYTHONPATH")])))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO, env=env)


def test_no_driver_means_no_torch_import():
    code = ("import sys; from launch import device; "
            "device._DRIVER_FILES = ('/nonexistent/driver',); "
            "assert device.visible_gpu_count() == 0; assert 'torch' not in sys.modules")
    _python(code)


def test_importing_the_package_imports_neither_torch_nor_mpi():
    code = ("import sys, launch, launch.device, launch.env, launch.run, launch.jobs, launch.info; "
            "bad = [m for m in ('torch', 'cupy', 'mpi4py.MPI') if m in sys.modules]; "
            "assert not bad, bad")
    _python(code)


def test_this_machine_count_is_consistent_with_torch():
    import torch

    assert visible_gpu_count() == torch.cuda.device_count()
