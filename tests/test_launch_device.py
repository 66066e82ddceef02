"""launch.device: round-robin GPU choice by local rank, respecting CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import launch.device
from launch.device import (gpu_for_local_rank, gpu_uuid, physical_gpu, ranks_per_gpu, select_gpu,
                           visible_devices, visible_gpu_count)
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


class _Comm:
    """An allgather that answers ``everyone`` (what all ranks sent) and keeps this rank's value."""

    def __init__(self, everyone=()):
        self.everyone, self.mine = list(everyone), None

    def allgather(self, value):
        self.mine = value
        return self.everyone or [value]


def _gpu_names(monkeypatch, ranks, hosts=None):
    """What each rank of ``ranks`` [(its GPU's UUID or None, its CUDA_VISIBLE_DEVICES, its
    device index)], on ``hosts`` (default one), sends to ranks_per_gpu's allgather."""
    sent = []
    for (uuid, visible, index), host in zip(ranks, hosts or ["n0"] * len(ranks)):
        monkeypatch.setattr(launch.device, "gpu_uuid", lambda i, u=uuid: u)
        monkeypatch.setattr(launch.device.socket, "gethostname", lambda h=host: h)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        comm = _Comm()
        ranks_per_gpu(comm, index)
        sent.append(comm.mine)
    return sent


def test_ranks_per_gpu_tells_own_gpus_from_a_shared_one(monkeypatch):
    # srun --gpus-per-task=1 with per-task device cgroups: every rank sees its GPU as "0".
    own = _gpu_names(monkeypatch, [("GPU-a", "0", 0), ("GPU-b", "0", 0), ("GPU-c", "0", 0)])
    assert ranks_per_gpu(_Comm(own), 0) == 1
    # mpirun, 4 ranks round-robin on 2 visible GPUs of one node.
    two = _gpu_names(monkeypatch, [("GPU-a", "0,1", 0), ("GPU-b", "0,1", 1),
                                   ("GPU-a", "0,1", 0), ("GPU-b", "0,1", 1)])
    assert ranks_per_gpu(_Comm(two), 0) == 2
    # No UUID from torch: host and CUDA_VISIBLE_DEVICES entry name the GPU.
    named = _gpu_names(monkeypatch, [(None, "4,5", 0), (None, "4,5", 1), (None, "5", 0)])
    assert named[1] == named[2] != named[0]
    assert ranks_per_gpu(_Comm(named), 0) == 2
    # ... and GPU "0" of two nodes are two GPUs.
    nodes = _gpu_names(monkeypatch, [(None, "0", 0)] * 2, hosts=["n0", "n1"])
    assert ranks_per_gpu(_Comm(nodes), 0) == 1


def test_ranks_per_gpu_without_a_gpu_counts_ranks_per_node(monkeypatch):
    on_node = _gpu_names(monkeypatch, [(None, "", None)] * 3)
    assert ranks_per_gpu(_Comm(on_node), None) == 3


def test_gpu_uuid_is_none_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the UUID is real")
    assert gpu_uuid(0) is None


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
