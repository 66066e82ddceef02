"""argparse helpers the benchmarks share: counts that must be whole numbers in range, and a
``--sections`` subset."""

from __future__ import annotations

import argparse
from typing import Sequence

__all__ = ["positive_int", "nonneg_int", "sections"]


def positive_int(text: str) -> int:
    """A whole number >= 1 (sizes, counts, repeats)."""
    return _at_least(text, 1)


def nonneg_int(text: str) -> int:
    """A whole number >= 0 (warm-up rounds, a rank index)."""
    return _at_least(text, 0)


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= {low}; got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}; got {value}")
    return value


def sections(p: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """``--sections a,b``: the names, each one of ``known`` (else ``p.error`` naming them)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad or not names:
        p.error(f"--sections {text!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; "
                f"pass a comma-separated subset of {','.join(known)}")
    return names
