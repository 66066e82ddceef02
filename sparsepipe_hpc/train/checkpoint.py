"""Training checkpoints: atomic writes with a checksummed manifest, verified loading, RNG states.

    state = {"step": 10, "model": model.state_dict(), ...}
    save_checkpoint(state, out / "last.pt", info)  # + last.pt.manifest.json (sizes, SHA-256)
    ckpt = load_checkpoint(out / "last.pt")        # CheckpointError if missing, torn, corrupt,
    set_rng_state(ckpt["rng"][rank])               # foreign, or not what its manifest records
    removed = remove_stale_temps(out)              # .last.pt.tmp-<pid> left by a killed run

A checkpoint is one ``torch.save`` file holding a dict with ``format``/``version`` (checked on
load), ``step``, ``epoch``, ``model``, ``optimizer``, ``scheduler``, ``loader`` (ShardedBatches
state), ``rng`` (one :func:`rng_state` per rank, gathered by rank 0), ``layout``, ``config`` and
``versions``. Augmentation needs no saved state: each sample's generator is seeded by
``(seed, epoch, sample index)`` (see :mod:`sparsepipe_hpc.train.loop`).

Beside it, ``<name>.manifest.json`` describes it (JSON, for people and tools)::

    {"format": "sparsepipe-train-manifest", "version": 1, "checkpoint": "last.pt",
     "current":  {"step": 9, "epoch": 2, "total_steps": 9, "config": {...}, "layout": {...},
                  "versions": {...},
                  "files": {"last.pt": {"bytes": 18034112, "sha256": "9f2c..."}}},
     "previous": {... the entry of the checkpoint this one replaced, or null}}

Loading reads the file once, hashes those bytes and accepts them only if they match the ``current``
or the ``previous`` entry (size and SHA-256), and the step inside matches that entry's step. A
checkpoint without a manifest (written by hand or by an older trainer) loads unverified; the
trainer says so.

Atomicity: the bytes go to ``.<name>.tmp-<pid>`` beside the target and are flushed, fsync'ed and
hashed; then the manifest is replaced (atomically) by one whose ``current`` is the new file and
``previous`` the old one, and only then is the temporary file renamed over the target. A crash at
any point leaves an old or new checkpoint that its manifest accepts, never a torn file, and at most
a temporary file that the next run removes (:func:`remove_stale_temps`). Every write failure is an
:class:`~sparsepipe_hpc.train.output.OutputError` naming the file.

Loading uses ``weights_only=False``: the file holds numpy RNG states and plain dicts that the
restricted unpickler rejects. Load only checkpoints you wrote (as for any pickle).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from sparsepipe_hpc.train import output
from sparsepipe_hpc.train.output import FileDigest, OutputError

__all__ = ["CheckpointError", "OutputError", "FileDigest", "FORMAT", "VERSION", "MANIFEST_FORMAT",
           "LAST",
           "RUN_FILES", "atomic_save", "save_checkpoint", "load_checkpoint", "manifest_path",
           "entry_digest",
           "read_manifest", "remove_stale_temps", "rng_state", "set_rng_state", "resolve_resume",
           "check_compatible"]

FORMAT = "sparsepipe-train-checkpoint"
VERSION = 1
MANIFEST_FORMAT = "sparsepipe-train-manifest"
MANIFEST_VERSION = 1
LAST = "last.pt"
#: Files the trainer writes into its run directory (their temporary files are ours to remove).
RUN_FILES = (LAST, f"{LAST}.manifest.json", "config.json", "metrics.jsonl", "write-test")

#: Options that change the model's shape or the meaning of the saved loader position: a checkpoint
#: written under other values cannot be continued.
MUST_MATCH = ("task", "model", "width", "depth", "batch_size", "voxel_size", "seed", "optimizer",
              "stages", "balance",  # a pipelined checkpoint holds one optimizer state per stage
              "micro_batches", "deferred_bn")  # what BatchNorm normalizes over, and its buffers


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, corrupt, not ours, or incompatible with the
    options."""


def manifest_path(path: str | Path) -> Path:
    """``<dir>/<name>.manifest.json`` for the checkpoint ``<dir>/<name>``."""
    path = Path(path)
    return path.with_name(f"{path.name}.manifest.json")


def remove_stale_temps(directory: str | Path) -> list[tuple[Path, int]]:
    """Remove the temporary files of :data:`RUN_FILES` in ``directory`` that a killed process
    left (``.last.pt.tmp-<pid>`` ...); see
    :func:`sparsepipe_hpc.train.output.remove_stale_temps`."""
    return output.remove_stale_temps(directory, RUN_FILES)


def _save_to(f: Any, obj: Any) -> None:
    torch.save(obj, f)


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that readers see the old file or the new one, whole
    (no manifest: :func:`save_checkpoint` writes the trainer's). OutputError when it cannot."""
    output.atomic_write(path, lambda f: _save_to(f, obj), "checkpoint")
    return Path(path)


def read_manifest(path: str | Path) -> Optional[dict[str, Any]]:
    """The manifest beside checkpoint ``path``; None when there is none. CheckpointError when it
    exists but is not a manifest."""
    mpath = manifest_path(path)
    if not mpath.is_file():
        return None
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {path}: its manifest {mpath} is unreadable ({e}); "
                              "restore it, or delete it to load the checkpoint unverified"
                              ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"--resume {path}: {mpath} is not a checkpoint manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}"
                              f", expected {MANIFEST_FORMAT!r})")
    return manifest


