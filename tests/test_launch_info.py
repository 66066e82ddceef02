"""launch.info: the per-rank summary, its warnings, and ``python -m launch info`` under mpirun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.env import Placement
from launch.info import compress_cpus, format_line, problems, summary

try:
    from test_mpi import mpi_env, mpirun_command
except ImportError:  # pytest's importlib mode does not put tests/ on sys.path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mpi import mpi_env, mpirun_command

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in list(env):  # a CI runner inside a SLURM job must not leak its step into the test
        if key.startswith(("SLURM", "PBS_", "PALS_", "PMI_", "SPARSEPIPE_THREADS")):
            del env[key]
    return env


@pytest.mark.parametrize("cpus, text", [([], ""), ([3], "3"), ([0, 1, 2, 3], "0-3"),
                                        ([9, 8, 0, 1, 2, 3, 5], "0-3,5,8-9")])
def test_compress_cpus(cpus, text):
    assert compress_cpus(cpus) == text


def _info(rank, node="n1", gpu=None, physical=None, threads=4, cpus=(0, 1, 2, 3), mpi_rank=None):
    return {"rank": rank, "size": 4, "local_rank": rank % 2, "local_size": 2, "node": node,
            "node_index": 0, "launcher": "slurm", "note": "", "mpi_rank": rank if mpi_rank is None
            else mpi_rank, "gpu": gpu, "gpu_physical": physical, "visible_gpus": 2,
            "threads": threads, "cpus": list(cpus), "pid": 100 + rank}


def test_format_line():
    line = format_line(_info(1, gpu=1, physical="GPU-abc"))
    assert line == ("rank 1/4 local 1/2 node n1 (#0) via slurm gpu 1 (physical GPU-abc, 2 visible) "
                    "threads 4 cpus 0-3 pid 101")
    assert " gpu - " in format_line(_info(0))
    assert format_line(_info(0, mpi_rank=2)).endswith("MISMATCH: MPI rank 2")


def test_summary_of_a_placement(monkeypatch):
    monkeypatch.setenv("SPARSEPIPE_THREADS", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    p = Placement(rank=5, size=8, local_rank=1, local_size=4, node="n2", launcher="pals",
                  node_index=1)
    info = summary(p, gpu_count=2)
    assert (info["gpu"], info["gpu_physical"], info["threads"]) == (1, "7", 3)
    assert info["cpus"] == sorted(os.sched_getaffinity(0)) and info["mpi_rank"] == 5
    json.dumps(info)


def test_problems_flags_shared_gpus_oversubscription_and_mismatch():
    good = [_info(0, gpu=0, physical="0", threads=2, cpus=(0, 1)),
            _info(1, gpu=1, physical="1", threads=2, cpus=(2, 3))]
    assert problems(good) == []
    shared = [_info(0, gpu=0, physical="0"), _info(1, gpu=0, physical="0")]
    assert any("GPU 0 is shared by ranks [0, 1]" in p for p in problems(shared))
    busy = [_info(0, threads=4, cpus=(0, 1)), _info(1, threads=4, cpus=(0, 1))]
    assert any("8 threads on 2 cores" in p for p in problems(busy))
    assert any("MPI rank 3" in p for p in problems([_info(0, mpi_rank=3)]))


def test_problems_tell_gpus_apart_by_uuid_and_report_notes():
    own = [_info(r, gpu=0, physical="0", threads=1) | {"gpu_uuid": f"GPU-{r}"} for r in range(4)]
    assert problems(own) == []  # srun --gpus-per-task=1: each rank's own GPU is its device 0
    same = [_info(r, gpu=0, physical="0", threads=1) | {"gpu_uuid": "GPU-a"} for r in range(2)]
    assert problems(same) == ["node n1: GPU GPU-a is shared by ranks [0, 1]"]
    noted = _info(0) | {"note": "slurm variables say world size 4, the communicator has 2"}
    assert problems([noted]) == [f"rank 0: {noted['note']}"]


def test_info_alone(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch", "info"], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 0/1 local 0/1 ")


def test_info_under_mpirun_prints_one_line_per_rank_in_order(tmp_path):
    proc = subprocess.run(mpirun_command(3) + [sys.executable, "-m", "launch", "info"],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [re.match(r"rank (\d+)/3 ", line).group(1) for line in lines] == ["0", "1", "2"]
    assert all(" via openmpi " in line and "MISMATCH" not in line for line in lines)
    local = sorted(int(re.search(r" local (\d+)/3 ", line).group(1)) for line in lines)
    assert local == [0, 1, 2]


def test_info_json_under_mpirun(tmp_path):
    proc = subprocess.run(mpirun_command(2) + [sys.executable, "-m", "launch", "info", "--json"],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [i["rank"] for i in infos] == [0, 1] == [i["mpi_rank"] for i in infos]
    assert len({i["pid"] for i in infos}) == 2
