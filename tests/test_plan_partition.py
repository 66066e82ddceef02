"""Stage partition: the DP against brute force on random instances, hand-checked cases, errors."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from sparsepipe_hpc.plan.cost import Link
from sparsepipe_hpc.plan.partition import (Block, Device, PartitionError, inflight_1f1b,
                                           inflight_gpipe, partition_stages,
                                           partition_stages_best_order)


# ---- brute force, written from the model in the module docstring, independently of the DP ----

def _link_at(link, devs, s):
    if isinstance(link, Link):
        return link
    if callable(link):
        return link(devs[s], devs[s + 1])
    return link[s]


def brute_all(blocks, devs, link, m, inflight, extra=None):
    """Every feasible (bounds, times) of blocks over devs in this order."""
    n, S = len(blocks), len(devs)
    out = []
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *cuts, n)
        times, ok = [], True
        for s in range(S):
            i, j = bounds[s], bounds[s + 1]
            t = (sum(b.time for b in blocks[i:j])
                 + (extra[i][j] if extra is not None else 0)) / devs[s].speed
            t += sum(b.comm for b in blocks[i:j])       # the blocks' own messages: any speed
            if s > 0:
                ln = _link_at(link, devs, s - 1)
                t += 2 * (ln.alpha + ln.beta * blocks[i - 1].out_bytes)
            if s < S - 1:
                ln = _link_at(link, devs, s)
                t += 2 * (ln.alpha + ln.beta * blocks[j - 1].out_bytes)
            mem = (sum(b.param_bytes for b in blocks[i:j])
                   + inflight(s, S, m) * sum(b.act_bytes for b in blocks[i:j]))
            ok &= mem <= devs[s].memory
            times.append(t)
        if ok:
            out.append((bounds, times))
    return out


def brute_step(times, m):
    """The pipeline's step time: the fill/drain sum and m - 1 slots of the bottleneck."""
    return sum(times) + (m - 1) * max(times)


def brute_best(cands, m):
    """Least step time, then least bottleneck, then smallest bounds (exact arithmetic assumed)."""
    return min(cands, key=lambda c: (brute_step(c[1], m), max(c[1]), c[0]))


def random_instance(rng, exact):
    """Blocks 1..9, stages 1..4; ``exact``: small integers and power-of-two speeds, so every sum
    the DP and the brute force form is exact and the tie-breaks can be compared exactly."""
    n = int(rng.integers(1, 10))
    S = int(rng.integers(1, min(n, 4) + 1))
    if exact:
        num = lambda hi: float(rng.integers(0, hi))  # noqa: E731
        speeds = rng.choice([0.25, 0.5, 1.0, 2.0], size=S)
    else:
        num = lambda hi: float(rng.uniform(0, hi))  # noqa: E731
        speeds = rng.uniform(0.2, 3.0, size=S)
    blocks = [Block(time=num(10), out_bytes=num(6), param_bytes=num(6), act_bytes=num(4),
                    comm=num(3) if rng.random() < 0.5 else 0.0)
              for _ in range(n)]
    m = int(rng.integers(1, 5))
    inflight = [inflight_1f1b, inflight_gpipe][int(rng.integers(2))]
    need = sum(b.param_bytes for b in blocks) + m * sum(b.act_bytes for b in blocks)
    devs = []
    for s in range(S):
        # A third unlimited; the rest capped between a tenth and all of the whole model's memory.
        cap = math.inf if rng.random() < 1 / 3 else max(1.0, float(np.floor(rng.uniform(0.1, 1)
                                                                             * need)))
        devs.append(Device(speed=float(speeds[s]), memory=cap, node=int(rng.integers(2))))
    kind = int(rng.integers(3))
    if kind == 0:
        link = Link(num(3), float(rng.choice([0.0, 0.5, 1.0])) if exact else num(1))
    elif kind == 1:
        link = [Link(num(3), num(2)) for _ in range(S - 1)]
    else:
        near, far = Link(num(2), 0.0), Link(num(3), num(2))
        link = lambda a, b: near if a.node == b.node else far  # noqa: E731
    return blocks, devs, link, m, inflight


