"""Bytes moved per torch op in one U-Net step: the project's against the plain spconv U-Net's.

    python -m sparsepipe_hpc.bench traffic --json traffic.json        # CPU, one room at 4 cm
    python -m sparsepipe_hpc.bench traffic --device cuda --rooms 4 --voxel-size 0.02

A memory-bound GPU step costs about the bytes its kernels read and write, and those can be counted
on any machine: every torch op of one forward + backward (the steps of ``bench gpu``) passes
through a ``TorchDispatchMode`` that adds up the sizes of its tensor inputs and outputs. An
estimate, not a measurement: an op that reads an input twice counts it once, an in-place op
counts its target as read and written; views (``view``, ``slice``, ``detach``, ...) and bare
allocations (``empty``) move nothing and are left out; spconv's own kernels run outside torch's
dispatcher in both networks and are not seen (on the CPU its Native algorithm calls ``torch.mm``,
which is). So compare the networks op by op: where the project's U-Net moves more bytes than the
plain one, a GPU step pays for them. On a CPU, BatchNorm takes its group form (docs/gpu.md);
one GPU rank takes torch's, as the plain U-Net does.

The same step also sums the bytes autograd keeps for backward (``saved_bytes``: each storage a
``save_for_backward`` holds, once, at its full size), the activation memory that makes most of a
step's peak, which issue 10 bounds at 1.10x the plain U-Net's. Index data the layers keep outside
``save_for_backward`` (kernel maps, spconv's indices) is not in it.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sparsepipe_hpc.bench.common import environment, write_json
from sparsepipe_hpc.bench.gpu import PRECISIONS, synthetic_rooms, unet_steps
from sparsepipe_hpc.bench._args import positive_int

__all__ = ["main", "build_parser", "count_traffic"]


_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Traffic(TorchDispatchMode):
    """Sums, per op name, the bytes of every call's tensor inputs and outputs (views skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in func._schema.returns)
        if not view and name not in _ALLOCATIONS:
            self.bytes[name] += sum(t.numel() * t.element_size()
                                    for t in tree_flatten((args, kwargs, out))[0]
                                    if isinstance(t, torch.Tensor))
            self.calls[name] += 1
        return out


def count_traffic(step: Callable[[], None]) -> dict[str, Any]:
    """Bytes and calls per op of one ``step()`` and the bytes it saved for backward:
    ``{"total_bytes": B, "saved_bytes": S, "ops": {op: {"bytes": b, "calls": n}}}``."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with _Traffic() as t, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    ops = {name: {"bytes": t.bytes[name], "calls": t.calls[name]}
           for name in sorted(t.bytes, key=lambda n: -t.bytes[n])}
    return {"total_bytes": sum(t.bytes.values()), "saved_bytes": sum(saved.values()), "ops": ops}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench traffic")
    p.add_argument("--json")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rooms", type=positive_int, default=1)
    p.add_argument("--voxel-size", type=float, default=0.04)
    p.add_argument("--points", type=positive_int, default=100_000, help="points per room")
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--depth", type=positive_int, default=4)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    p.add_argument("--top", type=positive_int, default=25, help="ops printed, most bytes first")
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)  # spconv's CPU build is only correct on one thread
    x = synthetic_rooms(args.rooms, args.voxel_size, args.points)
    x = x.to(device)
    print(f"{args.rooms} room(s) at {args.voxel_size} m: {x.num_voxels} voxels; U-Net width "
          f"{args.width} depth {args.depth}; {args.precision} on {device}")
    result: dict[str, Any] = {
        "benchmark": "traffic", "env": environment(), "device": str(device),
        "scene": {"rooms": args.rooms, "voxel_size": args.voxel_size, "points": args.points,
                  "voxels": x.num_voxels, "width": args.width, "depth": args.depth},
        "precision": args.precision, "networks": {}}
    for name, step in unet_steps(x, args.width, args.depth, device,
                                 PRECISIONS[args.precision]).items():
        step()  # warm-up: first calls load and patch spconv
        r = result["networks"][name] = count_traffic(step)
        print(f"{name:18s} {r['total_bytes'] / 2**20:10.0f} MiB in "
              f"{sum(o['calls'] for o in r['ops'].values())} ops; saved for backward "
              f"{r['saved_bytes'] / 2**20:.0f} MiB")
    nets = result["networks"]
    ops = sorted({op for r in nets.values() for op in r["ops"]},
                 key=lambda op: -max(r["ops"].get(op, {"bytes": 0})["bytes"] for r in nets.values()))
    print(f"{'MiB / calls':24s}" + "".join(f"{n[:18]:>20s}" for n in nets))
    for op in ops[:args.top]:
        cells = (r["ops"].get(op, {"bytes": 0, "calls": 0}) for r in nets.values())
        print(f"{op:24s}" + "".join(f"{c['bytes'] / 2**20:13.0f} / {c['calls']:<4d}" for c in cells))
    write_json(args.json, result)
