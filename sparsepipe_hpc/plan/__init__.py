"""Planner: cost model and exact stage partition (profiler, machine model and search to come).

    from sparsepipe_hpc.plan import Block, Device, Link, partition_stages
    p = partition_stages([Block(time=4.0), Block(time=1.0), Block(time=1.0), Block(time=2.0)],
                         [Device(speed=1.0), Device(speed=0.5)], link=Link(5e-6, 1e-10))
    p.bounds, p.bottleneck, p.step_time()
"""

from sparsepipe_hpc.plan.cost import (Link, bubble_fraction, pipeline_step_time,
                                      ring_allreduce_time, step_time, uniform_pipeline_step_time)
from sparsepipe_hpc.plan.partition import (Block, Device, Partition, PartitionError, inflight_1f1b,
                                           inflight_gpipe, partition_stages,
                                           partition_stages_best_order)

__all__ = ["Link", "pipeline_step_time", "uniform_pipeline_step_time", "bubble_fraction",
           "ring_allreduce_time", "step_time", "Block", "Device", "Partition", "PartitionError",
           "inflight_1f1b", "inflight_gpipe", "partition_stages", "partition_stages_best_order"]
