"""Plan search: hand-computed predictions, a known optimum, memory limits, unequal devices."""

from __future__ import annotations

import math

import pytest

from sparsepipe_hpc.plan.cost import Link, pipeline_step_time, ring_allreduce_time
from sparsepipe_hpc.plan.machine import Machine
from sparsepipe_hpc.plan.profile import BlockProfile, Fit, ModelProfile
from sparsepipe_hpc.plan.search import (SearchError, evaluate, grids, search,
                                        stage_orders)

LINK = Link(alpha=1e-4, beta=1e-9)


def profile(times=(1.0, 1.0, 1.0, 1.0), fixed=0.0, params=1000.0, act=0.0, out=0.0, halo=0.0):
    """Blocks whose forward takes fixed + t * voxels / 1000 s and backward as long again."""
    blocks = tuple(BlockProfile(name=f"b{k}", forward=Fit(fixed, t / 1000),
                                backward=Fit(fixed, t / 1000), act_bytes=Fit(0.0, act),
                                out_bytes=Fit(0.0, out), param_bytes=params,
                                halo=(halo, halo, halo), exchanges=1 if halo else 0)
                   for k, t in enumerate(times))
    return ModelProfile(name="toy", device="cpu", blocks=blocks, voxels_per_sample=1000.0,
                        extent=(64, 64, 64), total_stride=8, in_channels=3)


def test_grids_enumerate_factorizations_with_stride_blocks():
    assert sorted(grids(4)) == sorted([(1, 1, 4), (1, 4, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2),
                                       (2, 2, 1)])
    assert sorted(grids(4, extent=(64, 16, 8), stride=8)) == [(2, 2, 1), (4, 1, 1)]


def test_evaluate_by_hand_data_parallel():
    prof = profile()
    m = Machine.uniform(2, 2, intra=LINK, inter=LINK)
    p = evaluate(prof, m, replicas=2, stages=1, grid=(1, 1, 1), micro_batches=1, batch_size=4)
    # 2 samples per replica: 2000 voxels; each block 2 * 2 s; all-reduce of 4 * 1000 bytes.
    compute = 4 * 2 * 2.0
    assert p.stage_times == pytest.approx((compute,))
    assert p.step_time == pytest.approx(compute + ring_allreduce_time(4000, 2, LINK))
    assert p.memory == pytest.approx((4 * 1000 * 4,))   # weights x AdamW's factor 4


def test_evaluate_by_hand_pipeline_with_transfers():
    prof = profile(times=(1.0, 2.0, 3.0, 2.0), out=10.0)
    m = Machine.uniform(2, 2, intra=LINK, inter=LINK)
    p = evaluate(prof, m, replicas=1, stages=2, grid=(1, 1, 1), micro_batches=4, batch_size=4)
    # One sample per micro-batch (1000 voxels); fwd + bwd = 2 * t; best split (1,2 | 3,2).
    assert p.balance == (2, 2)
    xfer = 2 * LINK.time(10.0 * 1000)
    times = (6.0 + xfer, 10.0 + xfer)
    assert p.stage_times == pytest.approx(times)
    assert p.step_time == pytest.approx(pipeline_step_time(times, 4)
                                        + ring_allreduce_time(4 * 2000, 1, LINK))


def test_spatial_split_divides_voxels_and_adds_halo():
    prof = profile(halo=4.0)
    m = Machine.uniform(2, 2, intra=LINK, inter=LINK)
    p = evaluate(prof, m, replicas=1, stages=1, grid=(2, 1, 1), micro_batches=1, batch_size=1)
    assert p.voxels_per_rank == 500
    # halo: one inner face, g_x / G = 1 of the cross-section, V / E_x = 1000 / 64 voxels per layer;
    # one exchange with one neighbour, forward and backward.
    per_block = 2 * (1 * 1 * LINK.alpha + LINK.beta * (1000 / 64) * 4.0)
    assert p.halo == pytest.approx((4 * per_block,))
    assert p.compute == pytest.approx((4 * 1.0,))


