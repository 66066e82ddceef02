"""Sparse versus dense: the same U-Net on a room voxelized into an N^3 grid, one thread.

    python -m sparsepipe_hpc.bench dense --json dense.json [--sizes 64 96 128] [--limit 300]

For each N, two fresh processes each build one network and time forward+backward: the sparse
U-Net on the occupied voxels (kernel maps built every step, as in training), and the same
architecture with ``torch.nn.Conv3d`` (kernel 3, padding 1), ``ConvTranspose3d`` and
``BatchNorm3d`` on the full dense grid. Each runs one untimed step first (a first call's set-up:
spconv's, the allocator's), then ``--repeats`` timed ones: ``time_s`` is their median, ``all_s``
every one. Peak memory (``peak_mb``, MiB) is the process's peak resident set over the timed steps
minus its resident set before them (None where the kernel's peak mark cannot be reset). A
process that passes ``--limit`` seconds (set-up, the untimed step and the timed ones together)
is reported as out of time (killed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

from sparsepipe_hpc.bench.common import environment, write_json
from sparsepipe_hpc.bench._args import positive_int


class DenseUNet(nn.Module):
    """The dense twin of SparseUNet(width, depth, units=1): same layers, same widths."""

    def __init__(self, cin: int, classes: int, width: int = 16, depth: int = 3):
        super().__init__()

        def cbr(a, b, conv):
            return [conv(a, b), nn.BatchNorm3d(b), nn.ReLU()]

        def res(a, b):
            return nn.Sequential(*cbr(a, b, lambda i, o: nn.Conv3d(i, o, 3, padding=1, bias=False)),
                                 nn.Conv3d(b, b, 3, padding=1, bias=False), nn.BatchNorm3d(b))

        self.res_skip = nn.ModuleDict()
        w = [width * 2 ** i for i in range(depth + 1)]
        self.stem = nn.Sequential(*cbr(cin, width, lambda i, o: nn.Conv3d(i, o, 3, padding=1,
                                                                          bias=False)))
        self.stem_res = res(width, width)
        self.downs = nn.ModuleList(nn.Sequential(*cbr(w[i], w[i + 1],
                                                      lambda a, b: nn.Conv3d(a, b, 2, 2, bias=False)))
                                   for i in range(depth))
        self.down_res = nn.ModuleList(res(w[i + 1], w[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(nn.Sequential(*cbr(w[i + 1], w[i], lambda a, b: nn.ConvTranspose3d(
            a, b, 2, 2, bias=False))) for i in range(depth))
        self.up_res = nn.ModuleList(res(2 * w[i], w[i]) for i in range(depth))
        self.up_proj = nn.ModuleList(nn.Conv3d(2 * w[i], w[i], 1, bias=False) for i in range(depth))
        self.head = nn.Conv3d(width, classes, 1)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.stem_res(x) + x)
        skips = []
        for down, r in zip(self.downs, self.down_res):
            skips.append(x)
            x = down(x)
            x = torch.relu(r(x) + x)
        for i in reversed(range(len(self.ups))):
            y = torch.cat([self.ups[i](x), skips[i]], 1)
            x = torch.relu(self.up_res[i](y) + self.up_proj[i](y))
        return self.head(x)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    """Return freed heap to the OS and reset the kernel's peak-RSS mark (VmHWM), so that the
    peak covers the network alone; False where the mark could not be reset."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _child(kind: str, n: int, width: int, repeats: int) -> dict:
    """Run one measurement in this process; print JSON."""
    torch.set_num_threads(1)
    from sparsepipe_hpc.bench.common import synthetic_room
    from sparsepipe_hpc.nn import SparseUNet

    room = synthetic_room(voxel_size=0.03)
    # Rescale the room into an n^3 grid: voxel indices * n / max extent.
    scale = n / max(room.spatial_shape)
    xyz = torch.unique(torch.cat([room.coords[:, :1], (room.coords[:, 1:] * scale).int()], 1), dim=0)
    from sparsepipe_hpc.sparse import SparseTensor

    x = SparseTensor(xyz.int(), torch.rand(len(xyz), 3), (n, n, n), 1)
    torch.manual_seed(0)
    net: torch.nn.Module
    inp: Any
    if kind == "sparse":
        net = SparseUNet(3, 8, width=width, depth=3)
        inp = x
    else:
        net = DenseUNet(3, 8, width=width, depth=3)
        inp = torch.zeros(1, 3, n, n, n)
        c = x.coords.long()
        inp[0, :, c[:, 1], c[:, 2], c[:, 3]] = x.feats.t()
    def step() -> float:
        net.zero_grad(set_to_none=True)
        t = time.perf_counter()
        out = net(inp.replace(kmaps={}) if kind == "sparse" else inp)
        (out.feats if kind == "sparse" else out).square().mean().backward()
        return time.perf_counter() - t

    step()  # untimed: a first call's set-up
    net.zero_grad(set_to_none=True)
    reset = _reset_peak()
    base = _status_mb("VmRSS")
    times = [step() for _ in range(repeats)]
    peak = _status_mb("VmHWM")
    return {"kind": kind, "n": n, "voxels": x.num_voxels, "occupancy": x.num_voxels / n ** 3,
            "time_s": statistics.median(times), "all_s": times,
            "peak_mb": peak - base if reset else None}


def measure(kind: str, n: int, width: int, limit: float, repeats: int = 3) -> dict:
    cmd = [sys.executable, "-m", "sparsepipe_hpc.bench.dense", "--child", kind, str(n), str(width),
           str(repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "n": n,
                "status": f"out of time (> {limit:.0f} s for set-up and {repeats + 1} steps)"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        status = "out of memory" if proc.returncode in (-9, 137) else f"failed: {tail[0]}"
        return {"kind": kind, "n": n, "status": status}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "status": "ok"}


def run(sizes: list[int], width: int, limit: float, repeats: int = 3) -> list[dict]:
    rows = []
    for n in sizes:
        s = measure("sparse", n, width, limit, repeats)
        d = measure("dense", n, width, limit, repeats)
        row = {"n": n, "sparse": s, "dense": d}
        if s["status"] == d["status"] == "ok":
            row["time_ratio_dense_over_sparse"] = d["time_s"] / s["time_s"]
            row["memory_ratio_dense_over_sparse"] = (
                d["peak_mb"] / s["peak_mb"] if d["peak_mb"] is not None and s["peak_mb"]
                else None)
        rows.append(row)
        fmt = (lambda r: f"{r['time_s']:7.2f} s {r['peak_mb'] or float('nan'):8.0f} MiB"
               if r["status"] == "ok" else r["status"])
        print(f"{n:4d}^3  occupancy {s.get('occupancy', float('nan')):.4f}  sparse {fmt(s)}  "
              f"dense {fmt(d)}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))))
        return
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.bench dense")
    p.add_argument("--json")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[64, 96, 128])
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed steps per network")
    p.add_argument("--limit", type=float, default=300.0,
                   help="seconds before a network's process (set-up and every step) is cut off")
    args = p.parse_args(argv)
    rows = run(args.sizes, args.width, args.limit, args.repeats)
    write_json(args.json, {"env": environment(), "width": args.width, "repeats": args.repeats,
                           "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
