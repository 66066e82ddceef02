"""``python -m sparsepipe_hpc.plan``: profile a model, search the layouts, print the best plans.

    python -m sparsepipe_hpc.plan --model unet --ranks 8 --json plan.json
    python -m sparsepipe_hpc.plan --model unet --ranks 4 --device-speed 1,1,0.5,0.5
    mpirun -n 2 python -m sparsepipe_hpc.plan --measure-machine > machine.toml
    python -m sparsepipe_hpc.plan --ranks 1024 --machine machine.toml \\
        --voxels-per-sample 250000 --extent 400,400,80 --batch-size 256   # a prediction

Prints a table of the chosen plan and the runners-up (predicted seconds per step, its parts, the
largest device memory), and with ``--json FILE`` writes them (``plans[0]`` is the chosen plan; the
file is what ``train --plan FILE`` and ``python -m launch job --plan FILE`` read). The profile is
measured here, on ``--device`` in ``--precision``, on synthetic room-like samples
(``--sample-voxels``), or read from ``--profile FILE`` (then the options that say how to measure
one are an error). Every step time is a prediction of the cost model; the header says so,
and says when the plan is for more ranks than this machine has (an extrapolation).
Exit status 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main", "build_parser", "format_table"]

PROG = "python -m sparsepipe_hpc.plan"
PRECISIONS = ("fp32", "bf16", "fp16")   # train --precision's
# The options that say how to measure a profile, with their defaults.
MEASURING = {"model": "unet", "width": 16, "depth": 3, "in_channels": 3, "classes": 8,
             "engine": "auto", "device": "cpu", "precision": "fp32", "sample_voxels": 20000,
             "repeats": 3, "profile_out": None}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers like 64,64,32; got {text!r}") \
            from None
    if len(vals) != 3 or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"must be three integers >= 1 (x,y,z); got {text!r}")
    return vals


def _positive(kind: type) -> Any:
    """An argparse type: ``kind`` (int or float) > 0."""
    def parse(text: str) -> Any:
        v = kind(text)
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
        return v
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--measure-machine", action="store_true", help="ping-pong between ranks (run under "
      "mpirun, 2+ ranks) and print a machine TOML on rank 0")
    # How to measure a profile (none of these with --profile FILE): default None, so that
    # main can tell them given; MEASURING holds the defaults.
    a("--model", choices=("unet", "resnet"), help="default unet")
    a("--width", type=_positive(int), help="default 16")
    a("--depth", type=_positive(int), help="default 3")
    a("--in-channels", type=_positive(int), help="default 3")
    a("--classes", type=_positive(int), help="default 8")
    a("--engine", choices=("auto", "torch", "spconv"), help="default auto")
    a("--device", help="device to profile on (cpu, cuda; default cpu)")
    a("--precision", choices=PRECISIONS, help="profile under the autocast of a mixed-precision "
      "run (bf16, fp16), as train --precision computes; default fp32")
    a("--ranks", type=_positive(int), help="ranks to plan for (default: the machine file's)")
    a("--machine", metavar="FILE", help="machine TOML/JSON (--measure-machine writes one)")
    a("--device-speed", metavar="S,S,...", help="relative speed per rank, or one for all")
    a("--device-memory", metavar="B,B,...", help="bytes per rank, or one for all")
    a("--ranks-per-node", type=_positive(int), help="default: the machine file's, else all on one node")
    a("--batch-size", type=_positive(int), default=4, help="global samples per step (default 4)")
    a("--sample-voxels", type=_positive(int), help="voxels of the synthetic profile "
      "sample; profiled at 1/2, 1 and 3/2 of it (default 20000)")
    a("--voxels-per-sample", type=_positive(float), help="predict for samples of this many voxels "
      "(default: the profile's)")
    a("--extent", type=_ints, metavar="X,Y,Z", help="grid extent in voxels for the prediction "
      "(default: the profile's)")
    a("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    a("--optimizer", choices=("adamw", "sgd"), default="adamw")
    a("--imbalance", type=_positive(float), default=1.0, help="largest box / mean box (default 1)")
    a("--max-micro-batches", type=_positive(int))
    a("--repeats", type=_positive(int), help="timing repeats per block (median; default 3)")
    a("--profile", metavar="FILE", help="read the profile instead of measuring it")
    a("--profile-out", metavar="FILE", help="write the measured profile (JSON)")
    a("--top", type=_positive(int), default=5, help="runners-up to show (default 5)")
    a("--json", metavar="FILE", help="write the chosen plan and runners-up as JSON")
    return p


def _machine(args: argparse.Namespace) -> Any:
    from sparsepipe_hpc.plan.machine import Machine, load_machine

    if args.machine:
        m = load_machine(args.machine)
        if args.device_speed or args.device_memory or args.ranks_per_node:
            n = args.ranks or m.ranks
            m = Machine.build(
                _vals("--device-speed", args.device_speed, [d.speed for d in m.devices], n),
                _vals("--device-memory", args.device_memory, [d.memory for d in m.devices], n),
                args.ranks_per_node or m.ranks_per_node, m.intra, m.inter, m.measured,
                m.cores_per_node)
        return m.resized(args.ranks) if args.ranks else m
    if not args.ranks:
        raise ValueError("--ranks is required without --machine; pass --ranks N")
    return Machine.from_options(args.ranks, args.device_speed or 1.0,
                                args.device_memory or float("inf"),
                                args.ranks_per_node or args.ranks)


def _vals(option: str, text: Optional[str], current: list[float], n: int) -> list[float]:
    """``option``'s values for ``n`` ranks, else the machine file's (one value for all where they
    are alike; unlike values for another rank count are an error, as in ``Machine.resized``)."""
    from sparsepipe_hpc.plan.machine import MachineError, parse_numbers
    if text:
        return parse_numbers(option, text, n)
    if len(current) == n:
        return current
    if len(set(current)) > 1:
        raise MachineError(f"the machine file gives {len(current)} unequal values where "
                           f"{option} is not given, but {n} ranks were asked for; pass {option} "
                           f"for all {n} ranks")
    return current[:1] * n


def _profile(args: argparse.Namespace) -> Any:
    """The profile read from ``--profile``, or measured as the MEASURING options say (their
    defaults filled into ``args``); measuring options with ``--profile`` are an error."""
    from sparsepipe_hpc.plan.profile import ModelProfile, profile_model, synthetic_batch

    given = [k for k in MEASURING if getattr(args, k) is not None]
    if args.profile and given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"--profile {args.profile} is a measured profile, but {names} "
                         "say(s) how to measure one; drop them, or drop --profile to measure")
    for k, v in MEASURING.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.profile:
        try:
            text = Path(args.profile).read_text()
        except OSError as e:
            raise ValueError(f"--profile {args.profile}: cannot be read ({e.strerror})") from None
        return ModelProfile.from_json(text)
    import torch

    from sparsepipe_hpc.nn import build_model
    from sparsepipe_hpc.train.device import precision_dtype
    torch.manual_seed(0)
    model = build_model(args.model, args.in_channels, args.classes, width=args.width,
                        depth=args.depth, engine=args.engine).to(args.device)
    v = args.sample_voxels
    batches = [synthetic_batch(n, args.in_channels, multiple=model.total_stride, seed=k)
               for k, n in enumerate((v // 2, v, 3 * v // 2))]
    batches = [b.to(args.device) for b in batches]
    prof = profile_model(model, batches, repeats=args.repeats, name=args.model,
                         autocast=precision_dtype(args.precision))
    if args.profile_out:
        Path(args.profile_out).write_text(prof.to_json())
    return prof


def _local_ranks(device: str) -> int:
    """How many ranks this machine can run at once: its GPUs, or its CPU cores."""
    if device.startswith("cuda"):
        import torch
        return max(1, torch.cuda.device_count())
    return os.cpu_count() or 1


def _mib(b: float) -> str:
    return "inf" if b == float("inf") else f"{b / 2**20:.1f}"


def format_table(plans: Sequence[Any]) -> str:
    """The chosen plan and runners-up as an aligned text table (seconds per step, MiB); an
    ``order`` column (``--stage-order``) where a plan moves stages off the launch's order."""
    moved = [p.moves_stages for p in plans]
    head = ("#", "replicas", "stages", "grid", "micro", "balance") + ("order",) * any(moved) + (
        "step s", "compute s", "halo s", "split s", "transfer s", "allreduce s", "mem MiB")
    rows = [head]
    for k, (p, m) in enumerate(zip(plans, moved)):
        order = (",".join(map(str, p.stage_order)) if m else "-",) * any(moved)
        rows.append((str(k) if k else "chosen", str(p.replicas), str(p.stages),
                     "x".join(map(str, p.grid)), str(p.micro_batches),
                     ",".join(map(str, p.balance))) + order + (
                     f"{p.step_time:.4g}", f"{max(p.compute):.3g}", f"{max(p.halo):.3g}",
                     f"{max(p.split, default=0.0):.3g}", f"{max(p.transfer):.3g}",
                     f"{max(p.allreduce):.3g}", _mib(max(p.memory))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _measure() -> int:
    from mpi4py import MPI

    from sparsepipe_hpc.plan.machine import measure_links
    m = measure_links(MPI.COMM_WORLD)
    if m is not None:
        sys.stdout.write(m.to_toml())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from sparsepipe_hpc.plan.search import search

    args = build_parser().parse_args(argv)
    try:
        if args.measure_machine:
            return _measure()
        machine = _machine(args)
        prof = _profile(args)
        res = search(prof, machine, args.batch_size, ranks=args.ranks, schedule=args.schedule,
                     imbalance=args.imbalance, optimizer=args.optimizer,
                     max_micro_batches=args.max_micro_batches,
                     voxels_per_sample=args.voxels_per_sample, extent=args.extent)
    except (ValueError, OSError) as e:   # MachineError, ProfileError, SearchError, PartitionError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    n = args.ranks or machine.ranks
    here = _local_ranks(prof.device)
    vps = args.voxels_per_sample or prof.voxels_per_sample
    amp = prof.notes.get("autocast")
    print(f"model {prof.name}: {len(prof.blocks)} blocks, profiled on {prof.device}"
          f"{f' under {amp} autocast' if amp else ''} at "
          f"{', '.join(map(str, prof.sizes))} voxels; batch {args.batch_size} x {vps:.0f} "
          f"voxels/sample; machine {'measured' if machine.measured else 'assumed'} "
          f"({machine.ranks_per_node} ranks/node)")
    label = ("PREDICTED (cost model)" if n <= here else
             f"PREDICTED for {n} ranks, extrapolated beyond this machine's {here}")
    print(f"{len(res.plans)} plans on {n} ranks; step times {label}:")
    shown = list(res.plans[:1 + args.top])
    print(format_table(shown))
    best = res.plans[0]
    print(f"train with: {' '.join(best.trainer_args())}")
    if args.json:
        doc = {"predicted": True, "extrapolated": n > here, "ranks": n,
               "profile_device": prof.device, "machine": machine.to_dict(),
               "rejected": res.rejected,
               "plans": [p.to_dict(machine) for p in shown]}
        try:
            Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        except OSError as e:
            print(f"{PROG}: error: --json {args.json}: cannot write it ({e.strerror})",
                  file=sys.stderr)
            return 2
    return 0
