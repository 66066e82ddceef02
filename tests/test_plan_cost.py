"""Cost formulas: hand values, the flow-shop makespan they claim, and input checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsepipe_hpc.plan.cost import (Link, bubble_fraction, pipeline_step_time,
                                      ring_allreduce_time, step_time, uniform_pipeline_step_time)


def flow_shop_makespan(times, m):
    """Simulate m identical jobs through stages in order: a job enters stage s when it has left
    stage s - 1 and stage s has finished the previous job."""
    done = np.zeros(len(times))
    for _ in range(m):
        t = 0.0
        for s, ts in enumerate(times):
            t = max(t, done[s]) + ts
            done[s] = t
    return done[-1]


def test_pipeline_formula_is_the_flow_shop_makespan():
    rng = np.random.default_rng(0)
    for _ in range(200):
        S, m = int(rng.integers(1, 8)), int(rng.integers(1, 17))
        times = rng.integers(0, 20, size=S).astype(float)
        assert pipeline_step_time(times, m) == flow_shop_makespan(times, m)
        assert pipeline_step_time(times, m) <= uniform_pipeline_step_time(max(times), S, m)


def test_hand_values():
    assert pipeline_step_time([0.020, 0.025, 0.022], 8) == pytest.approx(0.242)
    assert pipeline_step_time([3.0] * 4, 5) == uniform_pipeline_step_time(3.0, 4, 5) == 24.0
    assert pipeline_step_time([2.0], 4) == 8.0
    assert bubble_fraction(4, 5) == 3 / 8 and bubble_fraction(1, 3) == 0.0
    link = Link(alpha=5e-6, beta=1e-10)
    assert link.time(1e9) == pytest.approx(0.100005)
    assert ring_allreduce_time(40e6, 4, link) == pytest.approx(2 * 3 / 4 * 40e6 * 1e-10 + 6 * 5e-6)
    assert ring_allreduce_time(40e6, 1, link) == 0.0
    assert ring_allreduce_time(8.0, 2, Link(1.0, 1.0)) == 8.0 + 2.0
    assert step_time([1.0, 2.0], 3, [0.5, 0.25]) == 3.0 + 4.0 + 0.5
    assert step_time([1.0, 2.0], 3) == 7.0


@pytest.mark.parametrize("call, msg", [
    (lambda: pipeline_step_time([], 2), "stage_times is empty"),
    (lambda: pipeline_step_time([1.0, -1.0], 2), r"stage_times\[1\] is -1\.0; it must be"),
    (lambda: pipeline_step_time([1.0], 0), "microbatches is 0; it must be a whole number >= 1"),
    (lambda: pipeline_step_time([1.0], 2.5), "microbatches is 2.5"),
    (lambda: uniform_pipeline_step_time(1.0, 0, 2), "stages is 0"),
    (lambda: uniform_pipeline_step_time(math.inf, 1, 2), "stage_time is inf"),
    (lambda: bubble_fraction(True, 2), "stages is True"),
    (lambda: ring_allreduce_time(-1.0, 2, Link()), "nbytes is -1.0"),
    (lambda: ring_allreduce_time(1.0, 0, Link()), "replicas is 0"),
    (lambda: Link(alpha=-1.0), "Link.alpha is -1.0"),
    (lambda: Link(beta=math.nan), "Link.beta is nan"),
    (lambda: step_time([1.0, 2.0], 1, [1.0]), "allreduce_times has 1 entries but stage_times"),
])
def test_bad_input_is_named(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


# ---- spatial terms and memory -------------------------------------------------------------------

from sparsepipe_hpc.plan.cost import halo_bytes, halo_time, largest_share, memory_bytes  # noqa: E402


def test_largest_share():
    assert largest_share((2, 2, 1)) == 0.25
    assert largest_share((2, 1, 1), imbalance=1.5) == 0.75
    assert largest_share((1, 1, 1), imbalance=3.0) == 1.0
    with pytest.raises(ValueError, match="imbalance is 0.5"):
        largest_share((2, 1, 1), imbalance=0.5)


def test_halo_bytes_by_hand():
    coef, V, E = (8.0, 4.0, 2.0), 6400.0, (64, 32, 16)
    assert halo_bytes(coef, V, E, (1, 1, 1)) == 0.0
    # x cut in 2: one inner face covering the whole cross-section; 6400 / 64 = 100 voxels per layer.
    assert halo_bytes(coef, V, E, (2, 1, 1)) == pytest.approx(1 * 1.0 * 100 * 8.0)
    # x in 4 (two inner faces, each covering g_x / G = 1/2 of the cross-section) and y in 2.
    g = (4, 2, 1)
    want = 2 * 4 / 8 * (V / 64) * 8.0 + 1 * 2 / 8 * (V / 32) * 4.0
    assert halo_bytes(coef, V, E, g) == pytest.approx(want)


def test_halo_time_and_memory():
    link = Link(1e-5, 1e-9)
    assert halo_time(1000.0, 3, (1, 1, 1), link) == 0.0
    # Latencies per neighbour of the busiest box: 1 on 2x1x1, 2 on 4x1x1, 7 on 2x2x2, 26 on 3x3x3.
    assert halo_time(1000.0, 3, (2, 1, 1), link) == pytest.approx(2 * (3 * 1 * 1e-5 + 1e-6))
    assert halo_time(1000.0, 3, (4, 1, 1), link) == pytest.approx(2 * (3 * 2 * 1e-5 + 1e-6))
    assert halo_time(1000.0, 1, (2, 2, 2), link) == pytest.approx(2 * (7 * 1e-5 + 1e-6))
    assert halo_time(1000.0, 1, (3, 3, 3), link) == pytest.approx(2 * (26 * 1e-5 + 1e-6))
    assert memory_bytes(100.0, 10.0, 3) == 430.0
    assert memory_bytes(100.0, 10.0, 3, optimizer_factor=3.0) == 330.0
    with pytest.raises(ValueError, match="act_bytes"):
        memory_bytes(1.0, -1.0, 1)
