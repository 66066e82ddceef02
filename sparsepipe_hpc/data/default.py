"""The default data sets: synthetic, made on first use into a cache and reused, MPI-safe.

    from sparsepipe_hpc.data import default_data, SceneDataset, ModelNetDataset
    seg_dir = default_data("seg", comm=MPI.COMM_WORLD)     # <cache>/seg-v1-<hash>/scenes
    train, val = SceneDataset(seg_dir, "train"), SceneDataset(seg_dir, "val")
    cls_dir = default_data("cls")                          # <cache>/cls-v1-<hash>/modelnet
    train, test = ModelNetDataset(cls_dir, "train"), ModelNetDataset(cls_dir, "test")

Sizes (keyword arguments; defaults sized so a width-16 U-Net reaches clearly-above-chance mIoU in
a few minutes on 2 CPU ranks): seg 48 train + 12 val rooms (about 40k points each, 8 classes);
cls 2048 train + 512 test objects of 1024 points (6 classes). Generating both takes a few seconds.

The cache is ``cache_dir``, else ``$SPARSEPIPE_CACHE``, else ``~/.cache/sparsepipe_hpc``; an entry
is keyed by the generator version and every parameter, so changing either makes a new one. Under
MPI only rank 0 of ``comm`` generates, into a temporary directory renamed into place (a crashed or
concurrent run never leaves a half-written entry in use); the other ranks wait on a broadcast of
the outcome, so a failure on rank 0 raises on every rank instead of leaving them hanging. The cache
must be on a file system every rank of ``comm`` can see; this is checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["default_data", "cache_root", "DataGenerationError"]

log = logging.getLogger(__name__)

_SUBDIR = {"seg": "scenes", "cls": "modelnet"}


class DataGenerationError(RuntimeError):
    """Making the default data failed (on this rank or, under MPI, on rank 0)."""


def cache_root(cache_dir: Optional[str | Path] = None) -> Path:
    """The cache directory: ``cache_dir``, ``$SPARSEPIPE_CACHE`` or ``~/.cache/sparsepipe_hpc``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("SPARSEPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparsepipe_hpc"


def _params(task: str, seed: int, train_scenes: int, val_scenes: int, train_objects: int,
            test_objects: int, points_per_object: int) -> dict[str, Any]:
    if task == "seg":
        p = {"train": train_scenes, "val": val_scenes}
    elif task == "cls":
        p = {"train": train_objects, "test": test_objects, "points": points_per_object}
    else:
        raise ValueError(f"task must be 'seg' or 'cls'; got {task!r}")
    from sparsepipe_hpc.data import synth  # lazily: `python -m ...synth` must not find it imported

    for k, v in p.items():
        if int(v) < 1:
            raise ValueError(f"default_data({task!r}): {k} must be >= 1; got {v}")
    return {"task": task, "generator_version": synth.GENERATOR_VERSION, "seed": int(seed),
            **{k: int(v) for k, v in p.items()}}


def _entry_name(params: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    return f"{params['task']}-v{params['generator_version']}-{digest}"


def _generate(params: dict[str, Any], out: Path) -> None:
    """Write the data of ``params`` under ``out`` (the layout's sub-directory is added)."""
    from sparsepipe_hpc.data import synth

    if params["task"] == "seg":
        synth.generate_scenes(out, params["train"], params["val"], params["seed"])
    else:
        synth.generate_objects(out, params["train"], params["test"], params["points"],
                               params["seed"])
    (out / "params.json").write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")


def _make_or_reuse(params: dict[str, Any], root: Path) -> Path:
    """The entry's data directory, generated first if absent (runs on one process only)."""
    entry = root / _entry_name(params)
    data = entry / _SUBDIR[params["task"]]
    if entry.is_dir():
        return data
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
    try:
        t0 = time.perf_counter()
        log.info("generating default %s data into %s", params["task"], entry)
        _generate(params, tmp)
        try:
            os.rename(tmp, entry)  # atomic: readers see no entry or a complete one
        except OSError:
            if not entry.is_dir():  # not a lost race with another job: a real failure
                raise
        log.info("default %s data ready in %.1f s", params["task"], time.perf_counter() - t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return data


def default_data(task: str, comm: Any = None, cache_dir: Optional[str | Path] = None, *,
                 seed: int = 0, train_scenes: int = 48, val_scenes: int = 12,
                 train_objects: int = 2048, test_objects: int = 512,
                 points_per_object: int = 1024) -> Path:
    """The directory of the default ``task`` data (``"seg"``: ``train.h5``/``val.h5`` in the
    scene layout; ``"cls"``: ``train0.h5``/``test0.h5`` in the ModelNet layout), made if absent.

    ``comm`` is an mpi4py communicator (collective: every rank must call) or None for one process.
    """
    params = _params(task, seed, train_scenes, val_scenes, train_objects, test_objects,
                     points_per_object)
    root = cache_root(cache_dir)
    if comm is None or comm.Get_size() == 1:
        try:
            return _make_or_reuse(params, root)
        except Exception as e:
            raise DataGenerationError(
                f"default_data({task!r}) in {root}: {type(e).__name__}: {e}") from e

    # Rank 0 makes the data; a broadcast of (ok, path-or-message) releases every other rank.
    outcome: tuple[bool, str] = (False, "")
    error: Optional[BaseException] = None
    if comm.Get_rank() == 0:
        try:
            outcome = (True, str(_make_or_reuse(params, root)))
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank
            outcome, error = (False, f"{type(e).__name__}: {e}"), e
    ok, value = comm.bcast(outcome, root=0)
    if not ok:
        raise DataGenerationError(f"default_data({task!r}) failed on rank 0 of {comm.Get_size()} "
                                  f"in {root}: {value}") from error
    path = Path(value)
    seen = comm.allgather(path.is_dir())
    if not all(seen):
        blind = [r for r, s in enumerate(seen) if not s]
        raise DataGenerationError(
            f"default_data({task!r}): rank(s) {blind} cannot see {path}, made by rank 0; put the "
            "cache on a file system shared by all ranks (cache_dir= or $SPARSEPIPE_CACHE)")
    return path
