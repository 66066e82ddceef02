"""--device and --precision: resolution, errors on every rank, checkpoint state, mixed-precision runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from sparsepipe_hpc.data.synth import generate_scenes
from sparsepipe_hpc.train import checkpoint as ck
from sparsepipe_hpc.train.config import ConfigError, parse_config
from sparsepipe_hpc.train.device import Precision, resolve_device
from sparsepipe_hpc.train.loop import SetupError, Trainer
from sparsepipe_hpc.train.metrics import read_metrics

from helpers import repo_env
from test_mpi import mpi_env, mpirun_command

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    return generate_scenes(root, train=8, val=2, seed=0, objects=(2, 4), points=(1500, 2500))


def tiny(data, out, *extra):
    return parse_config(["--data", str(data), "--out", str(out), "--width", "4", "--depth", "2",
                         "--voxel-size", "0.2", "--batch-size", "2", "--no-progress", *extra])


def losses(out):
    return [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl", "train")]


# --- options -------------------------------------------------------------------------------------
def test_device_and_precision_options_round_trip(tmp_path):
    cfg = parse_config([])
    assert cfg.device == "auto" and cfg.precision == "fp32"
    cfg = parse_config(["--device", "cpu", "--precision", "bf16"])
    assert (cfg.device, cfg.precision) == ("cpu", "bf16")
    assert cfg.to_dict()["device"] == "cpu" and cfg.to_dict()["precision"] == "bf16"
    toml = tmp_path / "run.toml"
    toml.write_text('device = "cuda"\nprecision = "fp16"\n')
    cfg = parse_config(["--config", str(toml)])
    assert (cfg.device, cfg.precision) == ("cuda", "fp16")
    with pytest.raises(ConfigError, match=r"--device: invalid choice: 'tpu'"):
        parse_config(["--device", "tpu"])
    with pytest.raises(ConfigError, match=r"--precision: invalid choice: 'fp8'"):
        parse_config(["--precision", "fp8"])


def test_every_layout_takes_every_precision():
    parse_config(["--device", "cuda", "--grid", "2,1,1"])  # spatial on GPUs: halos via --transport
    parse_config(["--device", "cuda", "--grid", "2,1,1", "--stages", "2"])  # stages: host-staged
    parse_config(["--device", "cuda", "--micro-batches", "2"])
    parse_config(["--precision", "fp16", "--stages", "2"])  # scaler agreed over the stages
    parse_config(["--precision", "bf16", "--stages", "2", "--micro-batches", "2"])  # autocast
    parse_config(["--device", "auto", "--grid", "2,1,1", "--precision", "bf16"])  # fine


# --- device resolution ---------------------------------------------------------------------------
def test_resolve_device_rules():
    assert resolve_device("cpu", 3, count=2) == torch.device("cpu")
    assert resolve_device("auto", 0, count=0) == torch.device("cpu")
    assert resolve_device("auto", 3, count=2) == torch.device("cuda", 1)  # round-robin
    assert resolve_device("cuda", 2, count=4) == torch.device("cuda", 2)
    with pytest.raises(ConfigError, match=r"^--device cuda: torch sees no CUDA device .*pass "
                                          r"--device cpu \(or auto"):
        resolve_device("cuda", 0, count=0)
    with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda"):
        resolve_device("gpu")


def test_auto_finding_a_gpu_on_some_ranks_only_stops_every_rank(monkeypatch):
    """Rank 1 of 2 sees no GPU: it picked the CPU and the MPI transport, the others CUDA and a
    staged reducer, and they waited in different collectives for ever."""
    import types

    import launch.env
    import sparsepipe_hpc.train.device as device_mod

    class TwoRanks:  # rank 0's view: rank 1 answers every allgather, its device a CPU
        def allgather(self, value):
            return [value, "cpu"] if isinstance(value, str) else [value, value]

    monkeypatch.setattr(launch.env, "detect", lambda comm: types.SimpleNamespace(local_rank=0))
    monkeypatch.setattr(device_mod, "resolve_device", lambda kind, local: torch.device("cuda", 0))
    cfg = types.SimpleNamespace(device="auto")
    with pytest.raises(SetupError, match=r"--device auto resolved to other kinds of device on "
                                         r"different ranks \(cpu on rank\(s\) \[1\]; cuda on "
                                         r"rank\(s\) \[0\]\).*pass --device cpu"):
        device_mod.trainer_device(cfg, TwoRanks())


@no_cuda
def test_auto_is_cpu_and_cuda_is_a_clear_error_here(data, tmp_path):
    assert resolve_device("auto") == torch.device("cpu")
    t = Trainer(tiny(data, tmp_path / "a", "--steps", "1"), MPI.COMM_SELF, log=None)
    assert t.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in t.model.parameters())
    with pytest.raises(SetupError, match=r"^--device cuda: torch sees no CUDA device"):
        Trainer(tiny(data, tmp_path / "b", "--device", "cuda"), MPI.COMM_SELF, log=None)


@no_cuda
def test_cli_device_cuda_without_cuda_exits_2_on_every_rank(tmp_path):
    """Under mpirun -n 2: one message, exit status 2, no traceback, no hang."""
    cmd = mpirun_command(2) + [sys.executable, "-m", "sparsepipe_hpc.train", "--device", "cuda",
                               "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress"]
    env = repo_env(mpi_env())
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("sparsepipe_hpc.train: error: --device cuda: torch sees no CUDA "
                             "device") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert time.perf_counter() - t < 200


# --- checkpoint state ----------------------------------------------------------------------------
def test_cuda_rng_state_is_saved_and_restored_on_a_gpu_device(monkeypatch):
    """The CUDA generator's state rides in the checkpoint on a GPU run (faked here without one)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([7, 8, 9],
                                                                                 dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: calls.append((s, device)))
    gpu = torch.device("cuda", 0)
    state = ck.rng_state(device=gpu)
    assert torch.equal(state["cuda"], torch.tensor([7, 8, 9], dtype=torch.uint8))
    assert "cuda" not in ck.rng_state(device=torch.device("cpu"))
    ck.set_rng_state(state, device=gpu)
    assert len(calls) == 1 and calls[0][1] == gpu
    ck.set_rng_state(state, device=torch.device("cpu"))  # a CPU run ignores it
    assert len(calls) == 1


