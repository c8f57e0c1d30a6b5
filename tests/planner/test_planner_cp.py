"""The planner models context parallelism (``Layout.cp``, ``cp_impl``): the attention traffic
per step of each implementation (comm.cp_time, the formulas of shardwise/comm/context.py),
activations per device divided by cp, gradients and ZeRO states over dp x cp, compute split
over the cp ranks; the search tries cp only for long sequences, and says why its winner uses it.
"""
from dataclasses import replace

import pytest

from shardwise.planner import Batch, Hardware, Layout, PlanError, estimate, plan
from shardwise.planner.memory import activation_per_layer
from shardwise.planner.model import ModelSpec
from shardwise.planner.search import CP_FROM, layouts

LONG = ModelSpec(layers=8, hidden=1024, heads=16, seq_len=32768, vocab=32000,
                 fused_attention=True, name="long")
HW = Hardware.from_catalogue("a100-80gb", nodes=1, devices_per_node=8)
BATCH = Batch(global_batch=8, precision="bf16")


def test_cp_traffic_equals_the_formula_of_each_implementation():
    hw = HW
    for impl in ("ring", "ulysses"):
        lay = Layout(dp=2, cp=4, cp_impl=impl)
        e = estimate(lay, LONG, hw, BATCH)
        n, act = 4, 2
        block = lay.micro_batch * LONG.seq_len / n * LONG.hidden       # E values, tp = 1
        bw, alpha = hw.link(n, 1)
        if impl == "ring":
            fwd = (n - 1) * (2 * block * act / bw + alpha)
            bwd = fwd + n * (2 * block * 4 / bw + alpha)
        else:
            fwd = bwd = (n - 1) / n * 4 * block * act / bw + 2 * (alpha + hw.collective_overhead)
        m = lay.microbatches(BATCH.global_batch)
        assert e.comm["cp"] == pytest.approx(m * LONG.layers * (fwd + bwd), rel=1e-12), impl
        assert estimate(replace(lay, cp=1, dp=8), LONG, hw, BATCH).comm["cp"] == 0.0


def test_activations_per_device_are_divided_by_cp():
    one = activation_per_layer(LONG, Layout(), BATCH, full=True)
    for cp in (2, 4, 8):
        assert activation_per_layer(LONG, Layout(cp=cp), BATCH, full=True) == \
            pytest.approx(one / cp, rel=1e-12)
        assert activation_per_layer(LONG, Layout(cp=cp), BATCH, full=False) == \
            pytest.approx(activation_per_layer(LONG, Layout(), BATCH, full=False) / cp)
    # unfused attention: the ring keeps no scores, Ulysses keeps 1/cp of them
    plain = replace(LONG, fused_attention=False)
    scores = 5 * plain.heads * plain.seq_len ** 2 * 1
    ring = activation_per_layer(plain, Layout(cp=4), BATCH, full=True)
    ulysses = activation_per_layer(plain, Layout(cp=4, cp_impl="ulysses"), BATCH, full=True)
    assert ulysses - ring == pytest.approx(scores / 4)


def test_states_shard_and_gradients_average_over_dp_x_cp():
    e_cp = estimate(Layout(dp=2, cp=4, zero=3), LONG, HW, BATCH)
    e_dp = estimate(Layout(dp=8, zero=3), LONG, HW, BATCH)
    for part in ("parameters", "optimizer_states", "master_weights"):
        assert e_cp.memory[part] == pytest.approx(e_dp.memory[part]), part
    assert Layout(dp=2, cp=4).world == 8 and Layout(dp=2, cp=4, zero=3).dp_shard == 8
    assert Layout(cp=2).kind == "ddp" and Layout(cp=2, tp=2).kind == "3d"


def test_a_pipeline_under_cp_sends_a_cp_th_of_each_boundary_activation():
    from shardwise.planner import comm
    one = comm.p2p_stage_time(Layout(pp=2, dp=4), LONG, HW, BATCH)
    four = comm.p2p_stage_time(Layout(pp=2, cp=4), LONG, HW, BATCH)
    bw = HW.intra_bw
    act = 2 * LONG.seq_len * LONG.hidden * 2                   # mb 1, bf16, both directions
    assert one - four == pytest.approx(act * (1 - 1 / 4) / bw, rel=1e-9)
    assert any(lay.cp > 1 and lay.pp > 1 for lay in layouts(LONG, HW, BATCH))


def test_search_tries_cp_only_for_long_sequences_and_explains_it():
    short = replace(LONG, seq_len=CP_FROM // 2)
    assert all(lay.cp == 1 for lay in layouts(short, HW, BATCH))
    cps = {(lay.cp, lay.cp_impl) for lay in layouts(LONG, HW, BATCH)}
    assert {(2, "ring"), (4, "ulysses"), (8, "ring")} <= cps
    huge = replace(LONG, seq_len=131072, fused_attention=False)
    ranking = plan(huge, HW, BATCH)
    assert ranking.winner.layout.cp > 1, ranking.winner.layout.describe()
    assert "Why context parallelism" in ranking.explanation


def test_bad_cp_layouts_are_refused_with_the_field():
    with pytest.raises(PlanError, match="cp"):
        Layout(cp=2, dp=2, dp_replicate=2, zero=3)
    with pytest.raises(PlanError, match="cp"):
        Layout(cp=2, cp_impl="allgather")
    with pytest.raises(PlanError, match="2 x cp"):
        estimate(Layout(cp=8), replace(LONG, seq_len=40), HW, BATCH)
    with pytest.raises(PlanError, match="Ulysses"):
        estimate(Layout(cp=8, cp_impl="ulysses"), replace(LONG, heads=12, hidden=768), HW, BATCH)