def check_partition(p, blocks, devs, link, m, inflight):
    """The returned partition is one of the feasible ones and its reported figures are its own."""
    cands = dict((b, t) for b, t in brute_all(blocks, devs, link, m, inflight))
    assert p.bounds in cands, "the returned partition is infeasible or malformed"
    assert np.allclose(p.times, cands[p.bounds], rtol=1e-12, atol=1e-12)
    assert np.allclose(p.times, np.add(p.compute, p.transfer), rtol=1e-12, atol=0)
    assert p.bottleneck == max(p.times)
    for s, r in enumerate(p.stages):
        mem = sum(blocks[b].param_bytes for b in r) + p.inflight[s] * sum(blocks[b].act_bytes
                                                                          for b in r)
        assert math.isclose(p.memory[s], mem, rel_tol=1e-12) and mem <= devs[s].memory


@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force_exactly_on_integer_instances(seed):
    rng = np.random.default_rng(seed)
    infeasible = 0
    for _ in range(150):
        blocks, devs, link, m, inflight = random_instance(rng, exact=True)
        cands = brute_all(blocks, devs, link, m, inflight)
        if not cands:
            infeasible += 1
            with pytest.raises(PartitionError, match="needs|fits"):
                partition_stages(blocks, devs, link, m, inflight)
            continue
        p = partition_stages(blocks, devs, link, m, inflight)
        check_partition(p, blocks, devs, link, m, inflight)
        bounds, times = brute_best(cands, m)
        assert p.step_time() == brute_step(times, m) and p.bottleneck == max(times)
        assert p.bounds == bounds     # the documented tie-break, all three levels
        assert p.order == tuple(range(len(devs))) and p.microbatches == m
    assert 0 < infeasible < 150       # the caps bind sometimes, not always


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_on_float_instances(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(150):
        blocks, devs, link, m, inflight = random_instance(rng, exact=False)
        cands = brute_all(blocks, devs, link, m, inflight)
        if not cands:
            with pytest.raises(PartitionError):
                partition_stages(blocks, devs, link, m, inflight)
            continue
        p = partition_stages(blocks, devs, link, m, inflight)
        check_partition(p, blocks, devs, link, m, inflight)
        opt = min(brute_step(t, m) for _, t in cands)
        assert math.isclose(p.step_time(), opt, rel_tol=1e-12, abs_tol=1e-12)
        least = min(max(t) for _, t in cands if brute_step(t, m) <= opt * (1 + 1e-9))
        assert math.isclose(p.bottleneck, least, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_best_order_matches_brute_force_over_device_permutations(seed):
    rng = np.random.default_rng(200 + seed)
    for _ in range(60):
        blocks, devs, link, m, inflight = random_instance(rng, exact=True)
        if isinstance(link, list):
            link = Link(1.0, 0.5)
        cands = [(brute_step(t, m), max(t), perm)
                 for perm in itertools.permutations(range(len(devs)))
                 for _, t in brute_all(blocks, [devs[k] for k in perm], link, m, inflight)]
        if not cands:
            with pytest.raises(PartitionError, match="any order"):
                partition_stages_best_order(blocks, devs, link, m, inflight)
            continue
        p = partition_stages_best_order(blocks, devs, link, m, inflight)
        assert sorted(p.order) == list(range(len(devs)))
        order_devs = [devs[k] for k in p.order]
        assert list(p.devices) == order_devs
        check_partition(p, blocks, order_devs, link, m, inflight)
        best = min(cands)
        assert (p.step_time(), p.bottleneck) == best[:2]
        fixed = partition_stages(blocks, order_devs, link, m, inflight)
        assert p == dataclasses.replace(fixed, order=p.order)


# ---- hand-checked cases ----

def test_equal_devices_give_the_classic_linear_partition():
    p = partition_stages([Block(time=t) for t in range(1, 10)], [Device()] * 3)
    assert p.bounds == (0, 5, 7, 9) and p.times == (15.0, 13.0, 17.0) and p.bottleneck == 17.0
    p = partition_stages([Block(time=t) for t in (4, 1, 1, 2)], [Device()] * 2)
    assert p.bounds == (0, 1, 4) and p.times == (4.0, 4.0)
    # (2 | 3) and (3 | 2) tie on bottleneck and sum: the smaller first boundary wins.
    assert partition_stages([Block(time=1)] * 5, [Device()] * 2).bounds == (0, 2, 5)
    assert partition_stages([Block(time=1)] * 3, [Device()]).bounds == (0, 3)


def test_docstring_example_sum_breaks_the_bottleneck_tie():
    blocks = [Block(time=t) for t in (4.0, 1.0, 1.0, 2.0)]
    fast, slow = Device(speed=1.0, memory=16e9), Device(speed=0.5, memory=16e9)
    p = partition_stages(blocks, [fast, slow], microbatches=8)
    assert p.bounds == (0, 3, 4) and p.times == (6.0, 4.0) and p.bottleneck == 6.0
    assert p.step_time() == 6.0 + 4.0 + 7 * 6.0
    q = partition_stages_best_order(blocks, [slow, fast])
    assert q.order == (1, 0) and q.bounds == (0, 3, 4)
    r = partition_stages(blocks, [slow, fast])        # kept in the given order: slow first
    assert r.bounds == (0, 1, 4) and r.times == (8.0, 4.0)


def test_a_slower_device_gets_fewer_blocks():
    blocks = [Block(time=1.0)] * 10
    # Many micro-batches: the bottleneck decides. A slow stage with k blocks takes 2k s; k = 2
    # leaves 8 blocks for the two fast stages: 4, 4.
    p = partition_stages(blocks, [Device(), Device(), Device(speed=0.5)], microbatches=64)
    assert p.bounds == (0, 4, 8, 10) and p.times == (4.0, 4.0, 4.0)
    p = partition_stages(blocks, [Device(), Device(speed=0.5), Device()], microbatches=64)
    assert p.bounds == (0, 4, 6, 10) and p.times == (4.0, 4.0, 4.0)
    # One micro-batch runs the stages one after the other: the least sum decides (one block on
    # the slow device: 4 + 5 + 2 = 11 s, not 12), then the least bottleneck.
    p = partition_stages(blocks, [Device(), Device(), Device(speed=0.5)])
    assert p.bounds == (0, 4, 9, 10) and p.times == (4.0, 5.0, 2.0)
    even = partition_stages(blocks[:9], [Device()] * 3)
    assert [len(r) for r in even.stages] == [3, 3, 3]


def test_transfer_costs_move_cuts_away_from_heavy_activations():
    blocks = [Block(time=1.0, out_bytes=b) for b in (0.0, 100.0, 0.0, 0.0)]
    assert partition_stages(blocks, [Device()] * 2).bounds == (0, 2, 4)
    p = partition_stages(blocks, [Device()] * 2, link=Link(alpha=0.0, beta=0.01))
    # Cutting after block 1 would cost 2 x 1 s on both sides (times 4, 4); after block 0, (1, 3).
    assert p.bounds == (0, 1, 4) and p.times == (1.0, 3.0)
    assert p.compute == (1.0, 3.0) and p.transfer == (0.0, 0.0)
    lat = partition_stages(blocks, [Device()] * 2, link=Link(alpha=0.5, beta=0.01))
    assert lat.transfer == (1.0, 1.0) and lat.times == (2.0, 4.0)
    # A per-pair list: the slow link sits between stages 1 and 2.
    # Free, it is (1 | 3 | 3); the 2 s on stages 1 and 2 push two blocks onto stage 0.
    blocks = [Block(time=1.0, out_bytes=1.0)] * 7
    assert partition_stages(blocks, [Device()] * 3).bounds == (0, 1, 4, 7)
    q = partition_stages(blocks, [Device()] * 3, link=[Link(), Link(alpha=1.0)])
    assert q.transfer == (0.0, 2.0, 2.0) and q.bounds == (0, 3, 5, 7) and q.bottleneck == 4.0


def test_memory_caps_bind_and_in_flight_counts_follow_the_schedule():
    blocks = [Block(time=1.0, act_bytes=10.0), Block(time=1.0, act_bytes=10.0)]
    small, big = Device(memory=15.0, name="small"), Device(memory=25.0, name="big")
    # 1F1B with m = 4 and 2 stages: stage 0 holds 2 micro-batches, stage 1 holds 1.
    p = partition_stages(blocks, [big, small], microbatches=4)
    assert p.inflight == (2, 1) and p.memory == (20.0, 10.0)
    with pytest.raises(PartitionError, match=r"block 0 alone needs 20 bytes on stage 0 .*2 "
                                             r"micro-batch\(es\) x 10 bytes.*device 0 \('small'\) "
                                             r"has 15 bytes"):
        partition_stages(blocks, [small, big], microbatches=4)
    assert partition_stages_best_order(blocks, [small, big], microbatches=4).order == (1, 0)
    g = partition_stages(blocks, [big, big], microbatches=2, inflight=inflight_gpipe)
    assert g.inflight == (2, 2) and g.memory == (20.0, 20.0)
    with pytest.raises(PartitionError, match="in any order"):
        partition_stages_best_order(blocks, [small, big], microbatches=4, inflight=inflight_gpipe)


def test_caps_push_blocks_onto_the_roomier_stage_even_when_slower():
    blocks = [Block(time=1.0, param_bytes=10.0)] * 4
    p = partition_stages(blocks, [Device(speed=4.0, memory=10.0), Device(memory=100.0)])
    assert p.bounds == (0, 1, 4) and p.times == (0.25, 3.0)


def test_block_larger_than_every_device_is_named():
    blocks = [Block(time=1.0, param_bytes=1.0), Block(time=1.0, param_bytes=3 * 2**30, name="enc4"),
              Block(time=1.0, param_bytes=1.0)]
    devs = [Device(memory=2 * 2**30, name="a"), Device(memory=2.5 * 2**30, name="b")]
    msg = (r"block 1 \('enc4'\) alone needs 3\.221e\+09 bytes \(3 GiB\) on stage 1 .* but device 1 "
           r"\('b'\) has 2\.684e\+09 bytes \(2\.5 GiB\), the closest fit")
    with pytest.raises(PartitionError, match=msg):
        partition_stages(blocks, devs)
    with pytest.raises(PartitionError, match=r"block 1 \('enc4'\).* in any order"):
        partition_stages_best_order(blocks, devs)


def test_memory_too_small_in_total_says_so():
    blocks = [Block(time=1.0, param_bytes=40.0)] * 3
    with pytest.raises(PartitionError, match=r"no split of 3 blocks into 2 contiguous stages fits "
                                             r"the devices' memory: the blocks hold 120 bytes"):
        partition_stages(blocks, [Device(memory=50.0), Device(memory=60.0)])


def test_nodes_decide_the_order_through_the_link():
    near, far = Link(), Link(alpha=1.0)
    link = lambda a, b: near if a.node == b.node else far  # noqa: E731
    devs = [Device(node=0), Device(node=1), Device(node=0), Device(node=1)]
    p = partition_stages_best_order([Block(time=2.0)] * 8, devs, link=link)
    nodes = [d.node for d in p.devices]
    assert sum(a != b for a, b in zip(nodes, nodes[1:])) == 1
    assert p.order == (0, 2, 1, 3) and sum(p.transfer) == 4.0
    fixed = partition_stages([Block(time=2.0)] * 8, devs, link=link)
    assert fixed.transfer == (2.0, 4.0, 4.0, 2.0)


def test_identical_devices_are_tried_once():
    blocks = [Block(time=1.0)] * 6
    devs = [Device(name="a"), Device(speed=2.0), Device(name="b"), Device(speed=2.0)]
    with pytest.raises(PartitionError, match="4 devices in 2 classes have 6 distinct orders, more "
                                             "than max_orders=5"):
        partition_stages_best_order(blocks, devs, max_orders=5)
    p = partition_stages_best_order(blocks, devs, max_orders=6)
    assert sorted(p.order) == [0, 1, 2, 3] and p.bottleneck == 1.0


@pytest.mark.parametrize("kwargs, msg", [
    (dict(blocks=[]), "blocks is empty"),
    (dict(devices=[]), "devices is empty"),
    (dict(blocks=[Block(time=-1.0)]), r"blocks\[0\]\.time is -1\.0; it must be a finite number"),
    (dict(blocks=[Block(time=1.0, out_bytes=math.nan)]), r"blocks\[0\]\.out_bytes is nan"),
    (dict(devices=[Device(speed=0.0)]), r"devices\[0\]\.speed is 0\.0; it must be a finite"),
    (dict(devices=[Device(memory=0)]), r"devices\[0\]\.memory is 0; it must be > 0 bytes"),
    (dict(microbatches=0), "microbatches is 0; it must be a whole number >= 1"),
    (dict(microbatches=1.5), "microbatches is 1.5"),
    (dict(devices=[Device()] * 3), "2 blocks cannot fill 3 stages"),
    (dict(devices=[Device()] * 2, link=[Link()] * 2), "link has 2 entries; 2 stages need 1"),
    (dict(devices=[Device()] * 2, link=["fast"]), "link for stages 0-1 is 'fast'"),
    (dict(devices=[Device()] * 2, inflight=lambda s, S, m: -1),
     r"inflight\(0, 2, 1\) returned -1"),
])
def test_bad_input_is_named(kwargs, msg):
    args = dict(blocks=[Block(time=1.0)] * 2, devices=[Device()], link=Link(), microbatches=1,
                inflight=inflight_1f1b)
    args.update(kwargs)
    with pytest.raises(PartitionError, match=msg):
        partition_stages(**args)


def test_best_order_refuses_a_per_pair_link_list():
    with pytest.raises(PartitionError, match="link is a list; for a search over device orders"):
        partition_stages_best_order([Block(time=1.0)] * 2, [Device()] * 2, link=[Link()])


def test_inflight_functions():
    assert [inflight_1f1b(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [inflight_1f1b(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [inflight_gpipe(s, 4, 8) for s in range(4)] == [8, 8, 8, 8]


def test_larger_instance_runs_and_balances():
    rng = np.random.default_rng(7)
    times = rng.uniform(0.5, 1.5, size=120)
    p = partition_stages([Block(time=float(t)) for t in times], [Device()] * 16)
    assert len(p.bounds) == 17 and p.bottleneck <= times.sum() / 16 + times.max()
    assert p.bottleneck >= times.sum() / 16


def test_extra_segment_costs_against_brute_force():
    """A stage that starts at block i pays extra[i, j] (kernel maps made by an earlier stage):
    the DP stays exact for any segment costs."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 8))
        S = int(rng.integers(1, n + 1))
        blocks = [Block(time=float(rng.integers(0, 9)), out_bytes=float(rng.integers(0, 5)))
                  for _ in range(n)]
        devs = [Device(speed=float(2.0 ** rng.integers(-1, 2))) for _ in range(S)]
        extra = np.triu(rng.integers(0, 6, size=(n + 1, n + 1)).astype(float), 1)
        extra[0, :] = 0.0   # the first stage rebuilds nothing
        link = Link(alpha=1.0, beta=0.5)
        m = int(rng.integers(1, 5))
        want = brute_best(brute_all(blocks, devs, link, m, inflight_1f1b, extra), m)
        got = partition_stages(blocks, devs, link, m, extra=extra)
        assert (got.bounds, list(got.times)) == (want[0], want[1])
        best = partition_stages_best_order(blocks, devs, link, m, extra=extra)
        assert best.step_time() <= got.step_time()
    with pytest.raises(PartitionError, match=r"extra must be a \[3, 3\] array"):
        partition_stages([Block(1.0), Block(1.0)], [Device()], extra=np.zeros((2, 2)))


def test_steps_within_the_tolerance_tie_and_the_least_bottleneck_among_them_wins():
    """80 unit blocks on two devices, one micro-batch: the cut after block 1 has the least step
    (no transfer, bottleneck 79); after 41 the step is 0.9e-9 over it (a tie within STEP_RTOL,
    bottleneck 41), after 40 1.5e-9 over (no tie, though its bottleneck, 40, is the least), the
    rest a whole second over. The least bottleneck among the ties wins."""
    from sparsepipe_hpc.plan.partition import STEP_RTOL
    n = 80
    out = [1.0] * n
    out[0], out[n // 2 - 1], out[n // 2] = 0.0, 1.5e-9 * n / 4, 0.9e-9 * n / 4
    p = partition_stages([Block(time=1.0, out_bytes=o) for o in out], [Device()] * 2,
                         Link(alpha=0.0, beta=1.0))
    steps = {j: (j + 2 * out[j - 1]) + (n - j + 2 * out[j - 1]) for j in range(1, n)}
    least = min(steps.values())
    ties = [j for j, st in steps.items() if st <= least * (1 + STEP_RTOL)]
    assert ties == [1, 41]
    assert p.bounds == (0, 41, 80) and p.step_time() <= least * (1 + STEP_RTOL)


def test_best_order_ties_orders_within_the_tolerance_too():
    # Equal speeds, classes told apart by memory only; the link's latency depends on the pair.
    rng = np.random.default_rng(5)
    for _ in range(200):
        blocks, devs, _, m, inflight = random_instance(rng, exact=False)
        devs = [Device(memory=1e9 + k) for k in range(len(devs))]
        link = lambda a, b: Link(alpha=0.1 * (1 + (a.memory + b.memory) % 3), beta=0.01)  # noqa
        try:
            p = partition_stages_best_order(blocks, devs, link, m, inflight)
        except PartitionError:
            continue
        each = [partition_stages(blocks, [devs[k] for k in perm], link, m, inflight)
                for perm in itertools.permutations(range(len(devs)))]
        least = min(q.step_time() for q in each)
        tied = [q.bottleneck for q in each if q.step_time() <= least * (1 + 1e-9)]
        assert p.bottleneck == min(tied)


def test_the_search_evaluates_few_of_the_candidate_bottlenecks(monkeypatch):
    """120 blocks over 16 unequal devices have ~10^4 candidate bottlenecks, each an O(S B^2)
    pass; the bounded search evaluates a few hundred (a count, not a timing)."""
    import sparsepipe_hpc.plan.partition as partition
    rng = np.random.default_rng(0)
    blocks = [Block(time=float(t), out_bytes=float(o))
              for t, o in zip(rng.uniform(0.5e-3, 2e-3, 120), rng.uniform(1e5, 1e7, 120))]
    devs = [Device(speed=s) for s in [1.0, 0.5, 0.8, 1.0, 0.6, 1.0, 0.9, 0.7] * 2]
    seen = []
    real = partition._least_sums
    monkeypatch.setattr(partition, "_least_sums", lambda f, ts: seen.append(len(ts)) or real(f, ts))
    for m in (1, 2, 4, 64):
        seen.clear()
        partition_stages(blocks, devs, Link(alpha=1e-5, beta=1e-10), m)
        assert 0 < sum(seen) <= 600, (m, sum(seen))


@pytest.mark.parametrize("seed", range(4))
def test_tails_are_minimised_exactly(seed):
    """With once-per-step tails (the all-reduce, the update), the least pipeline step plus each
    tail's largest stage, against brute force; also with two links per stage pair (slowest)."""
    rng = np.random.default_rng(500 + seed)
    checked = 0
    for _ in range(120):
        blocks, devs, link, m, inflight = random_instance(rng, exact=False)
        n, S = len(blocks), len(devs)
        pairs = [(Link(float(rng.uniform(0, 3)), float(rng.uniform(0, 1))),
                  Link(float(rng.uniform(0, 3)), float(rng.uniform(0, 1)))) for _ in range(S - 1)]
        tails = [rng.uniform(0, float(rng.choice([0.5, 5, 50])), size=(S, n + 1, n + 1))
                 for _ in range(int(rng.integers(1, 3)))]
        for tail in tails:           # a tail grows with its stage: like an all-reduce, an update
            tail[:] = np.maximum.accumulate(tail, axis=2)
        cands = []
        for bounds, _ in brute_all(blocks, devs, link, m, inflight):
            times = []
            for s in range(S):
                i, j = bounds[s], bounds[s + 1]
                t = sum(b.time for b in blocks[i:j]) / devs[s].speed + sum(b.comm
                                                                           for b in blocks[i:j])
                if s > 0:
                    t += 2 * max(ln.time(blocks[i - 1].out_bytes) for ln in pairs[s - 1])
                if s < S - 1:
                    t += 2 * max(ln.time(blocks[j - 1].out_bytes) for ln in pairs[s])
                times.append(t)
            extra = sum(max(tail[s, bounds[s], bounds[s + 1]] for s in range(S))
                        for tail in tails)
            cands.append((bounds, brute_step(times, m) + extra))
        if not cands:
            continue
        p = partition_stages(blocks, devs, pairs, m, inflight, tails=tails)
        got = p.step_time() + sum(max(tail[s, p.bounds[s], p.bounds[s + 1]] for s in range(S))
                                  for tail in tails)
        assert math.isclose(got, min(c[1] for c in cands), rel_tol=1e-9, abs_tol=1e-12)
        checked += 1
    assert checked > 60


def test_tails_and_link_lists_are_checked():
    blocks, devs = [Block(time=1.0)] * 3, [Device()] * 2
    with pytest.raises(PartitionError, match=r"tails\[0\] must be a \[2, 4, 4\] array"):
        partition_stages(blocks, devs, tails=[np.zeros((2, 3, 3))])
    with pytest.raises(PartitionError, match="non-empty list of Links"):
        partition_stages(blocks, devs, [[]])
    # The update tail moves a block off the stage whose update is dear.
    tail = np.zeros((2, 4, 4))
    tail[1, 1:, 3] = [10.0, 0.1, 0.0]        # stage 1 on [1, 3): 10 s; on [2, 3): 0.1 s
    assert partition_stages(blocks, devs, tails=[tail]).bounds == (0, 2, 3)
    assert partition_stages(blocks, devs).bounds == (0, 1, 3)
