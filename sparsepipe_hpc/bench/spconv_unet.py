"""The reference network of ``bench gpu``: SparseUNet's architecture written with spconv's own layers.

    net = SpconvUNet(3, 8, width=32, depth=4, device=torch.device("cuda"))
    logits = net(x.to_spconv()).features                 # [N, 8]

What a user would write instead of this project: ``spconv.pytorch.SubMConv3d`` with one
``indice_key`` per level (index data built once per level and reused), ``SparseConv3d`` kernel 2
stride 2, ``SparseInverseConv3d`` back onto the skip's voxels, ``torch.nn.BatchNorm1d``. The same
blocks as :class:`sparsepipe_hpc.nn.SparseUNet` (stem, residual units, concatenating up-path, a
linear head), so the two do the same arithmetic. spconv picks its algorithm as it does by default
(implicit GEMM on CUDA); on CPU tensors Native is named explicitly, the one its CPU kernels run.

``package="spconv_triton"`` builds the same network from spconv-triton's layers (a pure-Triton
drop-in for spconv with the same API, ``pip install spconv-triton``; GPUs only), so ``bench gpu
--triton`` can time both engines on one scene.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["SpconvUNet", "PACKAGES"]

PACKAGES = ("spconv", "spconv_triton")


def _algo(device: torch.device) -> Optional[Any]:
    from spconv.core import ConvAlgo

    return None if device.type == "cuda" else ConvAlgo.Native


class _Res(nn.Module):
    def __init__(self, cin: int, cout: int, key: str, algo: Any, sp: Any):
        super().__init__()
        self.c1 = sp.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key, algo=algo)
        self.b1 = nn.BatchNorm1d(cout)
        self.c2 = sp.SubMConv3d(cout, cout, 3, padding=1, bias=False, indice_key=key, algo=algo)
        self.b2 = nn.BatchNorm1d(cout)
        self.skip = None if cin == cout else nn.Sequential(nn.Linear(cin, cout, bias=False),
                                                           nn.BatchNorm1d(cout))

    def forward(self, x: Any) -> Any:
        y = self.c1(x)
        y = y.replace_feature(torch.relu(self.b1(y.features)))
        y = self.c2(y)
        s = x.features if self.skip is None else self.skip(x.features)
        return y.replace_feature(torch.relu(self.b2(y.features) + s))


class SpconvUNet(nn.Module):
    """spconv layers in SparseUNet's shape: width doubling per level, ``depth`` levels."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, depth: int = 4,
                 device: torch.device = torch.device("cpu"), package: str = "spconv"):
        super().__init__()
        if package not in PACKAGES:
            raise ValueError(f"package must be one of {PACKAGES}; got {package!r}")
        sp = importlib.import_module(f"{package}.pytorch")
        self.sp = sp
        if package == "spconv":
            from sparsepipe_hpc.engine.spconv_engine import patch_spconv

            patch_spconv()
        algo = _algo(device) if package == "spconv" else None
        w = [width * 2 ** i for i in range(depth + 1)]
        self.depth = depth
        self.stem = sp.SubMConv3d(in_channels, width, 3, padding=1, bias=False, indice_key="s0",
                                  algo=algo)
        self.stem_bn = nn.BatchNorm1d(width)
        self.stem_res = _Res(width, width, "s0", algo, sp)
        self.down = nn.ModuleList(sp.SparseConv3d(w[i], w[i + 1], 2, 2, bias=False,
                                                  indice_key=f"d{i + 1}", algo=algo)
                                  for i in range(depth))
        self.down_bn = nn.ModuleList(nn.BatchNorm1d(w[i + 1]) for i in range(depth))
        self.down_res = nn.ModuleList(_Res(w[i + 1], w[i + 1], f"s{i + 1}", algo, sp)
                                      for i in range(depth))
        self.up = nn.ModuleList(sp.SparseInverseConv3d(w[i + 1], w[i], 2, bias=False,
                                                       indice_key=f"d{i + 1}", algo=algo)
                                for i in range(depth))
        self.up_bn = nn.ModuleList(nn.BatchNorm1d(w[i]) for i in range(depth))
        self.up_res = nn.ModuleList(_Res(2 * w[i], w[i], f"s{i}", algo, sp) for i in range(depth))
        self.head = nn.Linear(width, num_classes)

    def tensor(self, x: Any) -> Any:
        """A :class:`sparsepipe_hpc.sparse.SparseTensor` as this network's package's input."""
        return self.sp.SparseConvTensor(x.feats, x.coords, list(x.spatial_shape), x.batch_size)

    def forward(self, x: Any) -> Any:
        y = self.stem(x)
        y = self.stem_res(y.replace_feature(torch.relu(self.stem_bn(y.features))))
        skips = []
        for conv, bn, res in zip(self.down, self.down_bn, self.down_res):
            skips.append(y)
            y = conv(y)
            y = res(y.replace_feature(torch.relu(bn(y.features))))
        for i in reversed(range(self.depth)):
            y = self.up[i](y)
            y = y.replace_feature(torch.cat([torch.relu(self.up_bn[i](y.features)),
                                             skips[i].features], 1))
            y = self.up_res[i](y)
        return y.replace_feature(self.head(y.features))
