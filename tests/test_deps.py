"""One spconv build per environment: the start-up check, and extras that name one build each."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from helpers import repo_env
from sparsepipe_hpc.deps import DependencyError, check_spconv, installed_builds

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


class Dist:
    def __init__(self, name: str, version: str):
        self.metadata = {"Name": name}
        self.version = version


def test_one_build_passes_and_names_itself():
    dists = [Dist("torch", "2.13.0"), Dist("spconv", "2.3.8"), Dist("cumm", "0.7.11")]
    assert check_spconv(dists=dists) == "spconv"
    assert check_spconv(dists=[Dist("spconv_cu126", "2.3.8")]) == "spconv-cu126"
    assert installed_builds("cumm", dists) == [("cumm", "0.7.11")]


def test_two_builds_are_a_clear_error():
    dists = [Dist("spconv", "2.3.8"), Dist("spconv-cu126", "2.3.8"), Dist("cumm", "0.7.11"),
             Dist("cumm-cu126", "0.7.11")]
    with pytest.raises(DependencyError, match=r"^spconv is installed more than once: spconv 2\.3\.8 "
                                              r"\(CPU build\) and spconv-cu126 2\.3\.8 \(CUDA 12\.6 "
                                              r"build\); .* pip uninstall -y spconv spconv-cu126 "
                                              r"cumm cumm-cu126 && pip install -e '\.\[cpu\]'"):
        check_spconv(dists=dists)
    assert issubclass(DependencyError, ImportError)


def test_none_is_an_error_only_when_required():
    assert check_spconv(dists=[Dist("torch", "2.13.0")]) is None
    with pytest.raises(DependencyError, match=r"spconv is not installed; .*--engine torch"):
        check_spconv(required=True, dists=[])


def test_this_environment_has_exactly_one_build():
    assert check_spconv() is not None


def test_extras_name_one_installable_spconv_build_each():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    spconv = re.compile(r"^spconv(-cu\d+)?\b")
    assert not [d for d in project["dependencies"] if spconv.match(d)], \
        "the base dependencies must not name a spconv build (the extras pick one)"
    extras = project["optional-dependencies"]
    for extra in ("cpu", "cuda12", "cuda13"):
        builds = [d for d in extras[extra] if spconv.match(d)]
        assert len(builds) == 1, (extra, extras[extra])
        assert "spconv-cu120" not in builds[0]  # no Python 3.12 wheel
    assert any(d.startswith("cupy-cuda12x") for d in extras["cuda12"])
    assert any(d.startswith("cupy-cuda13x") for d in extras["cuda13"])


def test_ci_and_readme_install_the_cpu_build():
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[cpu,dev]"' in ci
    readme = (ROOT / "README.md").read_text()
    assert 'pip install torch==2.13.0 -e ".[cpu]" && mpirun' in readme
    assert 'pip install torch==2.13.0 -e ".[cpu,dev]" && python -m pytest' in readme


def test_cli_with_two_spconv_builds_exits_2(tmp_path):
    """A second build's metadata on the path (as `pip install spconv-cu126` over `spconv`
    leaves it, or the reverse on a GPU machine): the trainer stops before any work with the
    message, exit status 2."""
    import os
    import subprocess

    installed = check_spconv(required=True)
    other, version = ("spconv-cu126", "2.3.8") if installed == "spconv" else ("spconv", "2.3.8")
    info = tmp_path / "site" / f"{other.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {other}\nVersion: {version}\n")
    env = repo_env(OMP_NUM_THREADS="1")  # keeps a PYTHONPATH install (the GPU machine's .site)
    env["PYTHONPATH"] += os.pathsep + str(tmp_path / "site")
    proc = subprocess.run([sys.executable, "-m", "sparsepipe_hpc.train", "--steps", "1",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    cpu_version = metadata.version("spconv") if installed == "spconv" else version
    assert ("sparsepipe_hpc.train: error: spconv is installed more than once: "
            f"spconv {cpu_version} (CPU build) and spconv-cu126 2.3.8 (CUDA 12.6 build)") in proc.stderr
    assert "Traceback" not in proc.stderr
