"""``python -m sparsepipe_hpc.train``: the trainer's entry point, with or without mpirun.

    python -m sparsepipe_hpc.train --steps 50                     # one process (singleton MPI)
    mpirun -n 2 python -m sparsepipe_hpc.train                    # 2 data-parallel replicas
    mpirun -n 4 python -m sparsepipe_hpc.train --grid 2,1,1       # 2 replicas x 2 spatial ranks
    mpirun -n 2 python -m sparsepipe_hpc.train --config run.toml --resume auto --out runs/a
    mpirun -n 4 python -m sparsepipe_hpc.train --plan auto        # the planner picks the layout

Exit status: 0 after training or after a checkpoint asked for by SIGTERM or SIGUSR1, 2 for bad
input or a loss that turned NaN or inf (the message is printed once, by rank 0; every rank
exits), 1 with an MPI abort of all ranks for any other exception on any rank. Ranks agree
before training starts: on whether the options parsed, on the resolved options themselves and
on a fingerprint of the data (a rank with another config file, --lr or data copy is an error
naming the values, not a hang or a silently different run).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]

PROG = "sparsepipe_hpc.train"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse options, build the trainer on every rank, train; returns 0 (raises SystemExit(2) for
    bad input)."""
    # For OpenMP code that reads it later (torch's own pool is sized below by --threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from launch.env import check_world, prefer_shared_memory
    from launch.errors import LaunchError
    from launch.run import abort_on_exception, install_sigterm_handler

    prefer_shared_memory()  # before MPI starts: on one node, skip probing network transports

    abort_on_exception()  # an uncaught exception on one rank ends the job instead of hanging it
    from mpi4py import MPI

    import torch

    from sparsepipe_hpc.data import DataFormatError, DataGenerationError
    from sparsepipe_hpc.parallel.layout import LayoutError
    from sparsepipe_hpc.train.checkpoint import CheckpointError
    from sparsepipe_hpc.train.config import (ConfigError, fit_default_batch, option_notes,
                                              parse_config, resolve_layout)
    from sparsepipe_hpc.train.device import compute_threads
    from sparsepipe_hpc.train.agreement import SetupError, agree, check_same
    from sparsepipe_hpc.train.loop import DivergedError, Trainer
    from sparsepipe_hpc.train.output import OutputError

    comm = MPI.COMM_WORLD
    from sparsepipe_hpc.deps import DependencyError, check_spconv

    user_errors = (ConfigError, LayoutError, SetupError, CheckpointError, DataFormatError,
                   DataGenerationError, DependencyError)
    try:
        agree(comm, check_spconv)  # two spconv builds in one environment: stop before any work
        # Every rank must train the same run: a config file that fails on one rank only, or a
        # different --grid, --steps or --lr on one rank, stops every rank here with the values.
        cfg = agree(comm, lambda: parse_config(argv))
        try:  # after --help; raises only in a world of 1, where each process is alone
            check_world(comm.Get_size())  # srun or mpirun that started processes MPI sees alone
        except LaunchError as e:
            raise SetupError(str(e)) from None
        check_same(comm, "configuration", cfg.to_dict())
        # Before --plan auto, whose profile then runs on the threads that will train (and
        # --engine auto picks its engine by them); Trainer sets them too, for library callers.
        torch.set_num_threads(compute_threads(cfg, comm))
        if cfg.plan == "auto":  # rank 0 profiles the model on the data and picks the layout
            from sparsepipe_hpc.plan.auto import auto_plan
            cfg = auto_plan(cfg, comm)
        cfg, note = fit_default_batch(cfg, comm.Get_size())
        if comm.Get_rank() == 0:
            for line in ([note] if note else []) + option_notes(cfg):
                print(line, flush=True)
        resolve_layout(cfg, comm.Get_size())  # the batch/replica checks, before any collective
        install_sigterm_handler()  # flag only: the loop agrees on it and checkpoints collectively
        trainer = Trainer(cfg, comm)
    except user_errors as e:
        # Every rank got the same error (setup is deterministic, and collective steps agree on
        # failures): say it once, and let every rank leave.
        if comm.Get_rank() == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        # Raised inside the handler, so that `python -m launch run` can print the error of a
        # rank that failed alone (the message above comes from rank 0 only).
        raise SystemExit(2) from e
    try:
        trainer.run()
        trainer.close()
    except (SetupError, OutputError, DivergedError) as e:
        # Raised on every rank together (a full or read-only disk at a checkpoint or metrics
        # write is agreed before anyone goes on; the loss is summed over the ranks); any other
        # exception aborts the job.
        if comm.Get_rank() == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
