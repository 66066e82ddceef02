"""Spatial-split cost: surface formula by hand, the fit, the probe, and what evaluate charges."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from sparsepipe_hpc.nn import build_model
from sparsepipe_hpc.plan.cost import Link, surface_voxels
from sparsepipe_hpc.plan.machine import Machine
from sparsepipe_hpc.plan.probes import synthetic_batch
from sparsepipe_hpc.plan.profile import BlockProfile, Fit, ModelProfile
from sparsepipe_hpc.plan.search import evaluate
from sparsepipe_hpc.plan.split import (SplitFit, SplitRow, box_imbalance, busiest_box, fit_split,
                                       nnls, split_probe)

LINK = Link(alpha=1e-4, beta=1e-9)


def test_surface_voxels_by_hand():
    # V = 9600 voxels on 96 x 96 x 64: a layer across x (or y) holds 9600 / 96 = 100 voxels.
    ext = (96, 96, 64)
    assert surface_voxels(9600, ext, (1, 1, 1)) == 0
    assert surface_voxels(9600, ext, (2, 1, 1)) == pytest.approx(100)   # 1 face, whole section
    assert surface_voxels(9600, ext, (2, 2, 1)) == pytest.approx(100)   # 2 faces, half each
    assert surface_voxels(9600, ext, (4, 1, 1)) == pytest.approx(200)   # inner box: 2 faces
    assert surface_voxels(9600, ext, (1, 1, 2)) == pytest.approx(150)   # 9600 / 64


def test_split_fit_and_clamp():
    f = SplitFit(c=1e-3, a=2e-7, b=4e-6)
    assert f(10_000, 500) == pytest.approx(1e-3 + 2e-3 + 2e-3)
    assert SplitFit(c=-1.0)(0, 0) == 0.0


def test_fit_split_recovers_known_coefficients():
    truth = [SplitFit(1e-3, 2e-7, 4e-6), SplitFit(0.0, 0.0, 3e-6), SplitFit()]
    rows = [SplitRow((2, 1, 1), 2 * v, v, s, tuple(f(v, s) for f in truth))
            for v, s in ((8000, 160), (4000, 170), (2500, 140), (15000, 300), (40000, 760))]
    got = fit_split(rows, 3)
    for g, t in zip(got, truth):
        assert (g.c, g.a, g.b) == pytest.approx((t.c, t.a, t.b), rel=1e-6, abs=1e-12)
    assert fit_split([], 2) == (SplitFit(), SplitFit())


def test_nnls_by_hand_where_the_bound_binds():
    # y = 2 - x1 on x1 in {0, 1, 2} with columns [1, x1]: unconstrained (2, -1); x1 >= 0 binds,
    # so the answer is the best constant alone, the mean 1.
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert nnls(a, np.array([2.0, 1.0, 0.0])) == pytest.approx([1.0, 0.0])
    assert nnls(a, np.array([-1.0, -1.0, -1.0])) == pytest.approx([0.0, 0.0])  # nothing helps


def test_nnls_equals_scipys(rng):
    optimize = pytest.importorskip("scipy.optimize")
    for _ in range(50):
        a = rng.standard_normal((rng.integers(3, 9), 3))
        y = rng.standard_normal(len(a))
        ours, theirs = nnls(a, y), optimize.nnls(a, y)[0]
        assert np.linalg.norm(a @ ours - y) == pytest.approx(np.linalg.norm(a @ theirs - y),
                                                             rel=1e-9, abs=1e-12)
        assert ours == pytest.approx(theirs, abs=1e-8)


def test_busiest_box_and_imbalance_by_hand():
    # 3 voxels left of x = 8, 1 voxel right: cuts align to 8, so the boxes hold 3 and 1.
    coords = torch.tensor([[0, 1, 0, 0], [0, 2, 0, 0], [0, 3, 0, 0], [0, 12, 0, 0]],
                          dtype=torch.int32)
    cuts, box, counts = busiest_box(coords, (16, 8, 8), (2, 1, 1), 8)
    assert box == (0, 0, 0) and counts.reshape(-1).tolist() == [3, 1]
    assert box_imbalance(coords, (16, 8, 8), (2, 1, 1), 8) == pytest.approx(3 / 2)


def test_probe_plays_the_busiest_box():
    torch.manual_seed(0)
    net = build_model("unet", 3, 4, width=8, depth=2, engine="torch")
    x = synthetic_batch(3000, 3, multiple=net.total_stride, seed=2)
    rows = split_probe(list(net.blocks), x, [(2, 1, 1), (2, 2, 1)], repeats=1,
                       align=net.total_stride)
    for row in rows:
        _, _, counts = busiest_box(x.coords, x.spatial_shape, row.grid, net.total_stride)
        assert row.box_voxels == counts.max() and counts.sum() == x.num_voxels
        assert row.surface == pytest.approx(surface_voxels(x.num_voxels, x.spatial_shape,
                                                           row.grid))
        assert len(row.extra) == len(net.blocks) and min(row.extra) >= 0
        assert row.extra[0] > 0   # the stem's submanifold conv has a halo
        assert row.extra[-1] == 0  # the head (a Linear) has none


def profile(split=SplitFit()):
    blocks = tuple(BlockProfile(name=f"b{k}", forward=Fit(0.0, 1e-3), backward=Fit(0.0, 1e-3),
                                act_bytes=Fit(0.0, 0.0), out_bytes=Fit(0.0, 0.0),
                                param_bytes=0.0, split=split) for k in range(4))
    return ModelProfile(name="toy", device="cpu", blocks=blocks, voxels_per_sample=1000.0,
                        extent=(64, 64, 64), total_stride=8, in_channels=3)


def test_evaluate_charges_the_split_on_split_grids_only():
    m = Machine.uniform(2, 2, intra=LINK, inter=LINK)
    fit = SplitFit(c=0.5, a=1e-4, b=1e-3)
    plain = evaluate(profile(), m, 1, 1, (2, 1, 1), 1, batch_size=2)
    split = evaluate(profile(fit), m, 1, 1, (2, 1, 1), 1, batch_size=2)
    # 2000 voxels, busiest box 1000; surface 2000 / 64 = 31.25: per block
    # 0.5 + 1e-4 * 1000 + 1e-3 * 31.25 = 0.63125 s, four blocks.
    assert split.split == pytest.approx((4 * 0.63125,))
    assert split.step_time - plain.step_time == pytest.approx(4 * 0.63125)
    one = evaluate(profile(fit), m, 2, 1, (1, 1, 1), 1, batch_size=2)
    assert one.split == (0.0,) and one.step_time == evaluate(profile(), m, 2, 1, (1, 1, 1), 1,
                                                             batch_size=2).step_time


def test_profile_json_keeps_split():
    prof = profile(SplitFit(1.0, 2.0, 3.0))
    assert ModelProfile.from_json(prof.to_json()) == prof
    old = prof.to_json().replace('"split"', '"unused"')   # profiles written before: no split
    assert ModelProfile.from_json(old).blocks[0].split == SplitFit()


def test_core_share_counts_busy_ranks_only():
    assert Machine.uniform(4, 4).core_share(4) == 1.0                     # devices of their own
    cpu = Machine.uniform(4, 4, intra=LINK, inter=LINK, cores_per_node=2)
    assert cpu.core_share(4) == 0.5 and cpu.core_share(1) == 1.0
    # 2 replicas x 2 stages, 2 micro-batches: bubble 1 / 3, so 4 * 2 / 3 ranks busy on 2 cores.
    p = evaluate(profile(), cpu, 2, 2, (1, 1, 1), 2, batch_size=4)
    assert p.core_share == pytest.approx(0.75)
    slow = Machine.uniform(4, 4, speed=0.75, intra=LINK, inter=LINK)
    want = evaluate(profile(), slow, 2, 2, (1, 1, 1), 2, batch_size=4)
    assert p.step_time == pytest.approx(want.step_time)
    # Data parallel: no bubble, every rank busy: half a core each.
    assert evaluate(profile(), cpu, 4, 1, (1, 1, 1), 1, batch_size=4).core_share == 0.5


def test_machine_cores_round_trip_and_errors(tmp_path):
    m = Machine.uniform(3, 3, cores_per_node=2, measured=True)
    (tmp_path / "m.toml").write_text(m.to_toml())
    from sparsepipe_hpc.plan.machine import MachineError, load_machine
    assert load_machine(tmp_path / "m.toml") == m
    assert dataclasses.replace(m, cores_per_node=None).to_dict().get("cores_per_node") is None
    with pytest.raises(MachineError, match="cores_per_node is 0; it must be a whole number"):
        Machine.uniform(2, 2, cores_per_node=0)
    assert math.isinf(m.devices[0].memory)
    (tmp_path / "bad.toml").write_text('cores_per_node = "two"\n')
    with pytest.raises(MachineError, match="bad.toml'?: cores_per_node is 'two'; it must be a "
                                           "whole number >= 1"):
        load_machine(tmp_path / "bad.toml")


def test_node_cores_is_the_union_of_the_nodes_cpu_sets():
    from sparsepipe_hpc.plan.machine import _node_cores
    # Ranks bound to one core each on node a still share both of a's cores; node b not counted.
    assert _node_cores(["a", "a", "b"], [{0}, {1}, {0, 1, 2}]) == 2
    assert _node_cores(["a", "a"], [{0, 1}, {0, 1}]) == 2
    assert _node_cores(["a", "a"], [{0}, None]) is None   # a GPU rank: devices of their own
