"""Sparse ResNet classifier and sparse U-Net segmenter, built as ordered sequences of blocks.

    net = SparseUNet(in_channels=3, num_classes=8, width=16, depth=3)
    logits = net(x).feats              # net(x) is a SparseTensor: per-voxel logits [N, classes]
    stages = net.blocks[:3], net.blocks[3:]   # a pipeline cuts here (later work)

Every block maps a *carry* (a list of tensors; the last is the running activation, earlier ones
are U-Net skips waiting for their decoder level) to a new carry, so the network is a plain sequence
whatever its skips, and any contiguous run of blocks is a pipeline stage.

U-Net, MinkUNet-like (depth 3, width w)::

    stem  SubM3 w ──────────────────────────────────────────────► concat ─ up3 ─ head 1x1
    down1 Conv k2s2 2w, res ─────────────────────────► concat ─ up2          ▲
    down2 Conv k2s2 4w, res ───────────► concat ─ up1          ▲             │
    down3 Conv k2s2 8w, res ─ InvConv k2 ┘                     ...
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from sparsepipe_hpc.nn.conv import SparseConv3d, SparseInverseConv3d, SubMConv3d
from sparsepipe_hpc.nn.layers import BatchNorm, GlobalPool, Linear, ReLU
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["Block", "BlockSequence", "SparseResNet", "SparseUNet", "build_model", "MODELS"]

Carry = list[Any]


class Block(nn.Module):
    """One pipeline-cuttable unit: ``forward(carry) -> carry``.

    ``carry_arity = (pops, pushes)``: the block reads and removes the last ``pops`` entries of the
    carry, leaves the rest untouched, and appends ``pushes`` entries. The pipeline plans from it
    which stage makes and which stage uses every carry entry (sparsepipe_hpc.pipeline.carry).
    """

    carry_arity: tuple[int, int] | None = None

    def forward(self, carry: Carry) -> Carry:  # pragma: no cover - abstract
        raise NotImplementedError


class BlockSequence(nn.Module):
    """A network as an ordered ``nn.ModuleList`` of blocks; ``forward(x)`` runs them all."""

    def __init__(self, blocks: Sequence[Block]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: SparseTensor) -> Any:
        carry: Carry = [x]
        for block in self.blocks:
            carry = block(carry)
        return carry[-1]

    @property
    def total_stride(self) -> int:
        """The product of the strides of all down-sampling layers (cuts align to this)."""
        s = 1
        for m in self.modules():
            if isinstance(m, SparseConv3d):
                s *= m.spec.stride
        return s


def conv_bn_relu(conv: nn.Module, channels: int) -> list[nn.Module]:
    return [conv, BatchNorm(channels), ReLU()]


class ResidualUnit(nn.Module):
    """Two submanifold 3x3x3 convolutions with BatchNorm and a skip (1x1 when widths differ)."""

    def __init__(self, cin: int, cout: int, engine: str):
        super().__init__()
        self.body = nn.Sequential(SubMConv3d(cin, cout, 3, engine=engine), BatchNorm(cout), ReLU(),
                                  SubMConv3d(cout, cout, 3, engine=engine), BatchNorm(cout))
        self.skip = None if cin == cout else nn.Sequential(Linear(cin, cout, bias=False),
                                                           BatchNorm(cout))

    def forward(self, x: SparseTensor) -> SparseTensor:
        y = self.body(x)
        s = x if self.skip is None else self.skip(x)
        return y.replace(feats=torch.relu(y.feats + s.feats))


class Stem(Block):
    carry_arity = (1, 1)

    def __init__(self, cin: int, width: int, engine: str):
        super().__init__()
        self.net = nn.Sequential(*conv_bn_relu(SubMConv3d(cin, width, 3, engine=engine), width),
                                 ResidualUnit(width, width, engine))

    def forward(self, carry: Carry) -> Carry:
        return carry[:-1] + [self.net(carry[-1])]


class Down(Block):
    """Kernel-2 stride-2 down-sampling then residual units; keeps the input as a skip if asked."""

    def __init__(self, cin: int, cout: int, key: str, units: int, engine: str, keep_skip: bool):
        super().__init__()
        self.keep_skip = keep_skip
        # Keeping the skip re-pushes the input: the skip is made by this block's stage.
        self.carry_arity = (1, 2) if keep_skip else (1, 1)
        self.net = nn.Sequential(
            *conv_bn_relu(SparseConv3d(cin, cout, 2, 2, indice_key=key, engine=engine), cout),
            *[ResidualUnit(cout, cout, engine) for _ in range(units)])

    def forward(self, carry: Carry) -> Carry:
        x = carry[-1]
        return carry + [self.net(x)] if self.keep_skip else carry[:-1] + [self.net(x)]


class Up(Block):
    """Inverse convolution onto the skip's voxels, concatenation, residual units."""

    carry_arity = (2, 1)

    def __init__(self, cin: int, cskip: int, cout: int, key: str, units: int, engine: str):
        super().__init__()
        self.up = nn.Sequential(
            *conv_bn_relu(SparseInverseConv3d(cin, cout, 2, indice_key=key, engine=engine), cout))
        self.net = nn.Sequential(ResidualUnit(cout + cskip, cout, engine),
                                 *[ResidualUnit(cout, cout, engine) for _ in range(units - 1)])

    def forward(self, carry: Carry) -> Carry:
        *rest, skip, x = carry
        y = self.up(x)
        y = y.replace(feats=torch.cat([y.feats, skip.feats], 1))
        return rest + [self.net(y)]


