"""Fences for tests that run on every rank of an MPI world (started by ``tests/test_mpi.py``).

Every test here runs on all ranks at once. The fixtures keep ranks in step: a barrier before and
after each test, and a verdict agreed by all ranks, so one rank's failure fails the test everywhere
instead of leaving the others waiting in a collective. A test that hangs is ended by pytest-timeout's
thread method, which exits the process and so makes ``mpirun`` end the job.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from mpi4py import MPI  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_report_header(config):
    import spconv  # noqa: F401

    comm = MPI.COMM_WORLD
    return [
        f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}; world size {comm.size}",
        f"torch {torch.__version__}; spconv {getattr(spconv, '__version__', '?')}; "
        f"threads per rank {torch.get_num_threads()}",
    ]


@pytest.fixture(autouse=True)
def _fence():
    """Barrier around every test so that no rank runs ahead into the next one."""
    MPI.COMM_WORLD.Barrier()
    yield
    MPI.COMM_WORLD.Barrier()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Agree on each test's verdict: it fails on every rank if it failed on any."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    failed_here = report.failed
    failed_anywhere = MPI.COMM_WORLD.allreduce(int(failed_here), op=MPI.SUM)
    if failed_anywhere and not failed_here:
        report.outcome = "failed"
        report.longrepr = f"failed on {failed_anywhere} other rank(s); see their output"


@pytest.fixture
def comm() -> MPI.Intracomm:
    return MPI.COMM_WORLD


@pytest.fixture
def rng(request):
    """A numpy generator seeded by the test's name: the same on every rank and every run."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
