"""The planner against the published runs (issue 35 item 6): Megatron-LM's Tables 1 and 2
(Narayanan et al. 2021) and Korthikanti et al. 2022's iteration times, every figure within
``published.BAND`` (20%) of the paper's, and the saved table in docs/planner.md equal to what
the code computes today (``python -m shardwise.bench.planner_published --save`` rewrites it).

The bands are the issue's goals. The paper's numbers live in shardwise/planner/published.py
(table and row beside each); nothing here is typed twice. The full-recompute rows of
Korthikanti et al. are the ones the A100's two compute constants were fitted to (catalogue.py),
so their band checks the fit; every other row is out of sample.
"""
import json
import os
from dataclasses import replace

import pytest

from shardwise.config.names import Strategy
from shardwise.planner import Batch, Layout, estimate
from shardwise.planner import published as pub
from shardwise.planner.compute import elementwise_seconds
from shardwise.planner.memory import activation_per_layer
from shardwise.planner.replay import model_of, replay, selene

pytestmark = pytest.mark.timeout(300)

SAVED = os.path.join(os.path.dirname(__file__), "..", "..", "shardwise", "bench", "results",
                     "planner_published.json")


@pytest.fixture(scope="module")
def doc():
    return replay()


def test_the_published_rows_agree_with_themselves():
    """Each row's columns follow from one another, which catches a mistyped figure: TFLOP/s x
    GPUs is the aggregate (Table 1), 8 T P / (n X) the days for 300B tokens (Table 2)."""
    for r in pub.TABLE1:
        assert r.tflops * r.gpus / 1000 == pytest.approx(r.aggregate_pflops, rel=0.01), r
    for r in pub.TABLE2:
        params = model_of(r.shape).params
        days = 8 * 300e9 * params / (r.gpus * r.tflops * 1e12) / 86400
        assert days == pytest.approx(r.days, rel=0.05), r    # eq. 3's (1 + ...) and rounding


def test_published_top3_reads_the_papers_chain():
    """t up to the node (8) first, then p over the divisors of the layers, t p dividing the
    GPUs; the published (t, p) and one step either side (two inward at an end)."""
    rows = {r.shape.name: r for r in pub.TABLE1}
    expect = {"1.7B": [(1, 1), (2, 1), (4, 1)], "18.4B": [(4, 1), (8, 1), (8, 2)],
              "76.1B": [(8, 1), (8, 2), (8, 4)], "145.6B": [(8, 4), (8, 8), (8, 16)],
              "310.1B": [(8, 12), (8, 16), (8, 24)], "529.6B": [(8, 21), (8, 35), (8, 105)],
              "1008.0B": [(8, 32), (8, 64), (8, 128)]}
    for name, top in expect.items():
        r = rows[name]
        assert pub.top3(r.shape, r.gpus, (r.tp, r.pp)) == top, name


def _rows(doc, table, **match):
    return [r for r in doc[table] if all(r[k] == v for k, v in match.items())]


@pytest.mark.parametrize("scheme", ["zero3", "ptd-p"])
def test_table2_throughput_within_the_band(doc, scheme):
    """N21 Table 2: ZeRO-3 without model parallelism loses throughput as the GPUs grow at a
    fixed batch (its gathers are not hidden); PTD-P keeps it. Every row within 20%."""
    out = [f"{r['model']} on {r['gpus']}: {r['planner_tflops']:.0f} vs {r['paper_tflops']}"
           for r in _rows(doc, "table2", scheme=scheme) if abs(r["error"]) > pub.BAND]
    assert not out, out


def test_zero3_at_scale_falls_as_the_paper_measured(doc):
    """At a fixed batch, doubling the GPUs halves ZeRO-3's TFLOP/s once its traffic dominates
    (175B 768 -> 1536, 530B 1120 -> 2240: 88 -> 44 and 98 -> 48 in the paper)."""
    for model, (a, b) in (("174.6B", (768, 1536)), ("529.6B", (1120, 2240))):
        x, y = (_rows(doc, "table2", scheme="zero3", model=model, gpus=n)[0] for n in (a, b))
        assert y["planner_tflops"] / x["planner_tflops"] == pytest.approx(0.5, abs=0.1)


def test_recompute_iteration_times_within_the_band(doc):
    """K22 Table 5: full recomputation (the fit) and selective + sequence parallelism."""
    for r in doc["recompute"]:
        assert abs(r["full_error"]) <= pub.BAND, r
        assert abs(r["selective_error"]) <= pub.BAND, r


def test_table1_throughput_of_the_papers_layouts_within_the_band(doc):
    out = [f"{r['model']}: {r['planner_tflops']:.0f} vs {r['paper_tflops']}"
           for r in doc["table1"] if abs(r["error"]) > pub.BAND]
    assert not out, out


def test_table1_choices_stay_in_the_published_top3(doc):
    """The rows whose choice is in the published top 3 today stay so (a regression check)."""
    hits = {r["model"] for r in doc["table1"] if r["hit"]}
    assert hits >= {"1.7B", "3.6B", "7.5B", "18.4B", "76.1B", "310.1B", "529.6B", "1008.0B"}, hits


