"""train --plan FILE and --plan auto end to end under mpirun (2 ranks, default data, 2 steps)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from test_mpi import mpi_env, mpirun_command, run_bounded

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path, *args, n=2):
    env = dict(mpi_env(), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    cmd = mpirun_command(n) + [sys.executable, "-m", "sparsepipe_hpc.train", "--steps", "2",
                               "--no-progress", "--checkpoint-every", "0", *args]
    t0 = time.monotonic()
    proc = run_bounded(cmd, 300, env=env, cwd=tmp_path)
    return proc, time.monotonic() - t0


def test_plan_file_runs_the_planned_pipeline(tmp_path):
    plan = {"plans": [{"replicas": 1, "stages": 2, "grid": [1, 1, 1], "micro_batches": 2,
                       "balance": [5, 3], "stage_order": [1, 0], "pipeline_schedule": "gpipe",
                       "ranks": 2}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc, _ = _train(tmp_path, "--plan", "plan.json", "--out", "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 replica(s) x 2 stage(s) x grid 1x1x1 = 2 ranks, stage order 1,0" in proc.stdout
    opts = json.loads((tmp_path / "run" / "config.json").read_text())["options"]
    assert (opts["balance"], opts["stage_order"], opts["micro_batches"],
            opts["pipeline_schedule"]) == ("5,3", "1,0", 2, "gpipe")


def test_plan_auto_keeps_explicit_options_and_trains(tmp_path):
    # A --balance alone fixes the stage count too (the search tried every count and failed).
    proc, _ = _train(tmp_path, "--plan", "auto", "--balance", "5,3", "--out", "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("--plan auto:"))
    assert "--stages 2" in line and "--balance 5,3" in line and "predicted" in line
    assert "1 replica(s) x 2 stage(s)" in proc.stdout


def test_plan_for_other_ranks_is_refused_on_every_rank(tmp_path):
    plan = {"replicas": 2, "stages": 1, "grid": [2, 1, 1]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc, secs = _train(tmp_path, "--plan", "plan.json")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("error: --plan plan.json lays out 4 ranks but the job has 2; start 4 ranks"
            in proc.stderr)
    proc, _ = _train(tmp_path, "--plan", "plan.json", "--grid", "1,1,1")
    assert proc.returncode == 2
    assert "--grid 1,1,1 contradicts --plan plan.json, which sets --grid 2,1,1" in proc.stderr


def test_measure_machine_writes_a_loadable_toml(tmp_path):
    from sparsepipe_hpc.plan.machine import load_machine
    env = dict(mpi_env(), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    cmd = mpirun_command(2) + [sys.executable, "-m", "sparsepipe_hpc.plan", "--measure-machine"]
    proc = run_bounded(cmd, 120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "machine.toml").write_text(proc.stdout)
    m = load_machine(tmp_path / "machine.toml")
    assert m.measured and m.ranks == 2 and m.ranks_per_node == 2
    assert m.intra.alpha > 0 and m.intra.beta > 0
    cmd = mpirun_command(1) + [sys.executable, "-m", "sparsepipe_hpc.plan", "--measure-machine"]
    proc = run_bounded(cmd, 60, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "needs at least 2 ranks" in proc.stderr
