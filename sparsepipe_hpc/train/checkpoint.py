"""Training checkpoints: atomic writes, loading with clear errors, RNG state capture.

    state = {"step": 10, "model": model.state_dict(), ...}
    atomic_save(state, out / "last.pt")     # temp file in the same dir, flush + fsync, os.replace
    ckpt = load_checkpoint(out / "last.pt") # CheckpointError if missing, truncated or foreign
    set_rng_state(ckpt["rng"][rank])

A checkpoint is one ``torch.save`` file holding a dict with ``format``/``version`` (checked on
load), ``step``, ``epoch``, ``model``, ``optimizer``, ``scheduler``, ``loader`` (ShardedBatches
state), ``rng`` (one :func:`rng_state` per rank, gathered by rank 0), ``layout``, ``config`` and
``versions``. Augmentation needs no saved state: each sample's generator is seeded by
``(seed, epoch, sample index)`` (see :mod:`sparsepipe_hpc.train.loop`).

Atomicity: the bytes go to ``.<name>.tmp-<pid>`` beside the target, are flushed and fsync'ed, and
only then renamed over the target (``os.replace`` is atomic on POSIX file systems, Lustre and GPFS
included); the directory is fsync'ed so the rename itself survives a crash. A crash at any point
leaves either the old checkpoint or the new one, never a torn file.

Loading uses ``weights_only=False``: the file holds numpy RNG states and plain dicts that the
restricted unpickler rejects. Load only checkpoints you wrote (as for any pickle).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["CheckpointError", "FORMAT", "VERSION", "atomic_save", "load_checkpoint",
           "rng_state", "set_rng_state", "resolve_resume", "check_compatible", "LAST"]

FORMAT = "sparsepipe-train-checkpoint"
VERSION = 1
LAST = "last.pt"

#: Options that change the model's shape or the meaning of the saved loader position: a checkpoint
#: written under other values cannot be continued.
MUST_MATCH = ("task", "model", "width", "depth", "batch_size", "voxel_size", "seed", "optimizer")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, not ours, or incompatible with the options."""


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that readers see the old file or the new one, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Whatever stopped us (an error, KeyboardInterrupt, Terminated), leave no debris behind.
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    try:  # persist the rename (the directory entry); not possible on every platform
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by the trainer; raise CheckpointError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--resume {path}: no such checkpoint file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a torn or foreign file
        raise CheckpointError(f"--resume {path}: not a readable checkpoint "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: not a sparsepipe_hpc training checkpoint "
                              f"(format {ckpt.get('format') if isinstance(ckpt, dict) else None!r},"
                              f" expected {FORMAT!r})")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"--resume {path}: checkpoint version {ckpt.get('version')!r}; this "
                              f"trainer reads version {VERSION}")
    return ckpt


def rng_state(aug: Optional[torch.Generator] = None) -> dict[str, Any]:
    """This process's random states: torch (CPU), numpy's global, python's, and ``aug``."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if aug is not None:
        state["aug"] = aug.get_state()
    return state


def set_rng_state(state: dict[str, Any], aug: Optional[torch.Generator] = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if aug is not None and "aug" in state:
        aug.set_state(state["aug"])


def resolve_resume(resume: Optional[str], out: Path) -> Optional[Path]:
    """The checkpoint to load: None (fresh), ``<out>/last.pt`` for ``auto`` when it exists (else
    None: a first start under a requeueing scheduler), or the given path."""
    if resume is None:
        return None
    if resume == "auto":
        last = out / LAST
        return last if last.is_file() else None
    return Path(resume)


def check_compatible(ckpt: dict[str, Any], config: dict[str, Any], path: Path) -> None:
    """Raise if the checkpoint was written with options that the current run must share."""
    saved = ckpt.get("config", {})
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {config.get(k)!r}"
            for k in MUST_MATCH if k in saved and saved.get(k) != config.get(k)]
    if diff:
        raise CheckpointError(f"--resume {path}: the checkpoint was written with other options "
                              f"({'; '.join(diff)}); pass the checkpoint's values to continue it")
