"""Validation of HDF5 inputs: one error type and the checks every reader shares.

    with open_h5(path) as f:
        xyz = require_dataset(f, path, "scenes/room_0000/xyz")
        check_shape(path, xyz, (None, 3), "[P, 3]")
        check_kind(path, xyz, "f", "floating point")
        values = read(path, xyz)
        check_finite(path, xyz.name, values)

Every message names the file, the dataset, the rule and the offending values, so that a corrupt
file found on one rank of a thousand can be fixed without a debugger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import h5py
import numpy as np

__all__ = [
    "DataFormatError", "open_h5", "require_dataset", "check_shape", "check_kind", "check_finite",
    "check_range", "read", "read_str_list",
]


class DataFormatError(ValueError):
    """A data file breaks its layout: unreadable, missing a dataset, mis-shaped, wrong dtype,
    non-finite values or labels out of range."""


def open_h5(path: str | Path) -> h5py.File:
    """Open ``path`` read-only, turning h5py's OSError into a DataFormatError that says why."""
    p = Path(path)
    if not p.exists():
        raise DataFormatError(f"{p}: no such file")
    if p.is_dir():
        raise DataFormatError(f"{p}: is a directory, expected an HDF5 file")
    try:
        return h5py.File(p, "r")
    except OSError as e:
        msg = str(e)
        if "truncated" in msg:
            why = "the file is truncated (an interrupted copy or write?)"
        elif "signature" in msg:
            why = "not an HDF5 file (no HDF5 signature)"
        elif "unable to lock file" in msg:
            why = ("the file cannot be locked: another process writes it, or the file system "
                   "has no locks (Lustre, NFS: set HDF5_USE_FILE_LOCKING=FALSE)")
        else:
            why = "not a readable HDF5 file"
        raise DataFormatError(f"{p}: {why}; h5py said: {msg}") from e


def require_dataset(f: h5py.Group, path: str | Path, name: str) -> h5py.Dataset:
    """``f[name]``, which must exist and be a dataset (not a group)."""
    try:
        obj = f.get(name)
    except (OSError, KeyError, RuntimeError) as e:  # a damaged object header
        raise DataFormatError(f"{path}: cannot open '{name}' ({e}); the file may be corrupt") from e
    if obj is None:
        where = f.name if f.name != "/" else "the file root"
        have = sorted(f.keys())[:10]
        raise DataFormatError(f"{path}: missing dataset '{name}' (under {where}: {have})")
    if not isinstance(obj, h5py.Dataset):
        raise DataFormatError(f"{path}: '{obj.name}' must be a dataset; it is a "
                              f"{type(obj).__name__}")
    return obj


def check_shape(path: str | Path, ds: h5py.Dataset, shape: Sequence[Optional[int]],
                rule: str) -> None:
    """Raise unless ``ds.shape`` matches ``shape`` (None: any size) — ``rule`` is the contract's
    spelling, e.g. ``"[P, 3]"``."""
    ok = len(ds.shape) == len(shape) and all(s is None or s == d for s, d in zip(shape, ds.shape))
    if not ok:
        raise DataFormatError(f"{path}: dataset '{ds.name}' must have shape {rule}; "
                              f"got {tuple(ds.shape)}")


def check_kind(path: str | Path, ds: h5py.Dataset, kinds: str, rule: str) -> None:
    """Raise unless the dtype's kind (numpy's ``dtype.kind``, e.g. ``"f"``, ``"iu"``) is allowed."""
    if ds.dtype.kind not in kinds:
        raise DataFormatError(f"{path}: dataset '{ds.name}' must be {rule}; got dtype {ds.dtype}")


def read(path: str | Path, ds: h5py.Dataset, sel: Any = ()) -> np.ndarray:
    """``ds[sel]``; a failed read (truncated data, bad chunk) becomes a DataFormatError."""
    try:
        return np.asarray(ds[sel])
    except (OSError, RuntimeError) as e:
        raise DataFormatError(f"{path}: cannot read dataset '{ds.name}' ({e}); the file may be "
                              "truncated or corrupt") from e


def check_finite(path: str | Path, name: str, values: np.ndarray, offset: int = 0) -> None:
    """Raise if ``values`` hold NaN or inf, naming how many and the first position (``offset``:
    the first row's index in the dataset, when ``values`` are a slice of it)."""
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            first = (first[0] + int(offset),) + first[1:]
            raise DataFormatError(f"{path}: dataset '{name}' must be finite; {int(bad.sum())} "
                                  f"NaN/inf value(s), first at index {first}")


def check_range(path: str | Path, name: str, values: np.ndarray, lo: float, hi: float,
                what: str) -> None:
    """Raise unless every value lies in ``[lo, hi]`` (inclusive); ``what`` says why that range."""
    if values.size == 0:
        return
    vmin, vmax = values.min(), values.max()
    if vmin < lo or vmax > hi:
        i = int(np.argmax((values < lo) | (values > hi)))
        bad = values.reshape(-1)[i]
        raise DataFormatError(f"{path}: dataset '{name}' must lie in [{lo}, {hi}] ({what}); "
                              f"got values in [{vmin}, {vmax}], first offender {bad} at flat "
                              f"index {i}")


def read_str_list(path: str | Path, obj: h5py.HLObject, attr: str) -> list[str]:
    """An attribute holding a list of strings (h5py may hand back bytes or a 0-d array)."""
    if attr not in obj.attrs:
        raise DataFormatError(f"{path}: missing attribute '{attr}' on '{obj.name}'")
    raw = obj.attrs[attr]
    items = np.atleast_1d(np.asarray(raw, dtype=object)).tolist()
    out = []
    for x in items:
        if isinstance(x, bytes):
            x = x.decode("utf-8")
        if not isinstance(x, str):
            raise DataFormatError(f"{path}: attribute '{attr}' on '{obj.name}' must be a list of "
                                  f"strings; got {raw!r}")
        out.append(x)
    return out
