"""Start-up check of the installed sparse-convolution stack: exactly one spconv build.

    from sparsepipe_hpc.deps import check_spconv
    check_spconv()          # DependencyError naming both builds and the pip line that fixes it

spconv ships one distribution per build (``spconv`` for the CPU, ``spconv-cu126`` and friends for
CUDA), and every one of them writes the same ``spconv`` package (and its ``cumm``/``cumm-cuXXX``
dependency the same ``cumm`` package): installing a second build over the first leaves whichever
files were written last, a mix spconv's own docs say to avoid ("uninstall spconv first"). The
extras of ``pyproject.toml`` name one build each (``cpu``, ``cuda12``, ``cuda13``); this check
catches two of them in one environment before anything runs on the mix.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Iterable, Optional

__all__ = ["DependencyError", "installed_builds", "check_spconv", "spconv_available"]

_FAMILIES = {"spconv": re.compile(r"^spconv(-cu\d+)?$"), "cumm": re.compile(r"^cumm(-cu\d+)?$")}


class DependencyError(ImportError):
    """The installed packages cannot work together (or a needed one is missing)."""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_builds(family: str = "spconv",
                     dists: Optional[Iterable[metadata.Distribution]] = None
                     ) -> list[tuple[str, str]]:
    """(distribution name, version) of every installed build of ``family`` (spconv or cumm)."""
    pattern = _FAMILIES[family]
    found = set()
    for d in (metadata.distributions() if dists is None else dists):
        name = d.metadata["Name"]
        if name and pattern.match(_normalized(name)):
            found.add((_normalized(name), d.version))
    return sorted(found)


def _describe(name: str) -> str:
    m = re.search(r"-cu(\d+)$", name)
    if not m:
        return "CPU build"
    v = m.group(1)
    return f"CUDA {v[:-1]}.{v[-1]} build"


def check_spconv(required: bool = False,
                 dists: Optional[Iterable[metadata.Distribution]] = None) -> Optional[str]:
    """The one installed spconv distribution's name (None when there is none and ``required`` is
    false). Raises DependencyError for two or more builds, or for none when ``required``."""
    dists = list(metadata.distributions() if dists is None else dists)
    builds = installed_builds("spconv", dists)
    if len(builds) > 1:
        names = " and ".join(f"{n} {v} ({_describe(n)})" for n, v in builds)
        cumm = installed_builds("cumm", dists)
        remove = " ".join([n for n, _ in builds] + [n for n, _ in cumm])
        raise DependencyError(
            f"spconv is installed more than once: {names}; every build writes the same 'spconv' "
            f"(and 'cumm') package, so the files are a mix of them. Keep one: pip uninstall -y "
            f"{remove} && pip install -e '.[cpu]' (CPU), '.[cuda12]' or '.[cuda13]' (GPU)")
    if not builds:
        if required:
            raise DependencyError(
                "spconv is not installed; the spconv engine needs one build of it: pip install "
                "-e '.[cpu]' (CPU), '.[cuda12]' or '.[cuda13]' (GPU), or pass --engine torch")
        return None
    return builds[0][0]


def spconv_available() -> bool:
    """Whether exactly one spconv build is installed (two raise DependencyError)."""
    return check_spconv() is not None
