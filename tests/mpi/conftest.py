"""Fences for tests that run on every rank of an MPI world (started by ``tests/test_mpi.py``).

Every test here runs on all ranks at once. The fixtures keep ranks in step: a barrier before and
after each test, and a verdict agreed by all ranks for each phase -- setup (fixtures), call and
teardown -- so one rank's failure fails the test everywhere instead of leaving the others waiting
in a collective.

The verdicts travel on a communicator of their own (a duplicate of ``COMM_WORLD``), never mixed up
with a test's collectives. A rank that failed waits at most ``MPI_TEST_AGREE_TIMEOUT`` seconds
(default 30) for the others to reach the verdict; if they do not, they are waiting for it in a
collective its failure skipped (a fixture that raised on rank 0 before its ``bcast``), and it
prints its failure and aborts the job -- a fast failure instead of a hang until the per-test
timeout. A test that hangs otherwise is ended by pytest-timeout's thread method, which exits the
process and so makes ``mpirun`` end the job.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

# The shared test helpers live one level up (tests/helpers.py).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
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


_VERDICTS = MPI.COMM_WORLD.Dup()  # collective, at import: every rank loads this conftest
AGREE_TIMEOUT_S = float(os.environ.get("MPI_TEST_AGREE_TIMEOUT", "30"))


def _abort_unagreed(item, when: str, report) -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    text = (f"{item.nodeid}: {when} failed on this rank, and the other ranks did not finish their "
            f"{when} within {AGREE_TIMEOUT_S:g} s (MPI_TEST_AGREE_TIMEOUT): they are waiting for "
            f"this rank in a collective its failure skipped. This rank's failure:\n"
            f"{report.longreprtext}\naborting all {size} ranks")
    sys.stdout.flush()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def _failures_everywhere(failed_here: bool, item, when: str, report) -> int:
    """How many ranks failed this phase. **Collective** on the verdicts' communicator; bounded
    on a rank that failed (see the module docstring), unbounded on the others (they only wait
    for ranks that are still working or about to give their verdict)."""
    mine = np.array([int(failed_here)], dtype=np.int64)
    total = np.zeros_like(mine)
    request = _VERDICTS.Iallreduce(mine, total, op=MPI.SUM)
    if failed_here:
        deadline = time.monotonic() + AGREE_TIMEOUT_S
        while not request.Test():
            if time.monotonic() > deadline:
                _abort_unagreed(item, when, report)
            time.sleep(0.005)
    else:
        request.Wait()
    return int(total[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Agree on each phase's verdict (setup, call, teardown): it fails on every rank if it failed
    on any, so a fixture that failed on one rank skips the test on all of them."""
    outcome = yield
    report = outcome.get_result()
    failed_here = report.failed
    failed_anywhere = _failures_everywhere(failed_here, item, call.when, report)
    if failed_anywhere and not failed_here:
        report.outcome = "failed"
        report.longrepr = (f"{call.when} failed on {failed_anywhere} other rank(s); "
                           "see their output")


@pytest.fixture
def comm() -> MPI.Intracomm:
    return MPI.COMM_WORLD


@pytest.fixture
def rng(request):
    """A numpy generator seeded by the test's name: the same on every rank and every run."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> Callable[..., Path]:
    """``make(scenes=kwargs, objects=kwargs) -> Path``: tiny synthetic data that rank 0 writes into
    its temp dir, whose path every rank gets (one node, so every rank sees that directory).

    ``scenes`` / ``objects``: keyword arguments of :func:`sparsepipe_hpc.data.synth.generate_scenes`
    / ``generate_objects`` (``None``: not made), so a suite names exactly the data it trains on::

        @pytest.fixture(scope="module")
        def shared(shared_data):
            return shared_data(scenes=dict(train=8, val=2, seed=1, objects=(2, 4),
                                           points=(1200, 2000)))

    **Collective** over ``COMM_WORLD``. If rank 0 fails to make the data, every rank raises (rank 0
    its own error, the others a ``RuntimeError`` quoting it) instead of waiting in the broadcast.
    """

    def make(*, scenes: Optional[dict[str, Any]] = None,
             objects: Optional[dict[str, Any]] = None) -> Path:
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            try:
                from sparsepipe_hpc.data.synth import generate_objects, generate_scenes

                root = tmp_path_factory.mktemp("shared")
                if scenes is not None:
                    generate_scenes(root, **scenes)
                if objects is not None:
                    generate_objects(root, **objects)
            except Exception as exc:
                comm.bcast((None, f"{type(exc).__name__}: {exc}"), root=0)
                raise
            comm.bcast((str(root), None), root=0)
            return root
        path, error = comm.bcast(None, root=0)
        if error is not None:
            raise RuntimeError(f"shared_data: rank 0 failed to make the test data: {error}")
        return Path(path)

    return make
