"""The trainer: ``python -m sparsepipe_hpc.train`` (CLI, config, loop, checkpoints, metrics).

    mpirun -n 2 python -m sparsepipe_hpc.train                 # seg, U-Net, default data
    python -m sparsepipe_hpc.train --task cls --steps 200 --out runs/cls

    from sparsepipe_hpc.train import Trainer, parse_config
    result = Trainer(parse_config(["--steps", "20"]), MPI.COMM_WORLD).run()

Modules: ``config`` (options, TOML, task defaults, layout checks), ``loop`` (Trainer: data shard,
loss shares, gradient all-reduce, evaluation, SIGTERM stop), ``checkpoint`` (atomic save, load,
RNG states), ``metrics`` (confusion matrix, IoU, ``metrics.jsonl``), ``__main__`` (entry point).

A run directory holds ``config.json`` (resolved options, layout, versions), ``metrics.jsonl`` (one
``{"kind": "train"|"eval", "step": ..}`` object per line) and ``last.pt`` (the latest checkpoint).
"""

from sparsepipe_hpc.train.checkpoint import CheckpointError
from sparsepipe_hpc.train.config import ConfigError, TrainConfig, parse_config
from sparsepipe_hpc.train.loop import SetupError, Trainer

__all__ = ["Trainer", "TrainConfig", "parse_config", "ConfigError", "CheckpointError",
           "SetupError"]
