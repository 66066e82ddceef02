"""Pipeline parallelism: schedules as per-stage action lists, checked and drawn without MPI.

    from sparsepipe_hpc.pipeline import make_schedule, validate, format_schedule, simulate
    sched = make_schedule("1f1b", stages=4, micro_batches=8, skips=[(0, 3)])
    validate(sched)                          # ScheduleError names stage, action and rule
    print(format_schedule(sched))            # ASCII grid of the unit-time run
    tl = simulate(sched, fwd_time=[1, 1, 1.5, 1], bwd_time=2.0)
    bubble_fraction(tl), peak_activations(sched), to_chrome_trace(tl)

Modules: ``schedule`` (actions, GPipe and 1F1B), ``replay`` (the MPI-free interpreter),
``validate`` (rules and deadlock check), ``simulate`` (timelines, bubble, memory), ``render``
(grid, Chrome trace). On these, with tensors and MPI (import them by module): ``carry`` (stage
partition; which stage makes and uses each carry entry, so skips go straight to their decoder),
``p2p`` (size-prefixed non-blocking stage messages, kernel maps rebuilt from coordinates),
``executor`` (runs one stage's program; micro-batch splitting).
"""

from sparsepipe_hpc.pipeline.render import format_schedule, to_chrome_trace
from sparsepipe_hpc.pipeline.replay import Event, message_key, replay
from sparsepipe_hpc.pipeline.schedule import (KINDS, Action, Op, Schedule, ScheduleError,
                                              make_edges, make_schedule)
from sparsepipe_hpc.pipeline.simulate import (Timeline, bubble_fraction, peak_activations,
                                              simulate, theoretical_bubble)
from sparsepipe_hpc.pipeline.validate import SEND_SEMANTICS, validate

__all__ = ["KINDS", "Op", "Action", "Schedule", "ScheduleError", "make_schedule", "make_edges",
           "validate", "SEND_SEMANTICS", "replay", "message_key", "Event", "Timeline",
           "simulate", "bubble_fraction", "peak_activations", "theoretical_bubble",
           "format_schedule", "to_chrome_trace"]