def test_known_optimum_fixed_costs_favour_data_parallel():
    # A large per-call cost that no split shrinks: replicas (one sample each) beat spatial boxes
    # and pipelines; with the per-voxel cost dominant instead, every layout ties on compute and
    # the all-reduce decides.
    prof = profile(fixed=1.0, params=1e6)
    m = Machine.uniform(4, 4, intra=LINK, inter=LINK)
    best = search(prof, m, batch_size=4).plans[0]
    assert (best.replicas, best.stages, best.grid, best.micro_batches) == (4, 1, (1, 1, 1), 1)
    # Expected: 4 blocks x 2 x (1 + 1) s + the all-reduce of 4 MB over 4 ranks.
    assert best.step_time == pytest.approx(16.0 + ring_allreduce_time(4e6, 4, LINK))
    ranked = search(prof, m, batch_size=4).plans
    assert [p.step_time for p in ranked] == sorted(p.step_time for p in ranked)


def test_memory_limit_excludes_plans_and_forces_stages():
    prof = profile(params=1e6)            # 4 MB of state per block: 16 MB for the model
    m = Machine.uniform(4, 4, memory=9e6, intra=LINK, inter=LINK)
    res = search(prof, m, batch_size=4)
    assert all(p.stages >= 2 for p in res.plans)
    assert all(max(p.memory) <= 9e6 for p in res.plans)
    assert res.rejected
    # The commonest reason in full (its parentheses balanced), and how many layouts it ruled out.
    with pytest.raises(SearchError, match=r"no plan fits 4 ranks: block \d \('b\d'\) alone needs "
                                          r"4e\+06 bytes .*closest fit among the devices it could "
                                          r"run on \(the reason for \d+ of the \d+ layouts tried"):
        search(prof, Machine.uniform(4, 4, memory=3e6), batch_size=4)


def test_unequal_devices_change_the_partition():
    prof = profile(times=(1.0, 1.0, 1.0, 1.0))
    even = search(prof, Machine.uniform(2, 2, intra=LINK, inter=LINK), batch_size=2,
                  fixed={"stages": 2, "micro_batches": 2}).plans[0]
    assert even.balance == (2, 2)
    slow = Machine.from_options(2, "1,0.5", ranks_per_node=2, intra=LINK, inter=LINK)
    het = search(prof, slow, batch_size=2, fixed={"stages": 2, "micro_batches": 2}).plans[0]
    assert het.balance == (3, 1)
    forced = evaluate(prof, slow, 1, 2, (1, 1, 1), 2, 2, balance=(2, 2))
    assert het.step_time < forced.step_time
    assert max(forced.stage_times) == pytest.approx(2 * 2 / 0.5 + 2 * LINK.alpha)


def test_fixed_values_and_bad_inputs():
    prof = profile()
    m = Machine.uniform(4, 4)
    res = search(prof, m, batch_size=4, fixed={"grid": (2, 1, 1)})
    assert {p.grid for p in res.plans} == {(2, 1, 1)}
    with pytest.raises(SearchError, match="ranks is 8"):
        search(prof, m, batch_size=4, ranks=8)
    with pytest.raises(SearchError, match="balance"):
        evaluate(prof, m, 1, 2, (1, 1, 1), 1, 4, balance=(1, 2))
    assert math.isfinite(search(prof, m, batch_size=3).plans[0].step_time)  # 3 samples: R in {1}


def test_optimizer_update_counts_once_per_step():
    import dataclasses
    prof = profile()
    slow = dataclasses.replace(prof, blocks=tuple(dataclasses.replace(b, update=0.5)
                                                  for b in prof.blocks))
    m = Machine.uniform(1, 1, intra=LINK, inter=LINK)
    for mb in (1, 4):
        a = evaluate(prof, m, 1, 1, (1, 1, 1), mb, 4)
        b = evaluate(slow, m, 1, 1, (1, 1, 1), mb, 4)
        assert b.step_time - a.step_time == pytest.approx(4 * 0.5)
        assert b.update == (2.0,)
    # SGD plans take the SGD step's time; a profile from before it was measured, AdamW's.
    sgd = dataclasses.replace(slow, blocks=tuple(dataclasses.replace(b, update_sgd=0.125)
                                                 for b in slow.blocks))
    assert evaluate(sgd, m, 1, 1, (1, 1, 1), 1, 4, optimizer="sgd").update == (0.5,)
    assert evaluate(sgd, m, 1, 1, (1, 1, 1), 1, 4).update == (2.0,)
    assert evaluate(slow, m, 1, 1, (1, 1, 1), 1, 4, optimizer="sgd").update == (2.0,)


