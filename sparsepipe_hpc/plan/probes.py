"""Forward passes that probe a block sequence: halo coefficients, kernel-map costs; a sample.

    from sparsepipe_hpc.plan.probes import synthetic_batch, halo_probe, kmap_probe
    x = synthetic_batch(8000, 3, multiple=8)       # a room-like SparseTensor of ~8000 voxels
    coef, count = halo_probe(list(net.blocks), x)  # per block: h_a per axis, exchanges
    maps = kmap_probe(list(net.blocks), x, 3)      # key -> (creator, users, build seconds)

Used by :func:`sparsepipe_hpc.plan.profile.profile_model`; the formulas are in its docstring.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["synthetic_batch", "visit_halo_convs", "halo_probe", "kmap_probe", "ProbeError", "clock"]


class ProbeError(ValueError):
    """A probe's input breaks a rule."""


def clock(device: torch.device) -> Callable[[], float]:
    """``perf_counter`` after a CUDA synchronize on CUDA devices (seconds)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def synthetic_batch(voxels: int, in_channels: int, batch_size: int = 1, multiple: int = 8,
                    seed: int = 0) -> SparseTensor:
    """A room-like batch: per sample a floor ``L x L`` and four walls ``L/2`` high (about
    ``voxels`` voxels, ``3 L^2``), random features. Grid: ``L`` rounded up to ``multiple``."""
    if voxels < 12 or batch_size < 1:
        raise ProbeError(f"synthetic_batch needs voxels >= 12 and batch_size >= 1; got "
                           f"{voxels} and {batch_size}")
    side = max(2, int(round(math.sqrt(voxels / 3))))
    height = max(1, side // 2)
    n = -(-side // multiple) * multiple
    r = torch.arange(side)
    gx, gy = torch.meshgrid(r, r, indexing="ij")
    floor = torch.stack([gx.flatten(), gy.flatten(), torch.zeros(side * side, dtype=torch.long)], 1)
    walls = []
    for z in range(1, height + 1):
        zs = torch.full((side,), z)
        zero, last = torch.zeros(side, dtype=torch.long), torch.full((side,), side - 1)
        walls += [torch.stack(c, 1) for c in ((r, zero, zs), (r, last, zs), (zero, r, zs),
                                               (last, r, zs))]
    xyz = torch.unique(torch.cat([floor, *walls]), dim=0)
    gen = torch.Generator().manual_seed(seed)
    coords = torch.cat([torch.cat([torch.full((len(xyz), 1), b), xyz], 1)
                        for b in range(batch_size)]).int()
    feats = torch.randn(len(coords), in_channels, generator=gen)
    return SparseTensor(coords, feats, (n, n, n), batch_size)


def kmap_probe(blocks: Sequence[Any], x: SparseTensor, repeats: int
               ) -> dict[str, tuple[int, set[int], float]]:
    """Per kernel-map key: (creator block, user blocks, median build seconds). Forward only."""
    from sparsepipe_hpc.nn.conv import _SparseConvBase

    now = clock(x.feats.device)
    found: dict[str, tuple[int, set[int], list[float]]] = {}
    mods = [(k, mod) for k, blk in enumerate(blocks) for mod in blk.modules()
            if isinstance(mod, _SparseConvBase)]
    for k, mod in mods:
        orig = mod.entry

        def entry(t: SparseTensor, mod: Any = mod, orig: Any = orig, k: int = k) -> Any:
            key = mod.indice_key if mod.transposed else mod.cache_key(t)
            had = key in t.kmaps
            t0 = now()
            e = orig(t)
            dt = now() - t0
            creator, users, times = found.setdefault(key, (k, set(), []))
            users.add(k)
            if not had:
                times.append(dt)
            return e
        setattr(mod, "entry", entry)   # this instance only; removed below
    try:
        with torch.no_grad():
            for _ in range(repeats):
                carry: list[Any] = [x.replace(kmaps={})]
                for blk in blocks:
                    carry = blk(carry)
    finally:
        for _, mod in mods:
            delattr(mod, "entry")
    return {key: (c, u - {c}, statistics.median(t) if t else 0.0)
            for key, (c, u, t) in found.items()}


def visit_halo_convs(blocks: Sequence[Any], x: SparseTensor,
                     visit: Callable[[int, Any, SparseTensor], None]) -> None:
    """Run ``x`` through ``blocks`` once (no grad, fresh kernel maps) and call
    ``visit(block index, layer, layer input)`` before every submanifold layer that needs a halo
    (padding > 0)."""
    from sparsepipe_hpc.nn.conv import SubMConv3d

    handles = []
    for k, blk in enumerate(blocks):
        for mod in blk.modules():
            if isinstance(mod, SubMConv3d) and mod.spec.padding > 0:
                def hook(m: Any, args: tuple[Any, ...], k: int = k) -> None:
                    visit(k, m, args[0])
                handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            carry: list[Any] = [x.replace(kmaps={})]
            for blk in blocks:
                carry = blk(carry)
    finally:
        for h in handles:
            h.remove()


def halo_probe(blocks: Sequence[Any], x: SparseTensor) -> tuple[list[list[float]], list[int]]:
    """Per block: the halo coefficients of the module docstring, and the exchange count."""
    coef = [[0.0, 0.0, 0.0] for _ in blocks]
    count = [0] * len(blocks)
    base = [x.num_voxels / max(1, e) for e in x.spatial_shape]

    def visit(k: int, m: Any, t: SparseTensor) -> None:
        count[k] += 1
        for a in range(3):
            per_layer = t.num_voxels / max(1, t.spatial_shape[a])
            coef[k][a] += (m.spec.padding * t.num_channels * t.feats.element_size()
                           * per_layer / max(base[a], 1e-30))

    visit_halo_convs(blocks, x, visit)
    return coef, count
