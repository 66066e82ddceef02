"""Engine benchmark: own torch gather-GEMM-scatter versus spconv on one thread, forward+backward.

    python -m sparsepipe_hpc.bench engine --json engine.json [--voxel-size 0.03] [--width 16]

Measures, side by side on the same synthetic room, in alternated rounds (the order rotating):
one submanifold 3x3x3 layer three ways -- both engines on the project's explicit kernel map (the
path of strided layers and halo pairs) and spconv on its own indices (``spconv_native``, the path
of the U-Net's submanifold layers) -- and the whole U-Net per engine. Ratios spconv / torch
(> 1: torch faster) are the medians of the rounds' ratios. Every way is first checked to give the
torch engine's result (a RuntimeError otherwise), so the faster one is also a correct one.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from halo.kmap import kernel_map
from sparsepipe_hpc.bench.common import (environment, paired_ratios, synthetic_room,
                                         time_alternating, write_json)
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
    spconv = get_engine("spconv")
    native = spconv.subm_map(x.coords, x.spatial_shape, x.batch_size, 3, 1)
    ways: dict[str, tuple[Any, Any]] = {"torch": (get_engine("torch"), km),
                                        "spconv": (spconv, km), "spconv_native": (spconv, native)}
    ref = ways["torch"][0].forward(feats, w, km)
    for name, (eng, m) in ways.items():
        err = float((eng.forward(feats, w, m) - ref).abs().max())
        result["layer"][f"max_abs_diff_{name}"] = err
        if err > 1e-4 * float(ref.abs().max()):
            raise RuntimeError(f"bench engine: the {name} layer differs from the torch engine's "
                               f"by {err:.3g}; not timing a wrong result")

    def layer_step(eng: Any, m: Any):
        return lambda: eng.backward(feats, w, eng.forward(feats, w, m), m)

    times = time_alternating({name: layer_step(*way) for name, way in ways.items()}, CPU,
                             args.repeats)
    for name, t in times.items():
        result["layer"][name] = t
        print(f"subm3 layer {c}->{c} fwd+bwd  {name:13s} {t['median_s'] * 1e3:8.1f} ms")
    for name in ("spconv", "spconv_native"):
        result["layer"][f"ratio_{name}_over_torch"] = paired_ratios(times, name, "torch")

    def unet_step(name: str):
        torch.manual_seed(0)
        net = SparseUNet(x.num_channels, 8, width=args.width, depth=4, engine=name)

        def step() -> None:
            net.zero_grad()
            net(x.replace(kmaps={})).feats.square().mean().backward()
        return net, step

    nets = {name: unet_step(name) for name in ("torch", "spconv")}
    with torch.no_grad():  # the same weights (one seed): the same logits
        outs = {name: net(x.replace(kmaps={})).feats for name, (net, _) in nets.items()}
    err = float((outs["spconv"] - outs["torch"]).abs().max())
    result["unet"]["max_abs_diff"] = err
    if err > 1e-3 * float(outs["torch"].abs().max()):
        raise RuntimeError(f"bench engine: the U-Net's outputs differ between engines by "
                           f"{err:.3g}; not timing a wrong result")
    times = time_alternating({name: step for name, (_, step) in nets.items()}, CPU, args.repeats)
    for name, t in times.items():
        result["unet"][name] = t
        print(f"U-Net w{args.width} fwd+bwd        {name:6s} {t['median_s']:8.2f} s")
    result["unet"]["ratio_spconv_over_torch"] = paired_ratios(times, "spconv", "torch")
    print(f"spconv/torch time ratio (median of rounds): layer "
          f"{result['layer']['ratio_spconv_over_torch']['median']:.2f} on the explicit map, "
          f"{result['layer']['ratio_spconv_native_over_torch']['median']:.2f} on spconv's own "
          f"indices; U-Net {result['unet']['ratio_spconv_over_torch']['median']:.2f}")
    write_json(args.json, result)