# --- precision -----------------------------------------------------------------------------------
def test_precision_objects():
    cpu = torch.device("cpu")
    assert Precision("fp32", cpu).scaler is None and Precision("bf16", cpu).scaler is None
    p16 = Precision("fp16", cpu)
    assert p16.scaler is not None and p16.dtype == torch.float16
    with Precision("bf16", cpu).autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with Precision("fp32", cpu).autocast():
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ConfigError, match="--precision must be one of"):
        Precision("fp8", cpu)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_follows_fp32(data, tmp_path, precision):
    """Same seed and data: the mixed-precision loss curve tracks fp32's and falls as far; master
    weights stay float32; fp16 checkpoints its loss scale."""
    args = ("--steps", "24", "--lr", "0.01", "--schedule", "constant", "--engine", "torch")
    ref = Trainer(tiny(data, tmp_path / "fp32", *args), MPI.COMM_SELF, log=None)
    ref.run()
    t = Trainer(tiny(data, tmp_path / precision, *args, "--precision", precision), MPI.COMM_SELF,
                log=None)
    t.run()
    a, b = losses(tmp_path / "fp32"), losses(tmp_path / precision)
    assert len(a) == len(b) == 24
    assert abs(a[0] - b[0]) < 0.02 * a[0], (a[0], b[0])  # the same first step, to rounding
    fa, fb = sum(a[-4:]) / 4, sum(b[-4:]) / 4
    assert fb < 0.8 * sum(b[:4]) / 4, b  # it learns
    assert abs(fa - fb) < 0.15 * fa + 0.05, (a, b)  # and about as well as fp32
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    saved = ck.load_checkpoint(tmp_path / precision / "last.pt")
    assert ("scaler" in saved) == (precision == "fp16")
    if precision == "fp16":
        assert saved["scaler"]["scale"] > 0


def test_fp16_loss_scale_round_trips_through_the_checkpoint(data, tmp_path):
    t = Trainer(tiny(data, tmp_path / "a", "--steps", "2", "--precision", "fp16"), MPI.COMM_SELF,
                log=None)
    t.precision.scaler = torch.amp.GradScaler(t.device.type, init_scale=1234.0)  # as if lowered
    t.run()
    saved = ck.load_checkpoint(tmp_path / "a" / "last.pt")["scaler"]
    resumed = Trainer(tiny(data, tmp_path / "a", "--steps", "3", "--precision", "fp16",
                           "--resume", "auto"), MPI.COMM_SELF, log=None)
    assert resumed.precision.scaler.get_scale() == saved["scale"]
    assert saved["scale"] != Precision("fp16", torch.device("cpu")).scaler.get_scale()


@pytest.mark.parametrize("engine, note", [("spconv", True), ("torch", False)])
def test_bf16_start_line_says_when_spconv_computes_in_float32(data, tmp_path, engine, note):
    """spconv has no bfloat16, so under --precision bf16 its convolutions run in float32: the
    start-up line says so (and points to fp16) only when spconv is the engine."""
    said: list[str] = []
    Trainer(tiny(data, tmp_path / engine, "--steps", "1", "--precision", "bf16", "--engine",
                 engine), MPI.COMM_SELF, log=said.append).run()
    assert ("spconv has no bfloat16: its convolutions run in float32; fp16 runs its fast "
            "kernels" in said[0]) is note, said[0]


def test_a_library_trainer_takes_its_threads(data, tmp_path):
    """Only the command line set --threads: Trainer(cfg) trained on whatever torch had."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t = Trainer(tiny(data, tmp_path / "t", "--threads", "2", "--engine", "torch"),
                    MPI.COMM_SELF, log=None)
        assert torch.get_num_threads() == 2
        t.metrics.close()
        t.close()
    finally:
        torch.set_num_threads(before)


def test_compute_threads_by_device(monkeypatch):
    """--threads wins; else 1 on a CPU (spconv's CPU kernels, ranks sharing cores), and on a GPU
    the rank's share of the node's cores for the host-side data work."""
    from sparsepipe_hpc.train import device as dev

    monkeypatch.setenv("SPARSEPIPE_THREADS", "3")  # launch.env's override of the node's share
    assert dev.compute_threads(parse_config(["--threads", "2"]), MPI.COMM_SELF) == 2
    assert dev.compute_threads(parse_config(["--device", "cpu"]), MPI.COMM_SELF) == 1
    monkeypatch.setattr(dev, "cuda_device_count", lambda: 0)
    assert dev.compute_threads(parse_config([]), MPI.COMM_SELF) == 1  # auto without a GPU
    monkeypatch.setattr(dev, "cuda_device_count", lambda: 1)
    assert dev.compute_threads(parse_config([]), MPI.COMM_SELF) == 3
    assert dev.compute_threads(parse_config(["--device", "cuda"]), MPI.COMM_SELF) == 3
