"""``.ci/gpu-check``, the script a lent GPU machine runs (it cannot run here): each section fits
one device call, and what it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / ".ci" / "gpu-check").read_text()
DEVICE_CALL_S = 600  # the device tool's limit per command
INSTALL_S = 30       # unpacking .whl into .site before the first section
PREFLIGHT_S = int(re.search(r'timeout (\d+) "\$PY" -', SCRIPT).group(1))  # the version check
MARGIN_S = 20        # start-up of the device tool's command, python imports, log copying


def sections() -> dict[str, str]:
    """Section name -> its body, from the script's ``case`` arms."""
    body = SCRIPT[SCRIPT.index('case $section in'):SCRIPT.index('esac')]
    arms = re.split(r"^\s{4}(\w+)\)\s*$", body, flags=re.M)[1:]
    return {name: text for name, text in zip(arms[::2], arms[1::2])}


def test_the_sections_are_there():
    assert set(sections()) == {"first", "tests", "bench", "train", "comm", "mps", "suite",
                                "triton"}


@pytest.mark.parametrize("name", ["first", "tests", "bench", "train", "comm", "mps", "suite",
                                  "triton"])
def test_each_section_fits_one_device_call(name):
    limits = [int(s) for s in re.findall(r"^\s+step [\w-]+ (\d+) ", sections()[name], re.M)]
    assert limits, name
    assert sum(limits) <= DEVICE_CALL_S - INSTALL_S - PREFLIGHT_S - MARGIN_S, (name, limits)


def test_what_the_sections_run_exists():
    text = "\n".join(sections().values())
    for path in re.findall(r"tests/[\w/]+\.py", text):
        assert (ROOT / path).is_file(), path
    for bench in re.findall(r"-m sparsepipe_hpc\.bench ([\w-]+)", text):
        assert (ROOT / "sparsepipe_hpc" / "bench" / f"{bench.replace('-', '_')}.py").is_file()
