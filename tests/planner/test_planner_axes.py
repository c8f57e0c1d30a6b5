"""HSDP (``dp_replicate`` x ``dp_shard``) and sequence parallelism in the planner: memory, the
two-level traffic, the search, the explanation, and ``--strategy auto``'s config."""
from dataclasses import replace

import pytest

from shardwise.planner import Batch, Hardware, Layout, PRESETS, PlanError, estimate, plan
from shardwise.planner.cli import main
from shardwise.planner.comm import allreduce_time, dp_traffic, reduce_scatter_time
from shardwise.planner.memory import model_states, state_bytes
from shardwise.planner.model import parse_model
from shardwise.planner.search import TIE_BAND, layouts

SEVEN_B = PRESETS["7B"]
# 256 sequences of 2048 tokens: one micro-batch per replica and step fits the last backward
# with the replicas' allreduce (the default GPT-3 batch, 1024, runs four)
BATCH = Batch(256)


def _two_nodes(network: str) -> Hardware:
    return Hardware.from_catalogue("a100-80gb", nodes=2, devices_per_node=8, network=network)


def test_hsdp_keeps_the_states_of_its_shard_group():
    """ZeRO's states divide by dp_shard, not dp: HSDP 2 x 8 holds what ZeRO over 8 ranks does."""
    p = SEVEN_B.params
    for zero in (1, 2, 3):
        hsdp, _ = model_states(p, Layout(dp=16, zero=zero, dp_replicate=2), BATCH)
        eight, _ = model_states(p, Layout(dp=8, zero=zero), BATCH)
        sixteen, _ = model_states(p, Layout(dp=16, zero=zero), BATCH)
        assert hsdp == eight and sum(hsdp.values()) > sum(sixteen.values())


def test_hsdp_traffic_is_the_shard_group_inside_a_node_and_one_allreduce_across():
    """ZeRO-3 HSDP 2 x 8 on 2 nodes of 8: the gathers and reduce-scatters run over the 8 ranks of
    a node at NVLink's rate; each reduce-scatter is followed by an allreduce of its 1/8 shard
    between the 2 replicas, at each device's share of the node's network."""
    hw = _two_nodes("10gbps")
    lay = Layout(dp=16, zero=3, dp_replicate=2)
    p_dev, units = SEVEN_B.params, SEVEN_B.layers
    grads = state_bytes(BATCH)["gradients"] * p_dev
    weights = state_bytes(BATCH)["parameters"] * p_dev
    t = dp_traffic(lay, p_dev, hw, BATCH, units=units)
    rs = reduce_scatter_time(grads, 8, hw.intra_bw, hw.intra_latency, units)
    across = allreduce_time(grads / 8, 2, hw.inter_bw / 8, hw.inter_latency, units)
    assert t.across_replicas == pytest.approx(across)
    assert t.per_microbatch_rs == pytest.approx(rs + across)
    assert t.per_microbatch_ag == pytest.approx(
        2 * reduce_scatter_time(weights, 8, hw.intra_bw, hw.intra_latency, units))
    # full sharding takes longer: its two gathers and reduce-scatter each cross the slow
    # network (hierarchically, 1/8 of the model per device), against HSDP's one allreduce
    full = dp_traffic(Layout(dp=16, zero=3), p_dev, hw, BATCH, units=units)
    assert full.per_microbatch_rs + full.per_microbatch_ag > \
        t.per_microbatch_rs + t.per_microbatch_ag
    e = estimate(lay, SEVEN_B, hw, BATCH)
    assert e.comm["replicas"] == pytest.approx(across * e.microbatches)


