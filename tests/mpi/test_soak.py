"""Soak: hundreds of training steps, each on new random cuts, against the single-process run.

Every step draws a new cloud (scattered or clustered, so boxes are sometimes empty), a process
grid for the world size and random cut positions on it -- most of them off the stride grid, so
the strided layers' widened halos are exercised too -- and checks that step's loss against the
serial model's on every rank. The two models take the same SGD steps, so a wrong gradient on any
step shows in every later loss and in the final parameters and BatchNorm statistics. float64,
so rounding stays far below the tolerance over the whole run.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from halo.cuts import Cuts
from halo.kmap import coord_keys
from sparsepipe_hpc.nn import SparseUNet
from sparsepipe_hpc.parallel.context import ParallelContext
from sparsepipe_hpc.parallel.layout import RankLayout
from sparsepipe_hpc.sparse import SparseTensor

STEPS = {2: 200, 3: 150, 4: 120}  # about 25 s of steps at each world size on two cores
SHAPE = (24, 24, 16)
TOL = dict(rtol=1e-9, atol=1e-11)


def grids(n: int) -> list[tuple[int, int, int]]:
    return [g for g in itertools.product(range(1, n + 1), repeat=3) if np.prod(g) == n]


def random_cuts(rng: np.random.Generator, grid, extent, gap: int) -> Cuts:
    """Cut positions anywhere, interior boxes at least ``gap`` voxels (one voxel at stride gap)."""
    bounds = []
    for n, e in zip(grid, extent):
        while True:
            inner = np.sort(rng.choice(np.arange(1, e), size=n - 1, replace=False))
            widths = np.diff(np.concatenate([[0], inner, [e]]))
            if n < 3 or widths[1:-1].min() >= gap:
                break
        bounds.append(np.concatenate([[0], inner, [e]]))
    return Cuts(tuple(bounds))


def random_batch(rng: np.random.Generator, classes: int) -> tuple[SparseTensor, torch.Tensor]:
    hi = np.array(SHAPE) if rng.random() < 0.7 else np.array(SHAPE) // 2  # clustered: empty boxes
    rows = []
    for b in range(2):
        xyz = rng.integers(0, hi, size=(int(rng.integers(150, 400)), 3))
        rows.append(np.concatenate([np.full((len(xyz), 1), b), xyz], 1))
    coords = torch.unique(torch.from_numpy(np.concatenate(rows)), dim=0).int()
    feats = torch.from_numpy(rng.standard_normal((len(coords), 3)))
    labels = coord_keys(coords) % classes
    return SparseTensor(coords, feats, SHAPE, 2), labels


def test_random_cuts_every_step_match_serial(comm):
    if comm.size == 1:
        pytest.skip("no spatial split with one rank")
    rng = np.random.default_rng(2024)  # the same draws on every rank
    contexts = {g: ParallelContext(comm, RankLayout(1, 1, g)) for g in grids(comm.size)}
    torch.manual_seed(0)
    serial = SparseUNet(3, 4, width=4, depth=2).double()
    dist = copy.deepcopy(serial)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(dist.parameters(), lr=0.05, momentum=0.9)
    misaligned = 0
    for step in range(STEPS[comm.size]):
        x, labels = random_batch(rng, 4)
        grid = list(contexts)[int(rng.integers(len(contexts)))]
        cuts = random_cuts(rng, grid, SHAPE, gap=dist.total_stride)
        misaligned += cuts.misalignment(dist.total_stride) > 0

        opt_s.zero_grad()
        loss = F.cross_entropy(serial(x).feats, labels)
        loss.backward()
        opt_s.step()

        ctx = contexts[grid]
        opt_d.zero_grad()
        xl, yl = ctx.distribute(x, labels, cuts=cuts)
        share = F.cross_entropy(dist(xl).feats, yl, reduction="sum") / ctx.global_count(len(yl))
        share.backward()
        ctx.allreduce_gradients(dist)
        opt_d.step()
        total = ctx.allreduce(share.detach().clone())
        torch.testing.assert_close(total, loss.detach(), **TOL,
                                   msg=lambda m: f"step {step}, grid {grid}, {cuts}: {m}")
    assert misaligned > STEPS[comm.size] // 2  # the soak really covers cuts off the stride grid
    for (name, ps), pd in zip(serial.state_dict().items(), dist.state_dict().values()):
        torch.testing.assert_close(pd.double(), ps.double(), **TOL, msg=lambda m: f"{name}: {m}")
