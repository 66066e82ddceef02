"""The packages type-check: mypy over halo, launch and sparsepipe_hpc (configured in setup.cfg).

``py.typed`` promises users checked types; this test keeps that promise in CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_packages_type_check(monkeypatch):
    api = pytest.importorskip("mypy.api", reason="mypy is in the dev extra")
    monkeypatch.chdir(ROOT)  # setup.cfg names the packages relative to the repository root
    out, err, status = api.run(["--config-file", str(ROOT / "setup.cfg"),
                                "--cache-dir", str(ROOT / ".mypy_cache")])
    assert status == 0, out + err
