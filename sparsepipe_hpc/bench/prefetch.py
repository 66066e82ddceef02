"""Benchmark: the trainer's step with each batch read in line versus read ahead (``--prefetch``).

    python -m sparsepipe_hpc.bench prefetch --device cuda --json prefetch.json
    python -m sparsepipe_hpc.bench prefetch --device cpu --threads 1 -- --width 8 --depth 2

One trainer (the default task, or the trainer options after ``--``) takes ``--steps`` steps per
mode and round, the modes alternating (in line, ahead, ahead, in line, ...) so load drifts hit
both alike; a step is timed as the training loop sees it, through the host reading its loss.
Reported: the median step time per mode, the median time to read and voxelize one batch alone,
and the share of that read the worker hid (``(in line - ahead) / read``). The model keeps
training across modes (the timing, not the loss, is the point). On a CPU the worker competes with
the compute threads for cores: give it a spare one (``--threads`` below the cores), or expect
nothing hidden; on a GPU the host is free while the device computes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Optional

import torch

from sparsepipe_hpc.bench.common import environment, write_json
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench prefetch", description=(
        "Trainer step time with the next batch read in line vs on a worker thread (--prefetch). "
        "Trainer options go after --."))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="compute threads (default: the trainer's: 1 on a CPU, the rank's share "
                   "of the node's cores on a GPU)")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per mode and round")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("trainer_args", nargs="*", help="options for the trainer (after --)")
    return p


def _steps(trainer: Any, n: int) -> list[float]:
    """Seconds per step for ``n`` steps, each up to the host holding its loss (as the loop)."""
    times = []
    it = iter(trainer.batches)
    for _ in range(n):
        try:
            indices = next(it)
        except StopIteration:  # an epoch ended: the sampler moved on to the next
            it = iter(trainer.batches)
            indices = next(it)
        t = time.perf_counter()
        share, _ = trainer.train_step(indices, trainer.batches.epoch)
        float(share)  # the loss on the host: the loop's one wait for the device per step
        times.append(time.perf_counter() - t)
    return times


def measure(trainer: Any, steps: int, rounds: int, say: Any = print) -> dict[str, Any]:
    """Step times of ``trainer`` in line and read ahead, alternated; see the module docstring."""
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    _steps(trainer, 2)  # warm-up: allocator, kernel choices, first reads
    times: dict[str, list[float]] = {"inline": [], "ahead": []}
    for r in range(rounds):
        for mode in (("inline", "ahead") if r % 2 == 0 else ("ahead", "inline")):
            sync()
            trainer.prefetch = mode == "ahead"
            with trainer._prefetching():  # as Trainer.run() steps
                times[mode] += _steps(trainer, steps)
            say(f"round {r + 1}/{rounds} {mode:6s} median step "
                f"{statistics.median(times[mode]) * 1e3:8.1f} ms")
    reads = []
    for _ in range(max(3, steps)):
        indices, epoch = trainer.batches.peek()
        t = time.perf_counter()
        trainer._batch(trainer.train_set, indices, epoch)
        reads.append(time.perf_counter() - t)
    inline, ahead, read = (statistics.median(times["inline"]), statistics.median(times["ahead"]),
                           statistics.median(reads))
    return {"inline_step_s": inline, "ahead_step_s": ahead, "read_s": read,
            "ratio_ahead_to_inline": ahead / inline,
            "read_hidden_fraction": (inline - ahead) / read if read > 0 else None,
            "steps_per_mode": len(times["inline"]), "inline_steps_s": times["inline"],
            "ahead_steps_s": times["ahead"], "reads_s": reads}


def main(argv: Optional[list[str]] = None) -> None:
    from mpi4py import MPI

    from sparsepipe_hpc.train.config import parse_config
    from sparsepipe_hpc.train.loop import Trainer

    args = build_parser().parse_args(argv)
    own = ("--device", "--out", "--steps", "--checkpoint-every", "--prefetch", "--no-prefetch",
           "--threads", "--progress", "--no-progress", "--plan")
    for a in args.trainer_args:  # appended below, they would win silently
        if a.split("=", 1)[0] in own:
            raise SystemExit(f"bench prefetch: the trainer option {a.split('=', 1)[0]} is the "
                             "benchmark's own (its --device, --threads, --steps) or has no "
                             "meaning here; drop it after '--'")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench prefetch --device cuda: torch sees no CUDA device here")
    with tempfile.TemporaryDirectory() as out:
        extra = ["--threads", str(args.threads)] if args.threads else []
        cfg = parse_config([*args.trainer_args, "--device", args.device, "--no-progress",
                            "--out", out, "--steps", str(10**6), "--checkpoint-every", "0",
                            "--no-prefetch", *extra])  # the benchmark switches it per mode
        trainer = Trainer(cfg, MPI.COMM_WORLD, log=None)  # (it sets the compute threads)
        say = print if MPI.COMM_WORLD.Get_rank() == 0 else (lambda *_: None)
        say(f"bench prefetch: {cfg.task} {cfg.model} width {cfg.width} depth {cfg.depth}, "
            f"batch {cfg.batch_size}, on {trainer.device} with {torch.get_num_threads()} "
            f"compute thread(s); {args.rounds} rounds x {args.steps} steps per mode")
        result = measure(trainer, args.steps, args.rounds, say)
        trainer.close()
    hidden = result["read_hidden_fraction"]
    say(f"step in line {result['inline_step_s'] * 1e3:.1f} ms, read ahead "
        f"{result['ahead_step_s'] * 1e3:.1f} ms (x{result['ratio_ahead_to_inline']:.3f}); "
        f"reading a batch alone {result['read_s'] * 1e3:.1f} ms, hidden "
        + ("-" if hidden is None else f"{hidden:.0%}"))
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_json(args.json, {"benchmark": "prefetch", "device": args.device,
                               "config": cfg.to_dict(), **result,
                               "environment": environment(MPI.COMM_WORLD)})