def test_search_enumerates_hsdp_and_sp():
    hw = _two_nodes("100gbps")
    found = list(layouts(SEVEN_B, hw, BATCH, micro_batch=1))
    splits = {(lay.zero, lay.dp_replicate, lay.dp_shard) for lay in found if lay.hsdp}
    assert splits == {(z, r, 16 // r) for z in (1, 2, 3) for r in (2, 4, 8)}
    assert all(lay.zero and lay.tp == lay.pp == 1 for lay in found if lay.hsdp)
    assert any(lay.sequence_parallel for lay in found)
    assert all(lay.tp > 1 for lay in found if lay.sequence_parallel)
    tp = [lay for lay in found if lay.tp > 1]
    assert {lay.sequence_parallel for lay in tp} == {False, True}


def test_slow_network_picks_hsdp_and_says_why():
    """7B on 2 nodes x 8 A100s over 10 Gb/s: HSDP with one node per shard group wins by more than
    the tie band over sharding across all 16 ranks, and the explanation says why."""
    result = plan(SEVEN_B, _two_nodes("10gbps"), BATCH, everything=True)
    w = result.winner
    assert w.layout.hsdp and w.layout.dp_shard == 8 and w.layout.dp_replicate == 2
    full = next(e for e in result.ranked if e.layout.zero == w.layout.zero
                and not e.layout.hsdp and e.layout.dp == 16)
    assert full.step_s > w.step_s * (1 + TIE_BAND)
    assert full.comm_exposed_s > w.comm_exposed_s
    text = result.explanation
    assert "Why HSDP (2 replica groups x 8-rank shard groups)" in text
    assert "crosses the 10gbps network" in text and full.layout.describe() in text


def test_fast_network_keeps_full_sharding():
    """The same run over 8 x 400 Gb/s: sharding over all 16 ranks wins, HSDP at best ties."""
    result = plan(SEVEN_B, _two_nodes("8x400gbps"), BATCH, everything=True)
    w = result.winner
    assert not w.layout.hsdp and w.layout.dp == 16 and w.layout.zero
    best = next(e for e in result.ranked if e.layout.hsdp)
    assert best.step_s >= w.step_s * (1 - TIE_BAND)
    assert "Why not HSDP" in result.explanation


def test_cli_names_hsdp_with_its_reason(capsys):
    argv = ["--model", "7B", "--nodes", "2", "--gpus-per-node", "8", "--global-batch", "256"]
    assert main(argv + ["--network", "10gbps"]) == 0
    out = capsys.readouterr().out
    assert "Planner: zero1 dp=16 hsdp=2x8" in out and "Why HSDP" in out
    assert main(argv + ["--network", "8x400gbps"]) == 0
    assert "Why not HSDP" in capsys.readouterr().out


def test_sp_wins_where_only_it_fits_and_says_why():
    """70B on 4 nodes of 8 A100-40GB: the winner needs sequence parallelism's 1/tp of the
    norm and dropout activations to fit; without it the same layout does not."""
    hw = Hardware.from_catalogue("a100-40gb", nodes=4, devices_per_node=8, network="8x200gbps")
    result = plan(parse_model("70B"), hw, Batch(256))
    w = result.winner
    assert w.layout.sequence_parallel and w.layout.tp > 1
    plain = estimate(replace(w.layout, sequence_parallel=False), parse_model("70B"), hw,
                     Batch(256))
    assert not plain.fits and plain.memory_total > w.memory_total
    assert plain.comm["tp"] == pytest.approx(w.comm["tp"])          # the same traffic
    assert "Why sequence parallelism" in result.explanation and "does not fit" in \
        result.explanation


@pytest.mark.parametrize("kwargs, field", [
    (dict(dp=16, dp_replicate=2), "--dp-replicate"),                  # HSDP under DDP
    (dict(dp=16, zero=3, dp_replicate=3), "--dp-replicate"),          # does not divide dp
    (dict(dp=4, tp=2, zero=1, dp_replicate=2), "--dp-replicate"),     # not with tp yet
    (dict(dp=2, sequence_parallel=True), "--sequence-parallel"),      # sp needs tp
])
def test_bad_axes_are_refused_in_one_line(kwargs, field):
    with pytest.raises(PlanError) as exc:
        Layout(**kwargs)
    assert str(exc.value).startswith(f"{field}: value ") and "; fix: " in str(exc.value)
