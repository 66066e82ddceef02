"""Which MPI library mpi4py will load, asked before MPI is initialized.

Usage::

    from launch.mpilib import library_version, parse_library_version, shared_memory_btl

    text = library_version()              # "Open MPI v5.0.11, package: ..." or None
    parse_library_version(text)           # LibraryVersion(name="openmpi", version=(5, 0, 11))
    shared_memory_btl(text)               # "sm" (Open MPI >= 5), "vader" (3.x, 4.x), else None

Open MPI's shared-memory transport (BTL) is called ``vader`` from 3.0 to 4.x and ``sm`` from 5.0
(the old ``sm`` was removed in 3.0, and ``vader`` was renamed ``sm`` in 5.0). Naming the wrong one
in ``OMPI_MCA_btl`` makes ``MPI_Init`` fail, so the name is read from the library's own version
string. That string comes from ``MPI_Get_library_version``, which the MPI standard allows before
``MPI_Init``: the library is opened (as mpi4py itself would open it) but not initialized, so
``OMPI_MCA_*`` variables set afterwards still apply. Anything unknown gives ``None``: the caller
then leaves Open MPI's defaults alone.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import re
import sys
from typing import NamedTuple, Optional

__all__ = ["LibraryVersion", "library_version", "parse_library_version", "shared_memory_btl"]

# MPI_MAX_LIBRARY_VERSION_STRING is 256 in Open MPI and 8192 in MPICH: take the larger.
_BUFFER = 8192


class LibraryVersion(NamedTuple):
    """``name``: ``"openmpi"``, ``"mpich"``, ``"intelmpi"``, ``"mvapich"`` or ``"other"``;
    ``version``: the numbers of its version (empty when none could be read)."""

    name: str
    version: tuple[int, ...]


def _from_extension() -> Optional[str]:
    """Call ``MPI_Get_library_version`` in the library mpi4py's extension module links to."""
    try:
        spec = importlib.util.find_spec("mpi4py.MPI")  # mpi4py >= 4 opens libmpi here (no init)
    except (ImportError, ValueError, RuntimeError, OSError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(tuple(
            importlib.machinery.EXTENSION_SUFFIXES)):
        return None
    try:
        # Opening the extension as a plain shared library runs no Python code; its libmpi
        # dependency comes with it, and dlsym finds the MPI function there (mpi4py's own
        # ``python -m mpi4py --mpi-library`` does the same).
        function = ctypes.CDLL(spec.origin).MPI_Get_library_version
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    buffer, length = ctypes.create_string_buffer(_BUFFER), ctypes.c_int(0)
    if function(buffer, ctypes.byref(length)) != 0:
        return None
    raw = buffer.raw[:max(0, min(length.value, _BUFFER))]
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


_cached: list[Optional[str]] = []


def library_version() -> Optional[str]:
    """The MPI library's version string, without initializing MPI; ``None`` when it cannot be read
    (no mpi4py, no library, an MPI older than MPI-3). Cached: the library does not change."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:  # already imported: ask it (allowed before and after MPI_Init)
        return str(mpi.Get_library_version())
    if not _cached:
        _cached.append(_from_extension())
    return _cached[0]


_PATTERNS = (  # first match wins; Intel MPI and MVAPICH before the MPICH they derive from
    ("openmpi", re.compile(r"\bOpen MPI v(\d+(?:\.\d+)*)")),
    ("intelmpi", re.compile(r"Intel\(R\) MPI Library (\d+(?:\.\d+)*)")),
    ("mvapich", re.compile(r"MVAPICH\d* Version\s*:\s*(\d+(?:\.\d+)*)")),
    ("mpich", re.compile(r"MPICH Version:\s*(\d+(?:\.\d+)*)")),
)


def parse_library_version(text: Optional[str]) -> Optional[LibraryVersion]:
    """The library's name and version numbers from its version string; ``None`` for ``None``."""
    if text is None:
        return None
    for name, pattern in _PATTERNS:
        match = pattern.search(text)
        if match is not None:
            return LibraryVersion(name, tuple(int(p) for p in match.group(1).split(".")))
    return LibraryVersion("other", ())


def shared_memory_btl(text: Optional[str]) -> Optional[str]:
    """Open MPI's shared-memory BTL for the library whose version string is ``text``.

    ``"sm"`` for Open MPI 5 and later, ``"vader"`` for 3.0 to 4.x; ``None`` for anything else
    (another MPI, Open MPI before 3.0, an unreadable string): set nothing then.
    """
    found = parse_library_version(text)
    if found is None or found.name != "openmpi" or not found.version:
        return None
    major = found.version[0]
    if major >= 5:
        return "sm"
    if major >= 3:
        return "vader"
    return None
