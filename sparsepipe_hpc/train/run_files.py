"""What the trainer writes besides checkpoints: ``--out`` made ready, ``config.json``, the trace.

    metrics = open_out(out, checkpoint_bytes(model, "adamw", world_size=4), say=print,
                       resumed_from=out / "last.pt", step=40)  # metrics.jsonl cut back to step 40
    write_config(out, config_record(cfg, layout, out=out, ...))  # options, layout, grid, sizes
    write_trace(recorder, comm, ctx.position, trace="trace.json", plot=None, title="...", say=print)

The file mechanics (atomic writes, temporary names, disk checks) are
:mod:`sparsepipe_hpc.train.output`'s; this module decides what goes in them. Rank 0 alone writes;
the trainer runs these under :func:`~sparsepipe_hpc.train.agreement.agree` so a failure reaches
every rank.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sparsepipe_hpc.parallel.layout import Position, RankLayout
from sparsepipe_hpc.train import checkpoint as ckpt_io
from sparsepipe_hpc.train.agreement import agree
from sparsepipe_hpc.train.config import TrainConfig
from sparsepipe_hpc.train.metrics import MetricsLog
from sparsepipe_hpc.train.output import atomic_write, check_out_dir, format_bytes
from sparsepipe_hpc.tracing import Recorder, gather_chrome_trace

__all__ = ["versions", "checkpoint_bytes", "open_out", "lost_steps_note", "config_record",
           "write_config", "write_trace", "plot_title"]


def versions(comm: Any) -> dict[str, str]:
    """The library versions and sizes of this run, as checkpoints and ``config.json`` record
    them (all values strings)."""
    import mpi4py
    from mpi4py import MPI

    import sparsepipe_hpc

    try:
        import spconv
        spconv_version = getattr(spconv, "__version__", "?")
    except ImportError:  # pragma: no cover - spconv is a dependency
        spconv_version = "missing"
    return {"sparsepipe_hpc": sparsepipe_hpc.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "spconv": spconv_version,
            "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "world_size": str(comm.Get_size()), "threads_per_rank": str(torch.get_num_threads())}


def checkpoint_bytes(model: torch.nn.Module, optimizer: str, world_size: int) -> int:
    """About how large a checkpoint of ``model`` and its ``optimizer`` ("sgd" or "adamw") is
    (weights, buffers, one or two moments per parameter, RNG states), plus a MiB of slack."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 if optimizer == "adamw" else 1
    return weights + moments * params + world_size * (64 << 10) + (1 << 20)


def open_out(out: Path, need_bytes: int, say: Callable[[str], None], *,
             resumed_from: Optional[Path] = None, step: int = 0) -> MetricsLog:
    """Rank 0: remove temporary files left in ``out`` by a killed run, check that ``out`` is
    writable with ``need_bytes`` free (OutputError otherwise), open ``metrics.jsonl``; resumed
    (from the checkpoint ``resumed_from`` at ``step``): cut it back to that step, saying which
    steps are trained again, or, for a checkpoint of another directory, replace it with that
    run's records up to ``step`` (what it held was another run's); not resumed: empty it,
    saying so if an earlier run left records (a requeued ``--resume auto`` job killed before
    its first checkpoint appended to them)."""
    removed = ckpt_io.remove_stale_temps(out)  # first: they may be what fills the disk
    check_out_dir(out, need_bytes)
    if removed:
        say(f"removed {len(removed)} temporary file(s) left in {out} by a run that "
            f"died while writing ({format_bytes(sum(n for _, n in removed))}): "
            + ", ".join(p.name for p, _ in removed))
    metrics = MetricsLog(out / "metrics.jsonl", enabled=True)
    if resumed_from is not None and resumed_from.resolve().parent != out.resolve():
        if metrics.truncate_after(0):
            say(f"note: {out / 'metrics.jsonl'} held the records of another run than the one "
                f"{resumed_from} continues: they are replaced")
        source = resumed_from.parent / "metrics.jsonl"
        if metrics.copy_from(source, step):
            say(f"the log continues {source}: its records up to step {step} are copied")
    elif resumed_from is not None:
        note = lost_steps_note(metrics.last_train_step(), step, resumed_from, out)
        if note is not None:
            say(note)
        metrics.truncate_after(step)
    elif metrics.truncate_after(0):  # a run here before, with no checkpoint to continue
        say(f"note: {out / 'metrics.jsonl'} held the records of an earlier run in {out} that "
            f"this run does not continue (no checkpoint, or no --resume): they are replaced")
    return metrics


