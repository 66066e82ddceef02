"""Ranks that must agree before they train: one failure or one difference stops every rank.

    cfg = agree(comm, lambda: parse_config(argv))     # SetupError on all ranks if any rank failed
    check_same(comm, "configuration", cfg.to_dict())   # SetupError naming the values that differ
    check_same(comm, "data", {"train": data_fingerprint(train_set)})
    check_grid_fits(grid, shape, stride, cfg)          # pure: the same verdict on every rank

Why: a rank that fails or differs alone leaves the others waiting in the next collective (a hang),
or crashes them there (``MPI_ERR_TRUNCATE``), or trains a silently different run. Each check
here is one small collective (or none), placed before the collective phase it protects.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sparsepipe_hpc.parallel.failures import run_on_all
from sparsepipe_hpc.train.config import TrainConfig

__all__ = ["SetupError", "agree", "check_same", "data_fingerprint", "check_grid_fits",
           "check_model_fits", "free_memory"]


class SetupError(ValueError):
    """Building the trainer failed on some rank; raised on every rank with that rank's message."""


def agree(comm: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raised on any rank, raise on all of them, so no rank is
    left waiting in the next collective. **Collective.**

    A ValueError or OSError (bad input, an unreadable file) becomes :class:`SetupError` on every
    rank, naming the rank it came from. Any other exception is a bug, or an exit (``--help``, a
    signal handler's): the rank that raised it re-raises it (a bug with its traceback, for the
    trainer's excepthook to abort the job; an exit to leave as asked), the others raise
    SetupError naming it.
    """
    outcome = run_on_all(comm, fn)
    if outcome.failures:
        caught = outcome.caught
        if caught is not None and not isinstance(caught, (ValueError, OSError)):
            raise caught
        errors = [f for f in outcome.failures if f[1] != "SystemExit"]
        if not errors:
            rank, _, msg = outcome.failures[0]
            raise SetupError(f"rank {rank} of {outcome.size} left ({msg}: --help, a signal or "
                             "sys.exit) while this rank went on; every rank must get the same "
                             "command line, config file and environment")
        rank, _, msg = errors[0]
        where = f" (rank {rank} of {outcome.size})" if outcome.size > 1 and rank != 0 else ""
        raise SetupError(f"{msg}{where}")
    return outcome.value


def check_same(comm: Any, what: str, value: dict[str, Any]) -> None:
    """Raise SetupError on every rank unless all ranks pass an equal ``value``. **Collective.**

    One allgather of a hash; only when they differ are the values gathered, to name the keys that
    differ (``the ranks disagree on the configuration: lr: rank 0 0.003, rank 1 0.01``).
    """
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    if len(set(comm.allgather(digest))) == 1:
        return
    values = [_flat(v) for v in comm.allgather(value)]
    first = values[0]
    for rank, v in enumerate(values):
        keys = sorted(k for k in set(v) | set(first) if v.get(k) != first.get(k))
        if keys:
            shown = "; ".join(f"{k}: rank 0 {first.get(k)!r}, rank {rank} {v.get(k)!r}"
                              for k in keys[:4])
            more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
            raise SetupError(f"the ranks disagree on the {what} ({shown}{more}); every rank must "
                             f"get the same command line, config file and data")


def _flat(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"samples": 4}} -> {"train.samples": 4}, so a message names the leaf that differs."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def data_fingerprint(dataset: Any) -> dict[str, Any]:
    """What identifies a data split: sample count, classes, channels, file names and sizes, each
    sample's point count, and the digest of its values where the dataset's full check read them
    (``dataset.digest``; None where only the structure was checked)."""
    paths = getattr(dataset, "files", None) or [dataset.path]
    per_sample = getattr(dataset, "sizes", None)
    if per_sample is None:
        per_sample = getattr(dataset, "counts", np.zeros(0))
    return {"samples": len(dataset), "class_names": list(dataset.class_names),
            "in_channels": int(dataset.in_channels),
            "files": [[Path(p).name, os.path.getsize(p)] for p in paths],
            "points": hashlib.sha256(np.asarray(per_sample, np.int64).tobytes()).hexdigest()[:16],
            "content": getattr(dataset, "digest", None)}


def check_grid_fits(grid: Sequence[int], shape: Sequence[int], stride: int,
                    cfg: TrainConfig) -> None:
    """SetupError unless every box of ``grid`` can hold one block of ``stride`` voxels (cuts align
    to the model's total stride, so a box is at least one block wide; pure, same on every rank).

    shape: the voxel grid's spatial shape at level 0, a multiple of ``stride`` on every axis.
    """
    for axis, (ranks, voxels) in enumerate(zip(grid, shape)):
        blocks = voxels // stride
        if ranks > blocks:
            name = "xyz"[axis]
            raise SetupError(
                f"--grid {','.join(map(str, grid))} cuts {name} into {ranks} boxes, but the data "
                f"spans {voxels} voxels along {name} at --voxel-size {cfg.voxel_size} m: {blocks} "
                f"block(s) of the model's total stride {stride} (--depth {cfg.depth}), and every "
                f"box needs at least one; use at most {blocks} rank(s) along {name} in --grid, a "
                f"smaller --voxel-size or a smaller --depth")


def check_model_fits(probe: Any, cfg: TrainConfig, available: int | None,
                     ranks_sharing: int = 1) -> None:
    """SetupError when the training state of ``probe`` (the model built on the ``meta``
    device: shapes, no memory) takes more than ``available`` bytes (this machine's free memory;
    None: unknown, no check) shared by ``ranks_sharing`` ranks (a node's CPU ranks share its
    memory), before the real model is built: a --width or --depth too large for the machine
    then ends with a message, not the kernel's out-of-memory kill. The state is float32
    weights, their gradients and the optimizer's moments (AdamW two, SGD one): 4x or 3x the
    weights, a floor (activations come on top); with pipeline stages each rank holds a part,
    so only the weights are counted. Run under :func:`agree` (free memory differs between
    nodes)."""
    from sparsepipe_hpc.plan.cost import OPTIMIZER_FACTOR

    params = sum(p.numel() for p in probe.parameters())
    weights = 4 * params
    factor = OPTIMIZER_FACTOR.get(cfg.optimizer, 4.0) if cfg.stages <= 1 else 1.0
    need = factor * weights
    if available is None or need * ranks_sharing <= available:
        return
    what = (f"{need / 2**30:.1f} GiB for its float32 weights, gradients and {cfg.optimizer}'s "
            f"state ({factor:g}x the weights)" if factor > 1 else
            f"{need / 2**30:.1f} GiB of float32 weights alone")
    share = (f" for each of its {ranks_sharing} ranks ({available / ranks_sharing / 2**30:.1f}"
             f" GiB each)" if ranks_sharing > 1 else "")
    raise SetupError(
        f"--model {cfg.model} --width {cfg.width} --depth {cfg.depth} has {params:,} "
        f"parameters: {what}, but this machine has {available / 2**30:.1f} GiB free{share}; "
        f"use a smaller --width or --depth (channels double at every level)")


def free_memory(device: Any) -> int | None:
    """Bytes free for tensors on ``device``: the GPU's free memory, or the host's MemAvailable
    (Linux); None where neither can be read."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