def test_table1_top3_goal(doc):
    assert doc["summary"]["top3_hits"] >= pub.TOP3_GOAL


def test_the_headroom_moves_529b_into_the_top3():
    """Without catalogue.GPU_HEADROOM the planner fills 529.6B's A100s to 97% at (8, 15),
    outside the published top 3; with it, (8, 15) does not fit and the choice is in the top 3.
    (All rows at 0-15%: ``headroom_sensitivity`` in the saved JSON, docs/planner.md.)"""
    from shardwise.planner.replay import paper_choices
    row = next(r for r in pub.TABLE1 if r.shape.name == "529.6B")
    top = pub.top3(row.shape, row.gpus, (row.tp, row.pp))
    model, batch = model_of(row.shape), Batch(row.batch)
    bare, _ = paper_choices(model, replace(selene(row.gpus), headroom=0.0), batch)
    kept, _ = paper_choices(model, selene(row.gpus), batch)
    assert (bare.layout.tp, bare.layout.pp) == (8, 15) and (8, 15) not in top
    assert (kept.layout.tp, kept.layout.pp) in top


def test_the_headroom_refuses_no_zero3_run_that_was_made_within_it(doc):
    """catalogue.GPU_HEADROOM's upper bound: DeepSpeed ran 529.6B's ZeRO-3 on 1,120 and 2,240
    GPUs (N21 Table 2), so the planner must not call those out of memory. (The 640-GPU row
    is over the memory in the planner's count whatever the headroom: docs/planner.md.)"""
    ran = [r for r in doc["table2"] if r["scheme"] == Strategy.ZERO3 and r["gpus"] >= 1120]
    assert ran and all(r["fits"] for r in ran), [(r["model"], r["gpus"]) for r in ran]


def test_more_model_parallelism_as_the_models_grow(doc):
    """N21's trend: t x p of the planner's choices never shrinks from 1.7B to 1T, and no model
    from 18.4B up is given to ZeRO-3 over all its GPUs."""
    assert doc["summary"]["trend_holds"], doc["summary"]["model_parallel_sizes"]
    assert all("zero3" not in r["choice"] for r in doc["table1"][3:])


def test_the_saved_table_is_what_the_code_computes(doc):
    """docs/planner.md renders shardwise/bench/results/planner_published.json: it must be the
    cost model of today (else: python -m shardwise.bench.planner_published --save)."""
    saved = json.load(open(SAVED))

    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) and isinstance(b, (int, float)):
            return b == pytest.approx(a, rel=1e-9)
        return a == b
    for key in ("table1", "table2", "recompute", "summary"):
        assert same(doc[key], saved[key]), key


def test_zero3_across_nodes_is_exposed_inside_a_node_hidden():
    """ZeRO-3 over every GPU of several nodes: its traffic at a device's adapter share, none
    hidden (comm.zero3_across_nodes); inside one node the unit prefetch still hides it."""
    model = model_of(pub.GPT3)
    across = estimate(Layout(dp=64, zero=3, act_ckpt=True), model, selene(64), Batch(64))
    assert across.comm_exposed_s == pytest.approx(across.comm_s)
    hw = selene(8)
    inside = estimate(Layout(dp=8, zero=3, act_ckpt=True, micro_batch=8),
                      replace(model, layers=8), hw, Batch(64))
    assert inside.comm_exposed_s < 0.5 * inside.comm_s
    per_byte = across.comm_s / (3 * 2 * model.params * 63 / 64)  # 2 gathers + 1 reduce-scatter
    adapter = selene(64).inter_bw / pub.GPUS_PER_NODE
    assert 1 / per_byte == pytest.approx(adapter, rel=0.05)


def test_non_gemm_kernels_make_wide_layers_more_efficient():
    """compute.py: a block's non-GEMM time is passes x its activation bytes / HBM bandwidth
    (x 4/3 with full recomputation), 0 without passes; per FLOP it weighs less as h grows."""
    hw = selene(8)
    lay = Layout(tp=8, micro_batch=1)
    rates = []
    for shape in (pub.G22, pub.GPT3, pub.G1T):
        model, batch = model_of(shape), Batch(8)
        bytes_ = activation_per_layer(model, lay, batch, full=True)
        assert elementwise_seconds(lay, model, hw, batch) == pytest.approx(
            hw.activation_passes * bytes_ / hw.mem_bw)
        full = replace(lay, act_ckpt=True)
        assert elementwise_seconds(full, model, hw, batch) == pytest.approx(
            4 / 3 * hw.activation_passes * bytes_ / hw.mem_bw)
        assert elementwise_seconds(lay, model, replace(hw, activation_passes=0.0), batch) == 0
        e = estimate(lay, model, hw, Batch(8))
        rates.append(model.flops_per_token() * model.seq_len * 8 / 8 / e.compute_s)
    assert rates[0] < rates[1] < rates[2] < hw.flops("bf16")
