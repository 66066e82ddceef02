"""Planner interfaces: plan files, train --plan (options and, under mpirun, end to end), the plan
command, and python -m launch job --plan on the planner's own JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsepipe_hpc.plan.cli import main as plan_main
from sparsepipe_hpc.plan.planfile import PlanFileError, layout_options, read_plan
from sparsepipe_hpc.train.config import ConfigError, parse_config, resolve_layout

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, plan, name="plan.json", wrap=True):
    path = tmp_path / name
    path.write_text(json.dumps({"plans": [plan]} if wrap else plan))
    return path


PIPE = {"replicas": 1, "stages": 2, "grid": [1, 1, 1], "micro_batches": 2, "balance": [5, 3],
        "pipeline_schedule": "gpipe", "ranks": 2, "nodes": 1, "gpus_per_node": 2}


def test_read_plan_and_layout_options(tmp_path):
    plan = read_plan(_write(tmp_path, PIPE))
    assert layout_options(plan) == {"replicas": 1, "stages": 2, "grid": (1, 1, 1),
                                    "micro_batches": 2, "balance": "5,3",
                                    "pipeline_schedule": "gpipe"}
    assert read_plan(_write(tmp_path, PIPE, wrap=False)) == plan
    # A stage order off the launch's becomes --stage-order; the launch's own sets nothing.
    moved = read_plan(_write(tmp_path, {**PIPE, "stage_order": [1, 0]}))
    assert layout_options(moved)["stage_order"] == "1,0"
    assert "stage_order" not in layout_options(read_plan(_write(tmp_path, {**PIPE,
                                                                           "stage_order": [0, 1]})))


@pytest.mark.parametrize("change, words", [
    ({"grid": [2, 1]}, "grid [2, 1] must be three positive integers"),
    ({"balance": [8]}, "balance [8] must list 2 positive block counts"),
    ({"replicas": 0}, "replicas is 0"),
    ({"ranks": 3}, "ranks 3 but replicas 1 x stages 2 x grid 1x1x1 = 2"),
    ({"pipeline_schedule": "zigzag"}, "must be 1f1b or gpipe"),
    ({"stage_order": [1, 1]}, "stage_order [1, 1] must list each of the 2 stage(s) 0..1 once"),
    ({"stage_order": "1,0"}, "stage_order '1,0' must list each of the 2 stage(s)"),
])
def test_bad_plans_are_named(tmp_path, change, words):
    with pytest.raises(PlanFileError, match=re.escape(words)) as info:
        read_plan(_write(tmp_path, {**PIPE, **change}))
    assert "plan.json" in str(info.value)
    missing = {k: v for k, v in PIPE.items() if k != "stages"}
    with pytest.raises(PlanFileError, match="has no 'stages'"):
        read_plan(_write(tmp_path, missing))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanFileError, match="not JSON"):
        read_plan(tmp_path / "bad.json")
    with pytest.raises(PlanFileError, match="cannot be read"):
        read_plan(tmp_path / "none.json")


def test_train_plan_file_sets_layout_and_refuses_contradictions(tmp_path):
    path = _write(tmp_path, PIPE)
    cfg = parse_config(["--plan", str(path)])
    assert (cfg.replicas, cfg.stages, cfg.grid, cfg.balance, cfg.micro_batches,
            cfg.pipeline_schedule, cfg.plan_ranks) == (1, 2, (1, 1, 1), "5,3", 2, "gpipe", 2)
    assert resolve_layout(cfg, 2).stages == 2
    with pytest.raises(ConfigError, match=r"lays out 2 ranks but the job has 4; start 2 ranks"):
        resolve_layout(cfg, 4)
    # An explicit option equal to the plan's is fine; a different one is an error naming both.
    assert parse_config(["--plan", str(path), "--stages", "2"]).stages == 2
    with pytest.raises(ConfigError, match=r"--grid 2,1,1 contradicts --plan .*plan.json, which "
                                          r"sets --grid 1,1,1; drop --grid or the plan"):
        parse_config(["--plan", str(path), "--grid", "2,1,1"])
    with pytest.raises(ConfigError, match="--micro-batches 4 contradicts"):
        parse_config(["--micro-batches", "4", "--plan", str(path)])
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config(["--plan", str(tmp_path / "missing.json")])
    auto = parse_config(["--plan", "auto", "--stages", "2"])
    assert auto.plan_fixed == ("stages",) and auto.plan_ranks is None


def _profile_file(tmp_path):
    from sparsepipe_hpc.plan.profile import BlockProfile, Fit, ModelProfile
    blocks = tuple(BlockProfile(f"b{k}", Fit(1e-3, 1e-6), Fit(1e-3, 2e-6), Fit(0, 100.0),
                                Fit(0, 20.0), 4e4, (10.0, 10.0, 10.0), 2) for k in range(6))
    prof = ModelProfile("toy", "cpu", blocks, 10000.0, (64, 64, 32), 8, 3)
    path = tmp_path / "profile.json"
    path.write_text(prof.to_json())
    return path


def test_plan_command_table_and_json(tmp_path, capsys):
    prof = _profile_file(tmp_path)
    out = tmp_path / "plans.json"
    assert plan_main(["--profile", str(prof), "--ranks", "4", "--device-speed", "1,1,0.5,0.5",
                      "--ranks-per-node", "2", "--json", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "chosen" in text and "PREDICTED" in text and "train with: --replicas" in text
    doc = json.loads(out.read_text())
    assert doc["predicted"] is True and doc["ranks"] == 4 and len(doc["plans"]) == 4
    times = [p["step_time"] for p in doc["plans"]]
    assert times == sorted(times)
    chosen = read_plan(out)   # the trainer reads the planner's file as its chosen plan
    assert chosen["ranks"] == 4 and chosen["nodes"] == 2 and chosen["gpus_per_node"] == 2
    # Far more ranks than here: labelled an extrapolation.
    assert plan_main(["--profile", str(prof), "--ranks", "1024", "--ranks-per-node", "8",
                      "--batch-size", "256", "--json", str(out)]) == 0
    assert "extrapolated beyond this machine" in capsys.readouterr().out
    assert json.loads(out.read_text())["extrapolated"] is True


def test_plan_command_bad_input_exits_2(tmp_path, capsys):
    prof = _profile_file(tmp_path)
    assert plan_main(["--profile", str(prof), "--ranks", "4", "--device-speed", "1,1"]) == 2
    assert "gives 2 values but there are 4 ranks" in capsys.readouterr().err
    assert plan_main(["--profile", str(prof), "--ranks", "2", "--device-memory", "1e3"]) == 2
    assert "no plan fits 2 ranks" in capsys.readouterr().err
    assert plan_main(["--profile", str(tmp_path / "nope.json"), "--ranks", "2"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert plan_main(["--profile", str(prof), "--ranks", "2", "--json",
                      str(tmp_path / "no" / "dir" / "p.json")]) == 2
    assert "--json " in capsys.readouterr().err
    # Options that say how to measure a profile contradict a profile read from a file.
    assert plan_main(["--profile", str(prof), "--ranks", "2", "--width", "32",
                      "--precision", "bf16"]) == 2
    assert ("but --width, --precision say(s) how to measure one; drop them"
            in capsys.readouterr().err)
    for bad, words in ((["--extent", "10,10"], "must be three integers >= 1"),
                       (["--ranks", "0"], "argument --ranks: must be > 0; got 0"),
                       (["--voxels-per-sample", "-1"], "--voxels-per-sample: must be > 0")):
        with pytest.raises(SystemExit) as e:
            plan_main(["--profile", str(prof), *bad])
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_launch_job_renders_the_planners_plan(tmp_path):
    path = _write(tmp_path, {**PIPE, "pipeline_schedule": "1f1b"})
    proc = subprocess.run([sys.executable, "-m", "launch", "job", "--scheduler", "local",
                           "--cpu-only", "--plan", str(path), "--", "--steps", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("--grid 1,1,1 --replicas 1 --stages 2 --micro-batches 2 --balance 5,3 "
            "--pipeline-schedule 1f1b --steps 3") in proc.stdout
    bad = _write(tmp_path, {**PIPE, "balance": [5]}, name="bad.json")
    proc = subprocess.run([sys.executable, "-m", "launch", "job", "--scheduler", "local",
                           "--cpu-only", "--plan", str(bad)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode != 0 and "balance [5] must list 2 positive" in proc.stderr


def test_machine_file_options_are_applied_alike(tmp_path, capsys):
    from sparsepipe_hpc.plan.cli import _machine, build_parser
    machine = tmp_path / "m4.toml"
    machine.write_text("ranks_per_node = 4\ndevice_speed = [1.0, 1.0, 0.5, 0.5]\n"
                       "device_memory = [8e9, 16e9, 8e9, 16e9]\n")

    def built(*argv):
        return _machine(build_parser().parse_args(["--machine", str(machine), *argv]))

    assert built("--ranks-per-node", "2").ranks_per_node == 2     # alone, too
    m = built("--device-speed", "2,2,1,1")
    assert [d.memory for d in m.devices] == [8e9, 16e9, 8e9, 16e9]
    # Unequal memory for another rank count is refused, not replaced by device 0's.
    prof = _profile_file(tmp_path)
    assert plan_main(["--profile", str(prof), "--machine", str(machine), "--ranks", "2",
                      "--device-speed", "1,1"]) == 2
    assert "4 unequal values where --device-memory is not given" in capsys.readouterr().err


def test_a_profile_with_figures_out_of_range_exits_2(tmp_path, capsys):
    good = json.loads(_profile_file(tmp_path).read_text())
    for change, words in ((lambda d: d["blocks"][0]["forward"].update(b=float("nan")),
                           r"blocks\[0\] \('\w+'\)\.forward\.b is nan; it must be a finite"),
                          (lambda d: d.update(total_stride=0), "total_stride is 0"),
                          (lambda d: d.update(extent=[64, 64]), r"extent is \(64, 64\)"),
                          (lambda d: d.update(voxels_per_sample=0.0),
                           r"voxels_per_sample is 0\.0; it must be a finite number > 0")):
        doc = json.loads(json.dumps(good))
        change(doc)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        assert plan_main(["--profile", str(bad), "--ranks", "2"]) == 2
        assert re.search(words, capsys.readouterr().err)
