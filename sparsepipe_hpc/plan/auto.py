"""``train --plan auto``: profile the run's model on its own data and pick the layout.

    cfg = auto_plan(cfg, comm)     # collective: rank 0 profiles and searches, every rank applies

Rank 0 voxelizes batches of the first 1, 2 and 4 training samples (capped by the batch size: the
sizes micro-batches have, so the voxel fit interpolates), profiles the model on them on its own
training device in its ``--precision`` (:func:`~sparsepipe_hpc.plan.profile.profile_model` under
the run's autocast, 3 repeats), and searches the
layouts of the job's ranks on a machine of that many ranks: every rank the same speed, each
with the memory its device has free now (a GPU's; a CPU rank's share of its node's), the
launcher's ranks per node, default links; CPU ranks share the cores rank 0's node's ranks may
run on. Devices of unequal memory make the search weigh stage orders too (``--stage-order``).
It keeps every layout option the user set (``cfg.plan_fixed``). The chosen plan is broadcast;
every rank applies it. A failure on any rank (no device, unreadable data, nothing fits) is raised
on every rank.

The pick rests on timings, so two runs may pick different layouts when plans are close; a run
that must resume under the same layout (a checkpoint holds per-stage shards) should write its
plan once (``python -m sparsepipe_hpc.plan --json FILE``) and pass ``--plan FILE``. The chosen
layout is recorded in the run's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["auto_plan", "plan_for_config"]


def plan_for_config(cfg: Any, world_size: int, data_dir: Path, repeats: int = 3,
                    device: Any = "cpu", ranks_per_node: Optional[int] = None,
                    cores_per_node: Optional[int] = None,
                    memory: Optional[Sequence[float]] = None) -> Any:
    """The best :class:`~sparsepipe_hpc.plan.search.Plan` for ``cfg`` on ``world_size`` ranks,
    ``ranks_per_node`` of them per node (default: all on one), profiled on ``device`` (the one the
    run computes on: GPU timings plan a GPU run) in ``cfg.precision``. CPU ranks share
    ``cores_per_node`` cores (``Machine.core_share``; None: a device each, as GPU ranks have).
    ``memory``: bytes each rank may use (None: no limit)."""
    import torch

    from sparsepipe_hpc.data import ModelNetDataset, SceneDataset, collate, grid_for
    from sparsepipe_hpc.nn import build_model
    from sparsepipe_hpc.plan.machine import Machine
    from sparsepipe_hpc.plan.profile import profile_model
    from sparsepipe_hpc.plan.search import search
    from sparsepipe_hpc.train.device import precision_dtype

    seg = cfg.task == "seg"
    data = SceneDataset(data_dir, "train") if seg else ModelNetDataset(data_dir, "train")
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.in_channels, data.num_classes, width=cfg.width,
                        depth=cfg.depth, engine=cfg.engine).to(device)
    torch.random.set_rng_state(state)
    origin, shape = grid_for(data, cfg.voxel_size, multiple=model.total_stride)
    sizes = sorted({min(k, len(data), cfg.batch_size) for k in (1, 2, 4)})
    batches = [collate([data[i] for i in range(k)], cfg.voxel_size, origin, shape,
                       clip=True).x.to(device) for k in sizes]
    prof = profile_model(model, batches, repeats=repeats, name=cfg.model,
                         autocast=precision_dtype(cfg.precision))
    fixed: dict[str, Any] = {}
    for key in cfg.plan_fixed:
        value = getattr(cfg, key)
        if key in ("balance", "stage_order") and value is not None:
            value = tuple(int(v) for v in str(value).split(","))
        fixed[key] = value
    fixed.pop("pipeline_schedule", None)
    if cfg.input == "distributed":  # an unpipelined spatial group (check_input_options)
        fixed.update(stages=1, micro_batches=1)
    cpu = torch.device(device).type == "cpu"
    machine = Machine.build([1.0] * world_size,
                            list(memory) if memory is not None else [math.inf] * world_size,
                            ranks_per_node or world_size,
                            cores_per_node=cores_per_node if cpu else None)
    result = search(prof, machine, cfg.batch_size, schedule=cfg.pipeline_schedule,
                    optimizer=cfg.optimizer, fixed=fixed, extent=shape)
    return result.plans[0]


def auto_plan(cfg: Any, comm: Any, log: Optional[Any] = print) -> Any:
    """``cfg`` with the layout of the best plan for ``comm``'s ranks (and ``plan_ranks`` set:
    resolved, so a second call returns it as it is). **Collective.**"""
    from mpi4py import MPI

    from launch.env import detect
    from sparsepipe_hpc.data import default_data
    from sparsepipe_hpc.plan.machine import node_cores
    from sparsepipe_hpc.train.agreement import agree, free_memory
    from sparsepipe_hpc.train.device import resolve_device

    if cfg.plan != "auto" or cfg.plan_ranks is not None:   # not asked, or resolved already
        return cfg
    data_dir = Path(cfg.data) if cfg.data else default_data(cfg.task, comm=comm)
    rank0 = comm.Get_rank() == 0
    info = detect(comm)  # collective where the launcher leaves the node layout unsaid
    per_node = comm.allreduce(info.local_size, op=MPI.MAX)
    cores = node_cores(comm)

    def pick(memory: Sequence[float]) -> Any:
        device = resolve_device(cfg.device, info.local_rank)
        return plan_for_config(cfg, comm.Get_size(), data_dir, device=device,
                               ranks_per_node=per_node, cores_per_node=cores, memory=memory)

    def my_memory() -> float:  # what this rank's device has free now, shared on a CPU node
        device = resolve_device(cfg.device, info.local_rank)
        free = free_memory(device)
        sharing = info.local_size if device.type == "cpu" else 1
        return math.inf if free is None else free / sharing

    memory = comm.allgather(agree(comm, my_memory))
    plan = agree(comm, lambda: pick(memory) if rank0 else None)
    plan = comm.bcast(plan, root=0)
    if rank0 and log is not None:
        log(f"--plan auto: {' '.join(plan.trainer_args())} (predicted {plan.step_time:.3g} s "
            f"per step on {plan.ranks} rank(s))")
    changes = {"replicas": plan.replicas, "stages": plan.stages, "grid": plan.grid,
               "micro_batches": plan.micro_batches,
               "balance": ",".join(map(str, plan.balance)) if plan.stages > 1 else cfg.balance,
               "stage_order": (",".join(map(str, plan.stage_order)) if plan.moves_stages
                               else None)}
    return dataclasses.replace(cfg, plan_ranks=comm.Get_size(),
                               **{k: v for k, v in changes.items() if k not in cfg.plan_fixed})