def _on_disk_entry(path: Path, on_disk: Optional[FileDigest]) -> Optional[dict[str, Any]]:
    """The entry of the existing manifest that describes the file now at ``path`` (its digest
    ``on_disk`` when the caller knows it, else hashed here), or None."""
    try:
        old = read_manifest(path)
    except CheckpointError:
        return None  # an unreadable manifest is replaced, not trusted
    if old is None or not path.is_file():
        return None
    digest = on_disk or output.file_digest(path)
    for entry in (old.get("current"), old.get("previous")):
        rec = entry.get("files", {}).get(path.name) if isinstance(entry, dict) else None
        if rec == {"bytes": digest.bytes, "sha256": digest.sha256}:
            return entry
    return None


def entry_digest(entry: Optional[dict[str, Any]], name: str) -> Optional[FileDigest]:
    """The digest a manifest entry records for file ``name`` (None if it records none)."""
    rec = (entry or {}).get("files", {}).get(name)
    return FileDigest(rec["bytes"], rec["sha256"]) if isinstance(rec, dict) else None


def save_checkpoint(state: dict[str, Any], path: str | Path, info: dict[str, Any],
                    on_disk: Optional[FileDigest] = None) -> FileDigest:
    """Write ``state`` to ``path`` and its manifest (``info``: step, epoch, total_steps, config,
    layout, versions), crash-safe in the order the module docstring gives. ``on_disk``: the
    digest of the checkpoint now at ``path`` when the caller knows it (what it last wrote or
    verified), else that file is hashed once, so that ``previous`` names what is really on disk.
    Returns the new file's digest."""
    path = Path(path)
    tmp, digest = output.write_temp(path, lambda f: _save_to(f, state), "checkpoint")
    try:
        entry = {**info, "files": {path.name: {"bytes": digest.bytes, "sha256": digest.sha256}}}
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                    "checkpoint": path.name, "current": entry,
                    "previous": _on_disk_entry(path, on_disk)}
        text = json.dumps(manifest, indent=1) + "\n"
        output.atomic_write(manifest_path(path), lambda f: f.write(text.encode()),
                            "checkpoint manifest")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    output.commit(tmp, path, "checkpoint")
    return digest


def _verify(path: Path, data: bytes, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest entry that ``data`` (the bytes of ``path``) matches, or CheckpointError."""
    size, sha = len(data), hashlib.sha256(data).hexdigest()
    entries = [e for e in (manifest.get("current"), manifest.get("previous"))
               if isinstance(e, dict)]
    for entry in entries:
        rec = entry.get("files", {}).get(path.name)
        if isinstance(rec, dict) and rec.get("bytes") == size and rec.get("sha256") == sha:
            return entry
    cur = (entries[0].get("files", {}).get(path.name) if entries else None) or {}
    want = int(cur.get("bytes", -1))
    if want >= 0 and size < want:
        what = f"it is truncated: {size:,} of the {want:,} bytes recorded"
    elif want >= 0 and size > want:
        what = f"it is longer than recorded: {size:,} bytes, the manifest says {want:,}"
    else:
        what = (f"its contents changed: SHA-256 {sha[:16]}... but the manifest records "
                f"{str(cur.get('sha256'))[:16]}... for those {size:,} bytes")
    steps = [e.get("step") for e in entries]
    raise CheckpointError(f"--resume {path}: the file does not match its manifest "
                          f"{manifest_path(path)} (step {steps[0] if steps else '?'}): {what}; the "
                          "checkpoint is corrupt (a disk fault, or a copy cut short): restore it "
                          "from a backup, or start afresh without --resume (deleting the manifest "
                          "loads the file unverified, at your own risk)")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by the trainer, verified against its manifest when there is one;
    raise CheckpointError saying what is wrong. ``ckpt["manifest"]`` is the matching manifest
    entry, or None when the checkpoint has no manifest."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--resume {path}: no such checkpoint file")
    manifest = read_manifest(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"--resume {path}: cannot read it ({e})") from None
    entry = _verify(path, data, manifest) if manifest is not None else None
    try:
        ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
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
    if entry is not None and entry.get("step") != ckpt.get("step"):
        raise CheckpointError(f"--resume {path}: holds step {ckpt.get('step')} but its manifest "
                              f"{manifest_path(path)} records step {entry.get('step')} for these "
                              "bytes; the two were not written together: restore both from one run")
    ckpt["manifest"] = entry
    return ckpt


def rng_state(aug: Optional[torch.Generator] = None,
              device: Optional[torch.device] = None) -> dict[str, Any]:
    """This process's random states: torch (CPU), numpy's global, python's, ``aug``, and the
    CUDA generator of ``device`` when it is a GPU (dropout and the like draw from it there)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if aug is not None:
        state["aug"] = aug.get_state()
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], aug: Optional[torch.Generator] = None,
                  device: Optional[torch.device] = None) -> None:
    """Restore :func:`rng_state`; the CUDA state only on a GPU ``device`` (a CPU run resuming a
    GPU checkpoint, or the reverse, keeps its own CUDA stream: nothing on the CPU draws from it)."""
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
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
        hint = ""
        from sparsepipe_hpc.train.config import TASK_DEFAULTS

        default = TASK_DEFAULTS.get(config.get("task", ""), {}).get("batch_size")
        was = saved.get("batch_size")
        if "batch_size" in config.get("defaulted", ()) and config.get("batch_size") != default \
                and isinstance(was, int) and was != config.get("batch_size"):
            counts = [k for k in range(1, was + 1) if was % k == 0]
            shown = ", ".join(map(str, counts[:8])) + (", ..." if len(counts) > 8 else "")
            hint = (f" (--batch-size was left at its default {default}, which grew to a multiple "
                    f"of this run's replicas: pass --batch-size {was} and run a number of "
                    f"replicas that divides it: {shown})")
        raise CheckpointError(f"--resume {path}: the checkpoint was written with other options "
                              f"({'; '.join(diff)}); pass the checkpoint's values to continue "
                              f"it{hint}")
