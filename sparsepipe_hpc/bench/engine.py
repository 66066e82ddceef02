"""Engine benchmark: own torch gather-GEMM-scatter versus spconv on one thread, forward+backward.

    python -m sparsepipe_hpc.bench engine --json engine.json [--voxel-size 0.03] [--width 16]

Measures, side by side on the same synthetic room: one submanifold 3x3x3 layer, and the whole
U-Net (the two engines' steps alternating). Reports each engine's time and the ratio spconv / torch (> 1: torch faster). Both engines
are first checked to give the same result, so the faster one is also a correct one.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from halo.kmap import kernel_map
from sparsepipe_hpc.bench.common import (environment, synthetic_room, time_alternating, time_step,
                                         write_json)
from sparsepipe_hpc.engine import get_engine
from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.bench._args import positive_int

CPU = torch.device("cpu")  # the engines compare on one CPU thread (spconv's CPU build)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench engine")
    p.add_argument("--json")
    p.add_argument("--voxel-size", type=float, default=0.03)
    p.add_argument("--points", type=positive_int, default=1_000_000)
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x = synthetic_room(args.voxel_size, points=args.points)
    print(f"room: {x.num_voxels} voxels, grid {x.spatial_shape}")
    result: dict[str, Any] = {"voxels": x.num_voxels, "env": environment(), "layer": {},
                              "unet": {}}

    km = kernel_map(x.coords, x.coords, 3, 1, 1, 1)
    c = args.width * 2
    feats = torch.randn(x.num_voxels, c)
    w = torch.randn(c, 27, c) / (27 * c) ** 0.5
    outs = {}
    for name in ("torch", "spconv"):
        eng = get_engine(name)
        outs[name] = eng.forward(feats, w, km)
        t = time_step(lambda: eng.backward(feats, w, eng.forward(feats, w, km), km), CPU,
                      args.repeats)
        result["layer"][name] = t
        print(f"subm3 layer {c}->{c} fwd+bwd  {name:6s} {t['median_s'] * 1e3:8.1f} ms")
    err = (outs["torch"] - outs["spconv"]).abs().max().item()
    result["layer"]["max_abs_diff"] = err
    result["layer"]["ratio_spconv_over_torch"] = (result["layer"]["spconv"]["median_s"]
                                                  / result["layer"]["torch"]["median_s"])

    def unet_step(name: str):
        torch.manual_seed(0)
        net = SparseUNet(x.num_channels, 8, width=args.width, depth=4, engine=name)

        def step() -> None:
            net.zero_grad()
            net(x.replace(kmaps={})).feats.square().mean().backward()
        return step

    times = time_alternating({"torch": unet_step("torch"), "spconv": unet_step("spconv")}, CPU,
                             args.repeats)
    for name, t in times.items():
        result["unet"][name] = t
        print(f"U-Net w{args.width} fwd+bwd        {name:6s} {t['median_s']:8.2f} s")
    result["unet"]["ratio_spconv_over_torch"] = (result["unet"]["spconv"]["median_s"]
                                                 / result["unet"]["torch"]["median_s"])
    print(f"spconv/torch time ratio: layer {result['layer']['ratio_spconv_over_torch']:.2f}, "
          f"U-Net {result['unet']['ratio_spconv_over_torch']:.2f}; max |diff| {err:.2e}")
    write_json(args.json, result)
