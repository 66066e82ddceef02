"""Shared fixtures for the single-process suites: one torch thread, seeded generators."""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_report_header(config):
    import spconv

    lines = [f"torch {torch.__version__}; spconv {getattr(spconv, '__version__', '?')}; "
             f"threads {torch.get_num_threads()}"]
    try:
        from mpi4py import MPI

        lines.append(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    except Exception as e:  # pragma: no cover - informational only
        lines.append(f"MPI: unavailable ({e})")
    return lines


@pytest.fixture(autouse=True)
def fresh_tmpdir_for_subprocesses(monkeypatch):
    """The processes a test starts get an empty ``TMPDIR`` of their own, removed afterwards.

    Open MPI's launcher keeps its session files in ``$TMPDIR/ompi.<launcher pid>``. A launcher
    killed by SIGKILL (a timeout, by hand) leaves them behind, and a later launcher given the
    same pid -- pids wrap at 32768 on the CI machine -- stops at once: "The PMIx server's listener
    thread failed to start", exit 213. This process keeps the machine's tmp directory:
    ``tempfile`` fixed it at its first call, which is at the latest the one here."""
    path = tempfile.mkdtemp(prefix="sp-", dir=tempfile.gettempdir())
    monkeypatch.setenv("TMPDIR", path)
    yield
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy generator seeded by the test's name: the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def spconv_like_cuda_build(monkeypatch):
    """spconv's layers choose their algorithm as spconv's CUDA build does (implicit GEMM when none
    is named), so a reference layer on CPU tensors that does not name ``algo=ConvAlgo.Native``
    fails here as it would on a GPU machine ("implicit gemm only support cuda")."""
    import spconv.pytorch.conv as sp_conv

    monkeypatch.setattr(sp_conv, "CPU_ONLY_BUILD", False)
