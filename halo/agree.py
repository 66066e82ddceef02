"""Whether the ranks of a communicator may go on together: one all-reduce before a collective.

    any_problem, same = agree(comm, bool(problem), f"cuts {cuts!r}, stride {stride}")

A rank that found its input bad, and ranks whose arguments differ (each would act on its own),
must stop every rank before the collective that follows, not leave the others waiting in it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

__all__ = ["agree"]


def agree(comm: Any, problem: bool, setting: str) -> tuple[bool, bool]:
    """(whether any rank of ``comm`` found a problem, whether every rank passed the same
    ``setting``). One all-reduce: the maxima of the flag, of a checksum of ``setting`` and of its
    negation (the minimum). Collective."""
    from mpi4py import MPI

    code = zlib.crc32(setting.encode())
    buf = np.array([int(problem), code, -code], np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return bool(buf[0]), bool(buf[1] == -buf[2])
