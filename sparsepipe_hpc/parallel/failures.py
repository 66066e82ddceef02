"""Run a step on every rank and learn who failed, so that all ranks can raise together.

    outcome = run_on_all(comm, lambda: read_my_part())      # collective: one allgather
    if outcome.failures:
        rank, kind, message = outcome.failures[0]             # the first rank that failed
        ...                                                   # raise on every rank, each caller
                                                              # in its own words
    value = outcome.value

Why: a rank that raises alone leaves the others waiting in their next collective. The callers
(:func:`sparsepipe_hpc.parallel.voxelize.agree`, :func:`sparsepipe_hpc.train.agreement.agree`)
decide what each rank raises; this module only runs the step and gathers the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Outcome", "run_on_all", "disagreement"]


@dataclass
class Outcome:
    """``value``: what ``fn`` returned here (None if it raised); ``caught``: this rank's
    exception; ``failures``: ``(rank, exception class name, message)`` of every rank that raised,
    in rank order; ``size``: ranks in the communicator."""

    value: Any
    caught: Optional[BaseException]
    failures: list[tuple[int, str, str]]
    size: int


def run_on_all(comm: Any, fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` on every rank of ``comm`` and allgather which ranks raised. **Collective.**

    The message of a ValueError is its text; of any other exception ``"Class: text"``. A
    ``SystemExit`` (argparse's ``--help``, ``sys.exit``, a signal handler's exit) counts as a
    failure too, of kind ``"SystemExit"`` whatever its subclass: a rank that left without the
    allgather would leave the others waiting (its message: ``"SystemExit: exit status 0"``).
    """
    value = None
    caught: Optional[BaseException] = None
    mine: Optional[tuple[str, str]] = None
    try:
        value = fn()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - every failure must reach the others
        caught = e
        if isinstance(e, SystemExit):
            mine = ("SystemExit", f"{type(e).__name__}: exit status {e.code}")
        else:
            mine = (type(e).__name__, str(e) if isinstance(e, ValueError)
                    else f"{type(e).__name__}: {e}")
    gathered = comm.allgather(mine)
    failures = [(r, m[0], m[1]) for r, m in enumerate(gathered) if m is not None]
    return Outcome(value, caught, failures, len(gathered))


def disagreement(comm: Any, value: Any) -> Optional[str]:
    """None when every rank of ``comm`` passes an equal (hashable) ``value``; else which values
    the ranks passed, each with the first rank that passed it, for a message every rank raises.
    **Collective** (one allgather)."""
    seen = comm.allgather(value)
    if len(set(seen)) == 1:
        return None
    first = {v: seen.index(v) for v in reversed(seen)}  # each distinct value's first rank
    return "; ".join(f"rank {r} and others like it: {v}"
                     for v, r in sorted(first.items(), key=lambda kv: kv[1]))
