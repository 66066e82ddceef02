"""Planner: profile a model, describe the machine, predict and search layouts (BaPipe, Dryden).

    python -m sparsepipe_hpc.plan --model unet --ranks 8 --json plan.json   # table + JSON
    mpirun -n 8 python -m sparsepipe_hpc.train --plan plan.json              # or --plan auto

    from sparsepipe_hpc.plan import Machine, profile_model, search, synthetic_batch
    prof = profile_model(net, [synthetic_batch(v, 3, multiple=8) for v in (4000, 8000)])
    best = search(prof, Machine.uniform(8, ranks_per_node=4), batch_size=8).plans[0]

Modules: :mod:`.profile` (per-block times and bytes, fitted in voxels), :mod:`.machine` (devices
and links, ping-pong), :mod:`.cost` (the formulas), :mod:`.partition` (exact stage partition),
:mod:`.search` (candidates and predictions), :mod:`.planfile` (what the trainer and job renderer
read), :mod:`.auto` (``train --plan auto``), :mod:`.cli` (the command).
"""

from sparsepipe_hpc.plan.cost import (Link, bubble_fraction, halo_bytes, halo_time, largest_share,
                                      memory_bytes, pipeline_step_time, ring_allreduce_time,
                                      step_time, uniform_pipeline_step_time)
from sparsepipe_hpc.plan.machine import Machine, MachineError, load_machine, measure_links
from sparsepipe_hpc.plan.partition import (Block, Device, Partition, PartitionError, inflight_1f1b,
                                           inflight_gpipe, partition_stages,
                                           partition_stages_best_order)
from sparsepipe_hpc.plan.planfile import PlanFileError, read_plan
from sparsepipe_hpc.plan.profile import (BlockProfile, Fit, KmapProfile, ModelProfile,
                                         ProfileError, profile_model, synthetic_batch)
from sparsepipe_hpc.plan.search import Plan, SearchError, SearchResult, evaluate, search

__all__ = ["Link", "pipeline_step_time", "uniform_pipeline_step_time", "bubble_fraction",
           "ring_allreduce_time", "step_time", "largest_share", "halo_bytes", "halo_time",
           "memory_bytes", "Block", "Device", "Partition", "PartitionError", "inflight_1f1b",
           "inflight_gpipe", "partition_stages", "partition_stages_best_order", "Machine",
           "MachineError", "load_machine", "measure_links", "PlanFileError", "read_plan",
           "BlockProfile", "Fit", "KmapProfile", "ModelProfile", "ProfileError", "profile_model",
           "synthetic_batch", "Plan", "SearchError", "SearchResult", "evaluate", "search"]
