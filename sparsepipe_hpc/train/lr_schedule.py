"""The learning-rate schedule: linear warm-up then cosine (or constant), and its restore on resume.

    sched = LambdaLR(optimizer, LrSchedule("cosine", total_steps=1000, warmup=50))
    note = restore_schedule(sched, ckpt["scheduler"], lr=cfg.lr, step=ckpt["step"])
    if note: print(note)   # the current options plan another schedule than the checkpoint's run

The schedule is a pure function of (step, total steps) with the current ``--lr``,
``--schedule`` and ``--warmup``, rebuilt at every start; a checkpoint gives only the position.
The same options continue the uninterrupted run bitwise, and a larger ``--steps`` continues on the
cosine of the new total (the rate at the resumed step jumps to that curve; the note says so),
instead of running the extra steps at the old schedule's final rate of 0.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["LrSchedule", "restore_schedule"]


class LrSchedule:
    """Learning-rate factor per step: linear warm-up, then cosine to 0 at ``total_steps``, or
    constant. A pure function of the step and the options: a resumed run rebuilds it from its own
    options (see the module docstring); its fields ride along in ``LambdaLR.state_dict`` only to
    say, on resume, what the checkpoint's run had planned."""

    def __init__(self, kind: str, total_steps: int, warmup: int = 0):
        self.kind, self.total, self.warmup = kind, max(1, total_steps), warmup

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * t))


def restore_schedule(sched: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any], *,
                     lr: float, step: int) -> Optional[str]:
    """Take the scheduler's position (``step``) from the checkpoint's ``saved`` state and its
    schedule from the current options (``sched``'s :class:`LrSchedule`, peak rate ``lr``); set
    this step's rate exactly as LambdaLR computes it (``base * factor``), so that unchanged
    options continue bitwise. Returns a note when the checkpoint's run planned another schedule,
    else None."""
    groups = sched.optimizer.param_groups
    old_fn = dict((saved.get("lr_lambdas") or [None])[0] or {})
    old_base = saved.get("base_lrs")
    sched.load_state_dict({**saved, "lr_lambdas": [None] * len(groups),
                           "base_lrs": [lr] * len(groups), "last_epoch": step})
    for group, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * fn(step)
    sched._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports  # noqa: SLF001
    new_fn = dict(vars(sched.lr_lambdas[0]))
    if old_fn == new_fn and old_base == sched.base_lrs:
        return None
    old_lr = old_base[0] if old_base else None
    return (f"learning-rate schedule from the current options: {new_fn['kind']} over "
            f"{new_fn['total']} steps (warm-up {new_fn['warmup']}, peak lr "
            f"{lr:g}); the checkpoint's run planned {old_fn.get('kind', '?')} "
            f"over {old_fn.get('total', '?')} steps (warm-up {old_fn.get('warmup', '?')},"
            f" peak lr {old_lr if old_lr is None else f'{old_lr:g}'}); step "
            f"{step + 1} runs at lr {groups[0]['lr']:.4g}")
