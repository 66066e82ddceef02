"""The run directory's files: atomic writes, their temporary names, stale-temp cleanup, disk checks.

    check_out_dir(out, need_bytes=2**20)             # before step 1: writable, room to save
    removed = remove_stale_temps(out, ["last.pt"])   # ``.last.pt.tmp-<pid>`` left by a killed run
    digest = atomic_write(out / "config.json", lambda f: f.write(b"{}"), "run configuration")
    digest.bytes, digest.sha256

Every failure to write (a full or read-only file system, a quota, a vanished directory, and torch's
``RuntimeError: ... unexpected pos`` when a disk fills in the middle of ``torch.save``) becomes an
:class:`OutputError` that names the file, says why (free space included) and how to fix it.

Temporary names: ``<dir>/.<name>.tmp-<pid>`` beside the target ``<dir>/<name>`` (same file system,
so the rename is atomic). A process killed while writing (SIGKILL, a node failure) leaves that file
behind; :func:`remove_stale_temps` deletes exactly these names for the files a run writes, and
nothing else, when the next run starts in that directory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Optional

__all__ = ["OutputError", "FileDigest", "temp_path", "parse_temp_name", "write_temp", "commit",
           "atomic_write", "file_digest", "remove_stale_temps", "check_out_dir", "writing",
           "as_output_error", "format_bytes"]

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


class OutputError(OSError):
    """A file of the run directory (``--out``) could not be written; the message says which
    and why."""


@dataclass(frozen=True)
class FileDigest:
    """Size and SHA-256 (hex) of a file's bytes as written."""

    bytes: int
    sha256: str


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # pragma: no cover


def _free(directory: Path) -> Optional[int]:
    for d in (directory, *directory.parents):
        try:
            return shutil.disk_usage(d).free
        except OSError:
            continue
    return None


def _explain(e: BaseException, path: Path, free: Optional[int]) -> str:
    """Why writing ``path`` failed and what to do, from the exception and the free space."""
    code = getattr(e, "errno", None)
    cause = f"{type(e).__name__}: {e}"
    room = f"{format_bytes(free)} free" if free is not None else "free space unknown"
    if code in _FULL or (free is not None and free < 1 << 20):
        return (f"{cause}; the file system holding it is full ({room}): free space, or pass "
                "--out on a file system with room for the run")
    if code in _DENIED:
        return (f"{cause}; the directory is not writable: pass --out on a writable file system "
                "(or fix the directory's permissions)")
    return f"{cause} ({room}); check the file system holding it, or pass --out elsewhere"


def as_output_error(e: BaseException, path: str | Path, what: str) -> OutputError:
    """An OutputError saying that writing ``what`` (e.g. "checkpoint") to ``path`` failed with
    ``e``, why (free space included) and what to do; its ``__cause__`` is ``e``."""
    path = Path(path)
    err = OutputError(f"cannot write the {what} {path}: {_explain(e, path, _free(path.parent))}")
    err.__cause__ = e
    return err


@contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Turn any failure inside the block into an OutputError naming ``what`` and ``path``.
    KeyboardInterrupt and other BaseExceptions pass through unchanged."""
    try:
        yield
    except OutputError:
        raise
    except Exception as e:  # noqa: BLE001 - torch reports a full disk as RuntimeError
        raise as_output_error(e, path, what) from e


def temp_path(path: str | Path, pid: Optional[int] = None) -> Path:
    """``<dir>/.<name>.tmp-<pid>`` (this process's pid by default): where ``path`` is written."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


def parse_temp_name(name: str) -> Optional[tuple[str, int]]:
    """``(target name, pid)`` for a temporary name made by :func:`temp_path`, else None."""
    m = _TEMP.match(name)
    return (m["name"], int(m["pid"])) if m else None


def file_digest(path: str | Path, chunk: int = 1 << 22) -> FileDigest:
    """Size and SHA-256 of a file, read in chunks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            n += len(block)
    return FileDigest(n, h.hexdigest())


def _fsync_dir(directory: Path) -> None:
    try:  # persist a rename (the directory entry); not possible on every platform
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_temp(path: str | Path, write: Callable[[BinaryIO], object], what: str
               ) -> tuple[Path, FileDigest]:
    """Write ``path``'s new bytes with ``write(f)`` into its temporary file, flush and fsync it;
    return ``(temp, digest)``. On any failure the temporary file is removed: no debris."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with writing(path, what):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            return tmp, file_digest(tmp)
    except BaseException:
        # Whatever stopped us (an error, KeyboardInterrupt, Terminated), leave no partial file.
        tmp.unlink(missing_ok=True)
        raise


def commit(tmp: Path, path: str | Path, what: str) -> None:
    """Rename ``tmp`` over ``path`` (atomic on POSIX file systems, Lustre and GPFS included) and
    persist the rename; on failure the temporary file is removed and the old ``path`` stays."""
    path = Path(path)
    try:
        with writing(path, what):
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], what: str) -> FileDigest:
    """Write ``path`` so that readers see the old file or the new one, whole; returns its digest."""
    tmp, digest = write_temp(path, write, what)
    commit(tmp, path, what)
    return digest


def remove_stale_temps(directory: str | Path, names: Iterable[str]) -> list[tuple[Path, int]]:
    """Delete ``.<name>.tmp-<pid>`` files of ``directory`` for the given target ``names`` (left by
    a process killed while writing); other files, similar-looking ones included, are kept.
    Returns ``[(path, size in bytes)]`` of what was removed. Call it before this run writes."""
    directory, wanted = Path(directory), set(names)
    removed: list[tuple[Path, int]] = []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        parsed = parse_temp_name(entry.name)
        if parsed is None or parsed[0] not in wanted or not entry.is_file():
            continue
        size = entry.stat().st_size
        with writing(entry, "stale temporary file (removing it)"):
            entry.unlink(missing_ok=True)
        removed.append((entry, size))
    return removed


def check_out_dir(out: str | Path, need_bytes: int) -> None:
    """Before step 1: ``out`` exists (created if needed), takes a file, and its file system has
    ``need_bytes`` free (room for the next checkpoint beside the current one)."""
    out = Path(out)
    for p in (out, *out.parents):  # mkdir would say "File exists", and the disk is not at fault
        if p.exists() and not p.is_dir():
            raise OutputError(f"--out {out}: {p} is a file, not a directory; pass --out with a "
                              f"directory for the run (created where missing)")
    with writing(out, "run directory (--out)"):
        out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "write-test", lambda f: f.write(b"sparsepipe_hpc write test\n"),
                 "write test file")
    (out / "write-test").unlink(missing_ok=True)
    free = _free(out)
    if free is not None and free < need_bytes:
        raise OutputError(f"--out {out}: its file system has {format_bytes(free)} free, but a "
                          f"checkpoint of this model needs about {format_bytes(need_bytes)}: free "
                          "space, or pass --out on a file system with room for the run")