def test_stages_pay_for_kernel_maps_made_before_them():
    import dataclasses

    import numpy as np

    from sparsepipe_hpc.plan.profile import KmapProfile
    km = (KmapProfile("enc", creator=0, users=(3,), build=Fit(5.0, 0.0)),
          KmapProfile("mid", creator=1, users=(2, 3), build=Fit(1.0, 0.0)))
    prof = dataclasses.replace(profile(), kmaps=km)
    r = prof.rebuild_costs(1000.0)
    # A stage starting at block 2 uses "mid" (made by block 1) from block 2 on and "enc" at 3.
    assert r[2, 3] == 1.0 and r[2, 4] == 6.0 and r[3, 4] == 6.0 and r[1, 4] == 5.0
    assert np.all(r[0] == 0) and r[1, 3] == 0.0
    m = Machine.uniform(2, 2, intra=LINK, inter=LINK)
    plain = evaluate(profile(), m, 1, 2, (1, 1, 1), 4, 4)
    paid = evaluate(prof, m, 1, 2, (1, 1, 1), 4, 4)
    # 4 micro-batches: (3 | 1) takes 6 and 2 + 6 s, step 14 + 3 x 8; (2 | 2) 4 and 4 + 6 s,
    # 14 + 3 x 10; (1 | 3) 2 and 6 + 5 s, 13 + 3 x 11 (transfers aside).
    assert plain.balance == (2, 2) and paid.balance == (3, 1)
    assert paid.stage_times[1] == pytest.approx(2.0 + 6.0 + 2 * LINK.alpha)
    # One micro-batch runs the stages in turn: the least sum, 13 s, wins.
    once = evaluate(prof, m, 1, 2, (1, 1, 1), 1, 1)
    assert once.balance == (1, 3) and once.stage_times[1] == pytest.approx(11.0 + 2 * LINK.alpha)
    fixed = evaluate(prof, m, 1, 2, (1, 1, 1), 1, 1, balance=(2, 2))
    assert fixed.stage_times[1] == pytest.approx(4.0 + 6.0 + 2 * LINK.alpha)
    one_stage = evaluate(prof, m, 2, 1, (1, 1, 1), 1, 2)   # no pipeline: nothing is rebuilt
    assert one_stage.stage_times == pytest.approx((8.0,))


def test_the_chosen_split_is_the_fastest_under_the_searchs_own_step_time():
    # 3 blocks of 6, 2 and 4 s, a cut after block 0 costly: with one micro-batch the least
    # bottleneck, (1 | 2) at 6.5 + 6.5 s, loses to (2 | 1) at 8 + 4 s.
    link = Link(alpha=0.0, beta=1e-3)
    blocks = tuple(BlockProfile(name=f"b{k}", forward=Fit(0.0, t / 1000),
                                backward=Fit(0.0, t / 1000), act_bytes=Fit(0.0, 0.0),
                                out_bytes=Fit(0.0, o), param_bytes=0.0)
                   for k, (t, o) in enumerate([(3.0, 0.25), (1.0, 0.0), (2.0, 0.0)]))
    prof = ModelProfile("toy", "cpu", blocks, 1000.0, (64, 64, 64), 8, 3)
    machine = Machine.uniform(2, 2, intra=link, inter=link)
    best = search(prof, machine, batch_size=1, fixed={"stages": 2}).plans[0]
    by_balance = {bal: evaluate(prof, machine, 1, 2, (1, 1, 1), 1, 1, balance=bal).step_time
                  for bal in [(1, 2), (2, 1)]}
    assert by_balance == pytest.approx({(1, 2): 13.0, (2, 1): 12.0})
    assert best.balance == (2, 1) and best.step_time == pytest.approx(12.0)


def test_a_fixed_balance_fixes_the_stage_count():
    m = Machine.uniform(4, 4, intra=LINK, inter=LINK)
    plans = search(profile(), m, batch_size=4, fixed={"balance": (1, 3)}).plans
    assert plans and all(p.stages == 2 and p.balance == (1, 3) for p in plans)
    with pytest.raises(SearchError, match=r"balance \(1, 3\) names 2 stage\(s\) but stages is 4"):
        search(profile(), m, batch_size=4, fixed={"balance": (1, 3), "stages": 4})