def lost_steps_note(reached: Optional[int], step: int, resume: Path, out: Path) -> Optional[str]:
    """Which steps the previous run trained after its last checkpoint (``reached``: the last
    train step in its ``metrics.jsonl``; ``step``: the resumed checkpoint's): it was killed
    before it could save them (Open MPI's mpirun, for one, kills its ranks 0.5 s after its own
    SIGTERM, too soon for them to checkpoint or even print), so they are trained again. None
    when nothing was lost."""
    if reached is None or reached <= step:
        return None
    return (f"note: the previous run in {out} reached step {reached}, but "
            f"{resume} holds step {step}: steps {step + 1}-{reached} were "
            "lost (the run was killed before it could checkpoint them) and are trained "
            "again")


def config_record(cfg: TrainConfig, layout: RankLayout, *, out: Path, data_dir: Path,
                  origin: Sequence[float], shape: Sequence[int], stride: int,
                  splits: tuple[Any, Any], total_steps: int, steps_per_epoch: int,
                  local_batch: int, resumed_from: Optional[Path], parameters: int,
                  comm: Any) -> dict[str, Any]:
    """What ``config.json`` holds: the options, the run directory and data, the layout, the grid
    (``origin`` in metres, ``shape`` in voxels), the sizes of the (train, val) ``splits``, the
    steps, the checkpoint resumed from, the model's parameter count and :func:`versions`."""
    train_set, val_set = splits
    return {"options": cfg.to_dict(), "out": str(out), "data": str(data_dir),
            "layout": {"replicas": layout.replicas, "stages": layout.stages,
                       "grid": list(layout.grid), "world_size": layout.size,
                       "text": str(layout)},
            "grid": {"origin_m": list(origin), "spatial_shape": list(shape),
                     "voxel_size_m": cfg.voxel_size, "total_stride": stride},
            "data_sizes": {"train": len(train_set), "val": len(val_set),
                           "num_classes": train_set.num_classes,
                           "class_names": list(train_set.class_names)},
            "steps": {"total": total_steps, "per_epoch": steps_per_epoch,
                      "local_batch": local_batch},
            "resumed_from": str(resumed_from) if resumed_from else None,
            "parameters": parameters,
            "versions": versions(comm)}


def write_config(out: Path, info: dict[str, Any]) -> None:
    """Write ``info`` (the run's options, layout, grid, data sizes, ...) to ``out/config.json``
    atomically."""
    text = (json.dumps(info, indent=1) + "\n").encode()
    atomic_write(out / "config.json", lambda f: f.write(text), "run configuration")


def write_trace(recorder: Recorder, comm: Any, position: Position, *, trace: Optional[str],
                plot: Optional[str], title: str, say: Callable[[str], None]) -> None:
    """Gather every rank's spans; on rank 0 write ``trace`` (Chrome/Perfetto JSON) and draw
    ``plot`` (an image; :func:`sparsepipe_hpc.plot.plot_trace`). **Collective.**"""
    label = (f"rank {comm.rank}: stage {position.stage}, replica {position.replica}, "
             f"spatial {position.spatial}")
    gathered = gather_chrome_trace(recorder, comm, label)

    def write() -> None:
        if gathered is None:
            return
        if trace:
            atomic_write(Path(trace), lambda f: f.write(json.dumps(gathered).encode()),
                         "--trace")
        if plot:
            from sparsepipe_hpc.plot import plot_trace

            plot_trace(gathered, plot, title=title)

    agree(comm, write)
    if trace:
        say(f"trace: {trace} (open in ui.perfetto.dev)")
    if plot:
        say(f"timeline: {plot}")


def plot_title(cfg: TrainConfig, layout: RankLayout, pipelined: bool, first: int,
               last: int) -> str:
    """The timeline's title: model, layout, schedule, the steps traced (``first``..``last``)."""
    text = (f"{cfg.model}, {layout.replicas} replica(s) x {layout.stages} stage(s) x grid "
            f"{'x'.join(map(str, layout.grid))}")
    if pipelined:
        text += f", {cfg.pipeline_schedule} with {cfg.micro_batches} micro-batch(es)"
    if last < first:    # a finished run resumed: nothing trained
        return text + ", no step"
    return text + (f", step {first}" if first == last else f", steps {first}-{last}")
