"""Trainer options: CLI parsing, TOML config files, task defaults, bad-input errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import repo_env
from sparsepipe_hpc.train.config import (TASK_DEFAULTS, ConfigError, TrainConfig, parse_config,
                                         resolve_layout)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_by_task():
    seg = parse_config([])
    assert (seg.task, seg.model, seg.grid, seg.engine, seg.threads) == ("seg", "unet", (1, 1, 1),
                                                                          "auto", None)
    assert seg.batch_size == TASK_DEFAULTS["seg"]["batch_size"]
    cls = parse_config(["--task", "cls"])
    assert cls.model == "resnet" and cls.voxel_size == TASK_DEFAULTS["cls"]["voxel_size"]
    assert parse_config(["--optimizer", "sgd"]).lr == pytest.approx(10 * seg.lr)  # SGD's default
    assert parse_config(["--optimizer", "sgd", "--lr", "0.5"]).lr == 0.5


def test_cli_options():
    cfg = parse_config(["--width", "8", "--depth", "2", "--steps", "7", "--batch-size", "6",
                        "--voxel-size", "0.1", "--grid", "2,1,1", "--replicas", "3",
                        "--cuts", "uniform", "--no-overlap", "--engine", "torch",
                        "--threads", "2", "--resume", "auto", "--out", "runs/x",
                        "--checkpoint-every", "5", "--eval-every", "3", "--schedule", "constant",
                        "--no-augment", "--no-progress", "--seed", "4", "--weight-decay", "0"])
    assert cfg.grid == (2, 1, 1) and cfg.replicas == 3 and cfg.overlap is False
    assert (cfg.width, cfg.depth, cfg.steps, cfg.batch_size, cfg.voxel_size) == (8, 2, 7, 6, 0.1)
    assert (cfg.cuts, cfg.engine, cfg.threads, cfg.resume, cfg.out) == ("uniform", "torch", 2,
                                                                        "auto", "runs/x")
    assert (cfg.checkpoint_every, cfg.eval_every, cfg.schedule) == (5, 3, "constant")
    assert cfg.augment is False and cfg.progress is False and cfg.seed == 4
    assert cfg.to_dict()["grid"] == [2, 1, 1]


def test_config_file_and_command_line_wins(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('task = "seg"\nbatch-size = 8\nlr = 0.01\ngrid = [2, 1, 1]\n'
                 'no-overlap = true\nweight_decay = 0.0\nsteps = 30\n')
    cfg = parse_config(["--config", str(f), "--lr", "0.02"])
    assert cfg.batch_size == 8 and cfg.grid == (2, 1, 1) and cfg.overlap is False
    assert cfg.weight_decay == 0.0 and cfg.steps == 30
    assert cfg.lr == 0.02  # the command line wins
    assert parse_config(["--config", str(f), "--overlap"]).overlap is True
    f.write_text('overlap = false\ngrid = "1,2,1"\n')
    cfg = parse_config(["--config", str(f)])
    assert cfg.overlap is False and cfg.grid == (1, 2, 1)


@pytest.mark.parametrize("text, match", [
    ('bogus = 1\n', "unknown key 'bogus'"),
    ('batch-size = "many"\n', "--config .*batch-size.*invalid positive int"),
    ('no-overlap = 1\n', "must be true or false"),
    ('task = "detect"\n', "--config .*invalid choice: 'detect'"),
    ('lr = [1, 2]\n', "takes one value"),
    ('this is not toml\n', "not valid TOML"),
    ('micro_batches = 2\nmicro-batches = 4\n',
     "keys 'micro_batches' and 'micro-batches' both set --micro-batches; keep one"),
    ('augment = true\nno-augment = true\n', "keys 'augment' and 'no-augment' both set --augment"),
])
def test_bad_config_file(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_config(["--config", str(f)])


@pytest.mark.parametrize("argv, match", [
    (["--task", "detect"], "argument --task: invalid choice: 'detect'"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1; got 0"),
    (["--voxel-size", "-1"], "argument --voxel-size: must be a finite number > 0; got -1"),
    (["--seed", "-1"], r"argument --seed: must be in \[0, 2\*\*63\); got -1"),
    (["--seed", str(10**20)], r"argument --seed: must be in \[0, 2\*\*63\); got 1000"),
    (["--grid", "2,2"], "grid must be three positive integers"),
    (["--model", "unet", "--task", "cls"], "--model unet is a seg model but --task is cls; "
                                           "pass --model resnet"),
    (["--resume", "auto"], "needs --out DIR"),
    (["--config", "/nonexistent/x.toml"], "no such file"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_options(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_layout_checks():
    cfg = parse_config(["--batch-size", "6"])
    with pytest.raises(ConfigError, match=r"^--batch-size 6 cannot be split over 4 replicas; "
                                          r"pass a multiple of 4$"):
        resolve_layout(cfg, 4)
    assert resolve_layout(cfg, 3).replicas == 3
    grid = parse_config(["--grid", "2,1,1", "--batch-size", "4"])
    layout = resolve_layout(grid, 4)
    assert (layout.replicas, layout.spatial_size) == (2, 2)
    with pytest.raises(ConfigError, match="does not divide the 3 ranks"):
        resolve_layout(grid, 3)
    with pytest.raises(ConfigError, match="but the job has 4"):
        resolve_layout(parse_config(["--replicas", "3"]), 4)


def test_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)
    assert TrainConfig().task == "seg"


def test_toml_falls_back_to_tomli_without_tomllib(tmp_path):
    """Python 3.10 has no tomllib: config.py must read --config files with tomli. Simulated in a
    fresh interpreter where ``import tomllib`` fails and ``tomli`` is a stand-in that records
    its use."""
    (tmp_path / "run.toml").write_text('task = "cls"\nbatch-size = 6\ngrid = [1, 1, 1]\n')
    script = (
        "import sys, types\n"
        "try:\n    import tomllib as real\n"
        "except ModuleNotFoundError:\n    import tomli as real\n"
        "sys.modules['tomllib'] = None  # import tomllib -> ImportError, as on Python 3.10\n"
        "shim = types.ModuleType('tomli'); shim.used = []\n"
        "def load(f): shim.used.append(1); return real.load(f)\n"
        "shim.load, shim.TOMLDecodeError = load, real.TOMLDecodeError\n"
        "sys.modules['tomli'] = shim\n"
        "from sparsepipe_hpc.train import config\n"
        f"cfg = config.parse_config(['--config', {str(tmp_path / 'run.toml')!r}])\n"
        "assert config.tomllib is shim and shim.used == [1], config.tomllib\n"
        "print(cfg.task, cfg.batch_size)\n"
        f"(open({str(tmp_path / 'bad.toml')!r}, 'w').write('task = '))\n"
        "try:\n"
        f"    config.parse_config(['--config', {str(tmp_path / 'bad.toml')!r}])\n"
        "except config.ConfigError as e:\n"
        "    print('ConfigError', e)\n")
    env = repo_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "cls 6"
    assert lines[1].startswith("ConfigError --config") and "not valid TOML" in lines[1]


def test_tomli_is_a_dependency_before_python_3_11():
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    tomli = [d for d in deps if d.replace(" ", "").startswith("tomli")]
    assert tomli and 'python_version<"3.11"' in tomli[0].replace(" ", ""), deps


def test_replica_batch_beyond_the_sparse_tensor_limit():
    cfg = parse_config(["--batch-size", "600"])
    with pytest.raises(ConfigError, match=r"--batch-size 600 puts 300 samples on each of 2 "
                                          r"replica\(s\); a replica takes at most 256 per step: "
                                          r"pass --batch-size 512 or less"):
        resolve_layout(cfg, 2)
    assert resolve_layout(parse_config(["--batch-size", "512"]), 2).replicas == 2


def test_input_modes():
    from sparsepipe_hpc.train.config import distributed_input

    assert distributed_input(parse_config(["--grid", "2,1,1"]))
    assert not distributed_input(parse_config([]))                       # no spatial grid
    assert not distributed_input(parse_config(["--grid", "2,1,1", "--input", "whole"]))
    assert not distributed_input(parse_config(["--task", "cls", "--grid", "2,1,1"]))
    assert not distributed_input(parse_config(["--grid", "2,1,1", "--micro-batches", "2"]))
    for bad in (["--task", "cls"], ["--stages", "2"], ["--micro-batches", "2"]):
        with pytest.raises(ConfigError, match="--input distributed reads scenes"):
            parse_config(["--input", "distributed", *bad])


def test_prefetch_by_device_and_input():
    from sparsepipe_hpc.train.config import distributed_input, use_prefetch

    assert use_prefetch(parse_config([]), "cuda") and not use_prefetch(parse_config([]), "cpu")
    assert use_prefetch(parse_config(["--prefetch"]), "cpu")
    assert not use_prefetch(parse_config(["--no-prefetch"]), "cuda")
    assert not use_prefetch(parse_config(["--grid", "2,1,1"]), "cuda")  # distributed input
    assert use_prefetch(parse_config(["--grid", "2,1,1", "--input", "whole"]), "cuda")
    # Asked for, prefetch takes whole samples where --input auto would read them distributed.
    cfg = parse_config(["--grid", "2,1,1", "--prefetch"])
    assert use_prefetch(cfg, "cpu") and not distributed_input(cfg)
    with pytest.raises(ConfigError, match=r"^--prefetch reads the next samples on a host "
                                          r"thread, but --input distributed .*; pass "
                                          r"--input whole, or --no-prefetch$"):
        parse_config(["--input", "distributed", "--prefetch"])
    # The same checks where --plan auto picked the layout (resolve_layout runs them again)
    planned = dataclasses.replace(parse_config(["--input", "distributed"]), stages=2)
    with pytest.raises(ConfigError, match=r"^--input distributed reads scenes .* --stages 2"):
        resolve_layout(planned, 2)


def test_balance_is_checked_and_spelled_one_way():
    """--balance: integers (checked at once, also where no pipeline would read it), one count
    per stage (checked against the layout, --plan auto's too), one spelling in the checkpoint."""
    assert parse_config(["--stages", "2", "--balance", "3, 3"]).balance == "3,3"
    with pytest.raises(ConfigError, match="--balance must be positive integers like 5,4"):
        parse_config(["--balance", "banana"])
    with pytest.raises(ConfigError, match="--balance 3,3 names 2 stage\\(s\\) but --stages is 1"):
        resolve_layout(parse_config(["--balance", "3,3"]), 1)


def test_trace_and_deferred_bn_options(tmp_path):
    cfg = parse_config(["--trace", str(tmp_path / "t.json"), "--deferred-bn"])
    assert cfg.trace == str(tmp_path / "t.json") and cfg.deferred_bn is True
    assert parse_config([]).trace is None and parse_config([]).deferred_bn is False
    with pytest.raises(ConfigError, match=r"^--trace .* is a directory but names the trace file "
                                          r"to write; pass a file such as .*trace\.json$"):
        parse_config(["--trace", str(tmp_path)])


def test_options_that_change_nothing_are_noted():
    """Accepted (a short trial of a long run's options) but said: a warm-up as long as the run,
    and pipeline options without a pipeline."""
    from sparsepipe_hpc.train.config import option_notes

    assert option_notes(parse_config([])) == []
    assert option_notes(parse_config(["--stages", "2", "--deferred-bn", "--pipeline-schedule",
                                      "gpipe", "--steps", "5", "--warmup", "4"])) == []
    notes = option_notes(parse_config(["--steps", "4", "--warmup", "4", "--deferred-bn",
                                       "--pipeline-schedule", "gpipe"]))
    assert [n.split(" ")[1] for n in notes] == ["--warmup", "--deferred-bn",
                                                "--pipeline-schedule"], notes
    assert "never reaches --lr" in notes[0]
    assert option_notes(parse_config(["--grid", "2,1,1", "--cuts", "uniform", "--no-overlap"])) \
        == []
    assert option_notes(parse_config(["--trace-steps", "3"]))[0].startswith(
        "note: --trace-steps 3 changes nothing without --trace")
    notes = option_notes(parse_config(["--cuts", "uniform", "--no-overlap"]))
    assert notes == ["note: --cuts uniform and --no-overlap change(s) nothing on a 1x1x1 --grid "
                     "(no sample is split)"]


def test_a_default_batch_that_does_not_split_over_the_replicas_grows_to_fit():
    """`mpirun -n 8 python -m sparsepipe_hpc.train` runs: the seg default of 4 samples becomes
    8 (one per replica), said in a note; a --batch-size given is kept, and refused if it does
    not split."""
    from sparsepipe_hpc.train.config import fit_default_batch
    cfg = parse_config([])
    assert "batch_size" in cfg.defaulted
    fit, note = fit_default_batch(cfg, 8)
    assert fit.batch_size == 8 and note == ("--batch-size 8: the seg default 4 does not split "
                                            "over 8 replicas (pass --batch-size to choose)")
    assert resolve_layout(fit, 8).replicas == 8
    assert fit_default_batch(cfg, 3)[0].batch_size == 6
    assert fit_default_batch(cfg, 2) == (cfg, None)
    grid = parse_config(["--grid", "2,1,1"])  # 4 replicas of 2 ranks: 4 splits
    assert fit_default_batch(grid, 8) == (grid, None)
    assert fit_default_batch(parse_config(["--task", "cls"]), 3)[0].batch_size == 33
    given = parse_config(["--batch-size", "4"])
    assert fit_default_batch(given, 8) == (given, None)
    with pytest.raises(ConfigError, match="--batch-size 4 cannot be split over 8 replicas"):
        resolve_layout(given, 8)