class SegHead(Block):
    carry_arity = (1, 1)

    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.linear = Linear(cin, num_classes)

    def forward(self, carry: Carry) -> Carry:
        return carry[:-1] + [self.linear(carry[-1])]


class ClsHead(Block):
    carry_arity = (1, 1)

    def __init__(self, cin: int, num_classes: int, pool: str):
        super().__init__()
        self.pool = GlobalPool(pool)
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, carry: Carry) -> Carry:
        return carry[:-1] + [self.linear(self.pool(carry[-1]))]


class SparseUNet(BlockSequence):
    """Sparse U-Net for per-voxel segmentation; output: SparseTensor of logits [N, num_classes].

    width: channels at full resolution, doubled per level; depth: number of stride-2 levels
    (total stride 2**depth); units: residual units per level.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, depth: int = 3,
                 units: int = 1, engine: str = "auto"):
        _check_sizes(type(self).__name__, in_channels=in_channels, num_classes=num_classes,
                     width=width, depth=depth, units=units)
        widths = [width * 2 ** i for i in range(depth + 1)]
        blocks: list[Block] = [Stem(in_channels, width, engine)]
        for i in range(depth):
            blocks.append(Down(widths[i], widths[i + 1], f"down{i + 1}", units, engine, True))
        for i in reversed(range(depth)):
            blocks.append(Up(widths[i + 1], widths[i], widths[i], f"down{i + 1}", units, engine))
        blocks.append(SegHead(width, num_classes))
        super().__init__(blocks)


class SparseResNet(BlockSequence):
    """Sparse ResNet classifier; output: dense logits [batch_size, num_classes]."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, depth: int = 3,
                 units: int = 1, pool: str = "avg", engine: str = "auto"):
        _check_sizes(type(self).__name__, in_channels=in_channels, num_classes=num_classes,
                     width=width, depth=depth, units=units)
        widths = [width * 2 ** i for i in range(depth + 1)]
        blocks: list[Block] = [Stem(in_channels, width, engine)]
        for i in range(depth):
            blocks.append(Down(widths[i], widths[i + 1], f"down{i + 1}", units, engine, False))
        blocks.append(ClsHead(widths[-1], num_classes, pool))
        super().__init__(blocks)


def _check_sizes(model: str, **sizes: Any) -> None:
    """ValueError naming the first size that is not an integer >= 1."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{model}: {name} must be an integer >= 1; got {v!r}")


MODELS = {"unet": SparseUNet, "resnet": SparseResNet}


def build_model(name: str, in_channels: int, num_classes: int, **kwargs: Any) -> BlockSequence:
    """``build_model("unet", 3, 8, width=16, depth=3)``; names: see MODELS."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}; got {name!r}")
    return MODELS[name](in_channels, num_classes, **kwargs)
