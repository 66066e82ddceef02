"""``.ci/gpu-check``, the script a lent GPU machine runs (it cannot run here): each section fits
one device call, and what it names exists."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
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
    arms = re.split(r"^\s{4}([\w-]+)\)\s*$", body, flags=re.M)[1:]
    return {name: text for name, text in zip(arms[::2], arms[1::2])}


def test_the_sections_are_there():
    assert set(sections()) == {"targets", "first", "tests", "bench", "host", "train", "comm",
                                "overlap", "mps", "suite", "suite-mpi", "triton"}


@pytest.mark.parametrize("name", ["targets", "first", "tests", "bench", "host", "train", "comm",
                                  "overlap", "mps", "suite", "suite-mpi", "triton"])
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


# --------------------------------------------------------------------------------------------------
# .ci/pytest-shards: the suite sections' runner


SHARDS = ROOT / ".ci" / "pytest-shards"


def _shards(tmp_path: Path, body: str, n: int = 2) -> subprocess.Popen:
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(SHARDS), str(n), str(tmp_path / "log"),
                             "test_generated.py", "--", "-q", "-p", "no:cacheprovider"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_shards_run_every_test_once_and_fail_if_one_fails(tmp_path):
    body = """\
        import pytest

        @pytest.mark.parametrize("i", range(11))
        def test_ok(i):
            pass

        def test_bad():
            assert False, "injected"
        """
    proc = _shards(tmp_path, body)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1 and "12 tests in 8 chunks, 2 at a time" in out, out
    logs = [log.read_text().splitlines()[-1] for log in tmp_path.glob("log-*.log")]
    counts = [sum(int(m) for log in logs for m in re.findall(rf"(\d+) {word}", log))
              for word in ("passed", "failed")]
    assert len(logs) == 8 and counts == [11, 1], logs
    proc = _shards(tmp_path, body.replace("assert False", "assert True"), n=4)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and out.count(": exit 0 at ") == 12, out  # 16 chunks for 12


def test_sigterm_ends_every_shard(tmp_path):
    body = """\
        import os, time

        def test_sleeps():
            open(f"pid-{os.getpid()}", "w").close()
            time.sleep(120)
        """
    proc = _shards(tmp_path, body, n=1)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("pid-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(list(tmp_path.glob("pid-*"))[0].name[4:])
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 124 and "every running chunk ended" in out, out
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