def test_halo_time_is_the_links_on_any_device():
    prof = profile(halo=4.0)
    halos = [evaluate(prof, Machine.uniform(2, 2, speed=s, intra=LINK, inter=LINK), 1, 1,
                      (2, 1, 1), 1, 1) for s in (1.0, 0.5)]
    assert halos[0].halo == pytest.approx(halos[1].halo)
    assert halos[1].compute == pytest.approx(tuple(2 * c for c in halos[0].compute))
    assert halos[1].stage_times[0] == pytest.approx(2 * halos[0].compute[0] + halos[0].halo[0])


def test_a_plan_names_its_job_layout_only_where_it_fills_whole_nodes():
    m = Machine.uniform(6, 4, intra=LINK, inter=LINK)   # nodes of 4 and 2 ranks
    p = evaluate(profile(), m, replicas=6, stages=1, grid=(1, 1, 1), micro_batches=1,
                 batch_size=6)
    assert "nodes" not in p.to_dict(m) and p.to_dict(m)["ranks"] == 6
    m = Machine.uniform(8, 4, intra=LINK, inter=LINK)
    p = evaluate(profile(), m, replicas=8, stages=1, grid=(1, 1, 1), micro_batches=1,
                 batch_size=8)
    assert (p.to_dict(m)["nodes"], p.to_dict(m)["gpus_per_node"]) == (2, 4)


def test_the_split_counts_the_all_reduce_and_the_update_it_makes():
    """The step adds each stage's all-reduce and update; the split minimises them too: blocks 1
    and 2 hold the parameters and dear updates, so they go to different stages."""
    import dataclasses
    base = profile(times=(1.0, 1.0, 1.0), params=0.0)
    blocks = tuple(dataclasses.replace(b, update=u) for b, u in zip(base.blocks, (0, 0.5, 0.5)))
    prof = dataclasses.replace(base, blocks=blocks)
    m = Machine.uniform(2, 2, intra=Link(), inter=Link())
    best = search(prof, m, batch_size=1, fixed={"stages": 2, "micro_batches": 1}).plans[0]
    by_balance = {bal: evaluate(prof, m, 1, 2, (1, 1, 1), 1, 1, balance=bal).step_time
                  for bal in [(1, 2), (2, 1)]}
    assert by_balance == pytest.approx({(1, 2): 7.0, (2, 1): 6.5})
    assert best.balance == (2, 1) and best.step_time == pytest.approx(6.5)
    with pytest.raises(SearchError, match=r"schedule 'GPipe' must be one of \['1f1b', 'gpipe'\]"):
        search(prof, m, batch_size=1, schedule="GPipe")


def test_a_group_across_nodes_pays_the_slower_link_for_its_messages():
    # The inter-node link has more latency but more bandwidth: small halo messages are slower
    # on it. Ranks 0-2 on node 0, rank 3 on node 1: replica 1's spatial group crosses nodes.
    intra, inter = Link(alpha=2e-6, beta=1e-10), Link(alpha=5e-6, beta=8e-11)
    m = Machine.uniform(4, 3, intra=intra, inter=inter)
    p = evaluate(profile(halo=1.0), m, 2, 1, (2, 1, 1), 1, 2)
    one = evaluate(profile(halo=1.0), Machine.uniform(4, 4, intra=inter, inter=inter), 2, 1,
                   (2, 1, 1), 1, 2)
    assert p.halo == pytest.approx(one.halo) and p.halo[0] > 0


def test_a_pipelines_step_is_its_schedules_simulated_time():
    """Stage times 9, 3, 3 (forward a third) over 3 micro-batches: GPipe takes the flow-shop
    formula's 9 + 3 + 3 + 2 x 9 = 33 s, 1F1B hides the later stages behind the first's work:
    27 s, the first stage busy throughout (the formula said 33)."""
    blocks = tuple(BlockProfile(name=f"b{k}", forward=Fit(0.0, t / 1000),
                                backward=Fit(0.0, 2 * t / 1000), act_bytes=Fit(0.0, 0.0),
                                out_bytes=Fit(0.0, 0.0), param_bytes=0.0)
                   for k, t in enumerate((3.0, 1.0, 1.0)))
    prof = ModelProfile("toy", "cpu", blocks, 1000.0, (64, 64, 64), 8, 3)
    m = Machine.uniform(3, 3, intra=Link(), inter=Link())
    steps = {kind: evaluate(prof, m, 1, 3, (1, 1, 1), 3, 3, schedule=kind).step_time
             for kind in ("gpipe", "1f1b")}
    assert steps == pytest.approx({"gpipe": 33.0, "1f1b": 27.0})


