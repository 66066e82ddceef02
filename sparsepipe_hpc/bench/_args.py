"""argparse types the benchmarks share: counts that must be whole numbers in range."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonneg_int"]


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
