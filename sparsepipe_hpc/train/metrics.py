"""Evaluation metrics (confusion matrix, accuracy, IoU) and the run's ``metrics.jsonl`` log.

    cm = ConfusionMatrix(num_classes=8)
    cm.update(logits.argmax(1), labels)      # on every rank, its own voxels
    cm.allreduce(ctx)                        # sum over ranks: each voxel lives on exactly one
    cm.overall_accuracy(), cm.mean_iou(), cm.iou()

    log = MetricsLog(out / "metrics.jsonl", enabled=ctx.is_root)
    log.write({"kind": "train", "step": 10, "loss": 0.42})

IoU of class k is ``TP / (TP + FP + FN)``; a class that appears in neither the predictions nor the
labels has no IoU (``None`` in the list, left out of the mean), as in S3DIS/ScanNet evaluation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

from sparsepipe_hpc.train.output import (OutputError, as_output_error, atomic_write,
                                           writing)

__all__ = ["ConfusionMatrix", "MetricsLog", "read_metrics", "format_summary"]


class ConfusionMatrix:
    """``matrix[t, p]``: how many items of true class t were predicted as p (int64 [K, K])."""

    def __init__(self, num_classes: int):
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1; got {num_classes}")
        self.num_classes = num_classes
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Count predicted vs true classes; ``pred`` and ``target`` int [N] in [0, K)."""
        if pred.shape != target.shape:
            raise ValueError(f"pred {list(pred.shape)} and target {list(target.shape)} must have "
                             "the same shape")
        k = self.num_classes
        for name, v in (("pred", pred), ("target", target)):
            # Out of range, target * K + pred would count in another class's cell.
            if v.numel() and not 0 <= int(v.min()) <= int(v.max()) < k:
                raise ValueError(f"{name} holds classes {int(v.min())}..{int(v.max())}; the "
                                 f"confusion matrix counts classes 0..{k - 1} (num_classes={k})")
        idx = target.long().reshape(-1) * k + pred.long().reshape(-1)
        self.matrix += torch.bincount(idx, minlength=k * k).view(k, k)

    def allreduce(self, ctx: Any) -> "ConfusionMatrix":
        """Sum over the ranks of ``ctx`` (a ParallelContext); in place, returns self."""
        ctx.allreduce(self.matrix)
        return self

    @property
    def total(self) -> int:
        return int(self.matrix.sum())

    def overall_accuracy(self) -> float:
        """Fraction of items predicted right (NaN when nothing was counted)."""
        total = self.total
        return float(self.matrix.diagonal().sum()) / total if total else math.nan

    def iou(self) -> list[Optional[float]]:
        """Per-class IoU; None for a class absent from both predictions and labels."""
        m = self.matrix.double()
        tp = m.diagonal()
        union = m.sum(0) + m.sum(1) - tp
        return [float(t / u) if u > 0 else None for t, u in zip(tp.tolist(), union.tolist())]

    def mean_iou(self) -> float:
        vals = [v for v in self.iou() if v is not None]
        return sum(vals) / len(vals) if vals else math.nan

    def mean_class_accuracy(self) -> float:
        """The mean over classes of the fraction of their samples predicted right; a class with
        no samples is left out (as :meth:`iou` leaves it out), NaN if none has any."""
        m = self.matrix.double()
        total = m.sum(1)
        present = total > 0
        if not bool(present.any()):
            return math.nan
        return float((m.diagonal()[present] / total[present]).mean())


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead (strict parsers reject the bare token)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsLog:
    """Appends one JSON object per line to ``path``; does nothing when not ``enabled`` (ranks > 0).

    Each line is flushed and fsync'ed at ``sync`` points, so a killed run leaves whole lines.

    A failed write (full or read-only file system) does not raise where it happens, on rank 0 alone
    while the other ranks go on into the next collective: the log keeps the
    :class:`~sparsepipe_hpc.train.output.OutputError`, stops writing, and reports it through
    ``failed``/``error`` (which the trainer agrees on across ranks at its next step) and by raising
    it from :meth:`check`, :meth:`sync` and :meth:`close`.
    """

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        self.error: Optional[OutputError] = None
        if enabled:
            with writing(self.path, "metrics log"):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")

    @property
    def failed(self) -> bool:
        """Whether a write has failed (see :attr:`error`)."""
        return self.error is not None

    def check(self) -> None:
        """Raise the OutputError of the first failed write, if any."""
        if self.error is not None:
            raise self.error

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = as_output_error(e, self.path, "metrics log")
        f, self._file = self._file, None
        try:
            if f is not None:
                f.close()
        except OSError:
            pass  # the buffered bytes cannot be written either; the error above says why

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(_clean(record)) + "\n")
            self._file.flush()
        except OSError as e:
            self._fail(e)

    def sync(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as e:
                self._fail(e)
        self.check()

    def last_train_step(self) -> Optional[int]:
        """The highest ``step`` of the train records in the file (None: none, or not rank 0);
        a line cut short by a crash is skipped."""
        return self.last_step("train")

    def last_step(self, kind: str) -> Optional[int]:
        """The highest ``step`` of the records of ``kind`` ("train", "eval") in the file (None:
        none, or not rank 0); a line cut short by a crash is skipped."""
        if self._file is None or not self.path.exists():
            return None
        self._file.flush()
        steps = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("kind") == kind:
                steps.append(int(rec.get("step", 0)))
        return max(steps, default=None)

    def truncate_after(self, step: int) -> int:
        """Drop records with ``step`` > ``step`` (written by a run that died after its last
        checkpoint, and about to be written again by the resumed run). Returns how many."""
        if self._file is None or not self.path.exists():
            return 0
        self._file.close()
        keep, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line cut short by a crash
                continue
            if isinstance(rec, dict) and rec.get("step", 0) > step:
                dropped += 1
            else:
                keep.append(line)
        text = "".join(line + "\n" for line in keep).encode("utf-8")
        atomic_write(self.path, lambda f: f.write(text), "metrics log")
        with writing(self.path, "metrics log"):
            self._file = open(self.path, "a", encoding="utf-8")
        return dropped

    def copy_from(self, path: Path, up_to: int) -> int:
        """Append the records of the log at ``path`` with ``step`` <= ``up_to`` (a resumed run's
        own records before its checkpoint, kept in another directory); lines cut short by a
        crash are skipped. Returns how many (0 where there is no such file)."""
        if self._file is None or not path.is_file():
            return 0
        kept = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("step", 0) <= up_to:
                self.write(rec)
                kept += 1
        return kept

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                self._fail(e)
            self._file = None
        self.check()


def read_metrics(path: str | Path, kind: Optional[str] = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, optionally only those of one ``kind``."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def format_summary(train: Optional[dict[str, Any]], evaluation: Optional[dict[str, Any]],
                   seconds: float) -> str:
    """One line: steps, last loss, eval metrics and wall time."""
    parts = ["done:"]
    if train is not None:
        parts += [f"step {train['step']}", f"epoch {train['epoch']}", f"loss {train['loss']:.4f}"]
    if evaluation is not None:
        for key in ("oa", "miou", "acc"):
            if key in evaluation and evaluation[key] is not None:
                parts.append(f"{key} {_fmt(evaluation[key])}")
    parts.append(f"time {seconds:.1f} s")
    return " ".join(parts)