def test_the_search_moves_the_first_stage_to_the_device_with_room():
    """Under 1F1B the first stage holds the most micro-batches: on devices of unequal memory the
    launch's order (stage 0 on the small one) forces a slower split than the reverse (BaPipe)."""
    prof = profile(act=1.0)  # each block holds 1 byte per voxel per micro-batch in flight
    small_first = Machine.from_options(2, 1.0, memory="9e3,1e12", ranks_per_node=2,
                                       intra=LINK, inter=LINK)
    assert stage_orders(small_first, 1, 2, (1, 1, 1)) == [(0, 1), (1, 0)]
    launch = evaluate(prof, small_first, 1, 2, (1, 1, 1), 4, 4, stage_order=(0, 1))
    moved = evaluate(prof, small_first, 1, 2, (1, 1, 1), 4, 4, stage_order=(1, 0))
    assert (launch.balance, moved.balance) == ((1, 3), (3, 1))
    assert moved.step_time < launch.step_time
    best = search(prof, small_first, batch_size=4, fixed={"stages": 2, "micro_batches": 4})
    chosen = best.plans[0]
    assert chosen.stage_order == (1, 0) and chosen.step_time == pytest.approx(moved.step_time)
    assert chosen.trainer_args()[-2:] == ["--stage-order", "1,0"]
    assert chosen.to_dict()["stage_order"] == [1, 0]
    # Too small for stage 0 in the launch's order at all: only the reverse fits.
    tight = Machine.from_options(2, 1.0, memory="5e3,1e12", ranks_per_node=2, intra=LINK,
                                 inter=LINK)
    assert evaluate(prof, tight, 1, 2, (1, 1, 1), 4, 4).stage_order == (1, 0)
    # A fixed order is kept; one that is no permutation is refused.
    kept = search(prof, small_first, batch_size=4, fixed={"stage_order": (0, 1),
                                                          "micro_batches": 4}).plans[0]
    assert (kept.stages, kept.stage_order) == (2, (0, 1))
    with pytest.raises(SearchError, match="stage order 1,1 must list each of the 2 stage"):
        evaluate(prof, small_first, 1, 2, (1, 1, 1), 4, 4, stage_order=(1, 1))


def test_stage_orders_tried_only_where_the_stage_groups_differ():
    uniform = Machine.uniform(8, 4, intra=LINK, inter=LINK)   # two nodes, one kind of device
    assert stage_orders(uniform, 1, 4, (2, 1, 1)) == [(0, 1, 2, 3)]
    # Groups of two ranks (2 replicas): stage groups {0, 2} and {1, 3}; equal groups swap as one.
    mixed = Machine.from_options(4, "1,0.5,1,0.5", ranks_per_node=4, intra=LINK, inter=LINK)
    assert stage_orders(mixed, 2, 2, (1, 1, 1)) == [(0, 1), (1, 0)]
    halves = Machine.from_options(8, "1,1,1,1,0.5,0.5,0.5,0.5", ranks_per_node=8, intra=LINK,
                                  inter=LINK)
    orders = stage_orders(halves, 1, 8, (1, 1, 1))
    assert len(orders) == 70 and orders[0] == tuple(range(8))  # 8! / (4! 4!), launch's first
    assert stage_orders(halves, 1, 8, (1, 1, 1), max_orders=69) == [tuple(range(8))]
    # Uniform blocks on a slow and a fast device: either order splits as well; the launch's wins.
    slow = Machine.from_options(2, "1,0.5", ranks_per_node=2, intra=LINK, inter=LINK)
    assert evaluate(profile(), slow, 1, 2, (1, 1, 1), 2, 2).stage_order == (0, 1)


def test_the_plan_table_shows_an_order_column_only_where_a_plan_moves_stages():
    from sparsepipe_hpc.plan.cli import format_table

    prof = profile(act=1.0)
    m = Machine.from_options(2, 1.0, memory="9e3,1e12", ranks_per_node=2, intra=LINK, inter=LINK)
    moved = evaluate(prof, m, 1, 2, (1, 1, 1), 4, 4)
    kept = evaluate(prof, m, 1, 2, (1, 1, 1), 4, 4, stage_order=(0, 1))
    head, first, second = format_table([moved, kept]).splitlines()
    assert head.split()[6] == "order" and first.split()[6] == "1,0" and second.split()[6] == "-"
    assert "order" not in format_table([kept])
