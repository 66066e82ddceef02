"""One spconv build per environment: the start-up check, and extras that name one build each."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

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
