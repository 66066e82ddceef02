"""Plan files: the JSON a planner writes and the trainer and job renderer read.

    from sparsepipe_hpc.plan.planfile import read_plan, layout_options
    plan = read_plan("plan.json")       # checked dict: ranks, replicas, stages, grid, ...
    layout_options(plan)                # {"replicas": 2, "grid": (2, 1, 1), "stages": 1, ...}

A plan file is the first entry of ``python -m sparsepipe_hpc.plan --json FILE``'s ``plans`` list,
or the object itself (``{"chosen": {...}}`` is read too)::

    {"ranks": 4, "replicas": 1, "stages": 2, "grid": [2, 1, 1], "micro_batches": 4,
     "balance": [5, 3], "stage_order": [1, 0], "pipeline_schedule": "1f1b", "nodes": 1,
     "gpus_per_node": 4, ...}

Only the layout keys matter to the trainer (:data:`LAYOUT_FLAGS`); the predictions beside them are
for people. Pure: no MPI, so every rank reads the same file and raises the same error.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Union

__all__ = ["PlanFileError", "read_plan", "layout_options", "check_plan", "LAYOUT_FLAGS"]

#: Trainer option (TrainConfig field) -> its flag, for every value a plan sets.
LAYOUT_FLAGS = {"replicas": "--replicas", "stages": "--stages", "grid": "--grid",
                "balance": "--balance", "stage_order": "--stage-order",
                "micro_batches": "--micro-batches", "pipeline_schedule": "--pipeline-schedule"}


class PlanFileError(ValueError):
    """A plan file that cannot be read or breaks a rule."""


def _count(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanFileError(f"{where}: {key} is {value!r}; it must be a whole number >= 1")
    return value


def check_plan(plan: Mapping[str, Any], where: str = "plan") -> dict[str, Any]:
    """Check a plan's layout keys; returns a plain dict with ``ranks`` filled in."""
    if not isinstance(plan, Mapping):
        raise PlanFileError(f"{where} must be a JSON object; got {type(plan).__name__}")
    plan = dict(plan.get("chosen", plan)) if isinstance(plan.get("chosen"), Mapping) else \
        dict(plan)
    for key in ("replicas", "stages", "grid"):
        if key not in plan:
            raise PlanFileError(f"{where} has no {key!r}; a plan needs replicas, stages and grid "
                                f"(write one with python -m sparsepipe_hpc.plan --json FILE)")
    for key in ("replicas", "stages", "micro_batches"):
        if key in plan:
            _count(where, key, plan[key])
    grid = plan["grid"]
    if (not isinstance(grid, list) or len(grid) != 3
            or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid)):
        raise PlanFileError(f"{where}: grid {grid!r} must be three positive integers [x, y, z]")
    if "balance" in plan:
        bal = plan["balance"]
        if (not isinstance(bal, list) or len(bal) != plan["stages"]
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bal)):
            raise PlanFileError(f"{where}: balance {bal!r} must list {plan['stages']} positive "
                                f"block counts, one per stage")
    order = plan.get("stage_order", list(range(plan["stages"])))
    if (not isinstance(order, list) or any(isinstance(o, bool) or not isinstance(o, int)
                                           for o in order)
            or sorted(order) != list(range(plan["stages"]))):
        raise PlanFileError(f"{where}: stage_order {order!r} must list each of the "
                            f"{plan['stages']} stage(s) 0..{plan['stages'] - 1} once")
    if plan.get("pipeline_schedule", "1f1b") not in ("1f1b", "gpipe"):
        raise PlanFileError(f"{where}: pipeline_schedule {plan['pipeline_schedule']!r} must be "
                            f"1f1b or gpipe")
    ranks = plan["replicas"] * plan["stages"] * math.prod(grid)
    if "ranks" in plan and plan["ranks"] != ranks:
        raise PlanFileError(f"{where}: ranks {plan['ranks']!r} but replicas {plan['replicas']} x "
                            f"stages {plan['stages']} x grid {'x'.join(map(str, grid))} = {ranks}")
    plan["ranks"] = ranks
    return plan


def read_plan(path: Union[str, os.PathLike[str]]) -> dict[str, Any]:
    """Read and check a plan file (see the module)."""
    where = f"--plan {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlanFileError(f"{where}: cannot be read ({e.strerror}); write it with python -m "
                            f"sparsepipe_hpc.plan --json FILE, or pass --plan auto") from None
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{where}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("plans"), list) and data["plans"]:
        data = data["plans"][0]
    return check_plan(data, where)


def layout_options(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's option values (TrainConfig fields) a checked plan sets."""
    out: dict[str, Any] = {"replicas": plan["replicas"], "stages": plan["stages"],
                           "grid": tuple(plan["grid"])}
    if "micro_batches" in plan:
        out["micro_batches"] = plan["micro_batches"]
    if plan["stages"] > 1 and "balance" in plan:
        out["balance"] = ",".join(map(str, plan["balance"]))
    if list(plan.get("stage_order", range(plan["stages"]))) != list(range(plan["stages"])):
        out["stage_order"] = ",".join(map(str, plan["stage_order"]))
    if "pipeline_schedule" in plan:
        out["pipeline_schedule"] = plan["pipeline_schedule"]
    return out
