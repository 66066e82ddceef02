"""The trainer: ``python -m sparsepipe_hpc.train`` (CLI, config, loop, checkpoints, metrics).

    mpirun -n 2 python -m sparsepipe_hpc.train                 # seg, U-Net, default data
    python -m sparsepipe_hpc.train --task cls --steps 200 --out runs/cls

    from sparsepipe_hpc.train import Trainer, parse_config
    result = Trainer(parse_config(["--steps", "20"]), MPI.COMM_WORLD).run()

Modules: ``config`` (options, TOML, task defaults, layout checks), ``loop`` (Trainer: data shard,
loss shares, gradient all-reduce, evaluation, SIGTERM stop), ``agreement`` (ranks agree on
failures, options and data before they train), ``checkpoint`` (atomic save with a
checksummed manifest, verified load, RNG states), ``output`` (atomic writes, OutputError for a full
or read-only ``--out``, stale temporary files), ``metrics`` (confusion matrix, IoU,
``metrics.jsonl``), ``__main__`` (entry point).

A run directory holds ``config.json`` (resolved options, layout, versions), ``metrics.jsonl`` (one
``{"kind": "train"|"eval", "step": ..}`` object per line), ``last.pt`` (the latest checkpoint) and
``last.pt.manifest.json`` (its step, options, layout, versions, size and SHA-256).
"""

from sparsepipe_hpc.train.checkpoint import CheckpointError
from sparsepipe_hpc.train.config import ConfigError, TrainConfig, parse_config
from sparsepipe_hpc.train.agreement import SetupError
from sparsepipe_hpc.train.loop import Trainer
from sparsepipe_hpc.train.output import OutputError

__all__ = ["Trainer", "TrainConfig", "parse_config", "ConfigError", "CheckpointError",
           "OutputError", "SetupError"]
