"""Planner fidelity (issue 17): input checks, GEMM-size efficiency, hierarchical collectives,
ZeRO-3's per-unit gathers, the schedules and offload combinations in the search, the memory
conventions from the CLI (the published run's recompute note: test_planner_cli)."""
import json

import pytest

from shardwise.planner import PRESETS, Batch, Hardware, Layout, PlanError, estimate, plan
from shardwise.planner import comm, kernels
from shardwise.planner.cli import main
from shardwise.planner.model import parse_model
from shardwise.planner.search import layouts


def test_memory_smaller_than_the_reserve_is_refused(capsys):
    assert main(["--model", "175B", "--memory", "1B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --memory: value 1 B leaves nothing")
    assert "; fix: " in err[0]


def test_bare_parameter_count_is_a_model(capsys):
    """``--model 10T``: a GPT-3-shaped model of that many parameters (175e9 gives GPT-3)."""
    ten = parse_model("10T")
    assert ten.params == pytest.approx(10e12, rel=0.02) and ten.heads % 8 == 0
    assert "derived" in ten.name
    gpt3 = parse_model("175e9")
    assert (gpt3.layers, gpt3.hidden, gpt3.heads) == (96, 12288, 96)
    assert main(["--model", "10T", "--micro-batch", "1", "--format", "json"]) == 1  # 8 GPUs
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == ten.params and doc["winner"] is None
    with pytest.raises(PlanError, match="--model: .*too few parameters"):
        parse_model("5M")


def test_gemm_curve_and_its_fit():
    """t = max(F/R, B/W) + t0: a large GEMM runs at R, one with F/R = t0 at half, a thin one
    at W's roofline; fit_curve recovers R and t0 from timed GEMMs."""
    rate, bw, t0 = 100e12, 2e12, 5e-6
    big = kernels.Gemm(8192, 8192, 8192)
    assert kernels.efficiency(big, rate, bw, t0, 2) > 0.99
    half = kernels.Gemm(500, 500, 1000)                # 2 * 500 * 500 * 1000 / 1e14 = 5 us
    assert kernels.efficiency(half, rate, bw, t0, 2) == pytest.approx(0.5)
    thin = kernels.Gemm(1, 8192, 8192)                 # matrix-vector: bandwidth-bound
    assert kernels.efficiency(thin, rate, bw, 0.0, 2) == pytest.approx(
        (thin.flops / rate) / (thin.bytes(2) / bw))
    samples = [(g.flops, g.flops / 80e12 + 7e-6) for g in
               (kernels.Gemm(n, n, n) for n in (512, 1024, 2048, 4096))]
    fitted_rate, fitted_t0 = kernels.fit_curve(samples)
    assert fitted_rate == pytest.approx(80e12) and fitted_t0 == pytest.approx(7e-6)
    with pytest.raises(PlanError, match="--gemm-samples: "):
        kernels.fit_curve(samples[:1])


def test_small_layers_run_below_the_plateau():
    """The same tokens through gpt-tiny's thin GEMMs take longer per FLOP than through 7B's
    (the GEMM curve alone: without compute.py's non-GEMM kernels, which the published-runs
    test checks)."""
    from dataclasses import replace
    hw = replace(Hardware.from_catalogue("a100-80gb", devices_per_node=1), activation_passes=0.0)
    per_flop = {}
    for name in ("gpt-tiny", "7B"):
        m = PRESETS[name]
        e = estimate(Layout(micro_batch=1), m, hw, Batch(1))
        per_flop[name] = (e.compute_s - m.layers * hw.block_overhead) / (
            m.flops_per_token() * m.seq_len)
    assert per_flop["gpt-tiny"] > 2 * per_flop["7B"]
    assert per_flop["7B"] * hw.flops("bf16") == pytest.approx(1, rel=0.05)


def test_hierarchical_allreduce_across_nodes():
    """dp = 32 over 4 nodes of 8: NVLink reduce-scatter in the node, the 1/8 shard across
    nodes, all-gather in the node; it pays 2 x 7 intra + 2 x 3 inter ring steps, not 2 x 31
    inter ones, so at small sizes it beats the flat ring; it is never slower."""
    hw = Hardware.from_catalogue("a100-80gb", nodes=4, devices_per_node=8, network="100gbps")
    lay = Layout(dp=32)
    small = comm.dp_collective("ar", 1e5, lay, hw, 1)
    bw, alpha = hw.link(32, 1)
    flat_small = comm.allreduce_time(1e5, 32, bw, alpha)
    expected = (2 * comm.reduce_scatter_time(1e5, 8, hw.intra_bw, hw.intra_latency)
                + comm.allreduce_time(1e5 / 8, 4, hw.inter_bw / 8, hw.inter_latency))
    assert small == pytest.approx(expected) and small < flat_small
    for k in (1e3, 1e6, 1e9):
        assert comm.dp_collective("ar", k, lay, hw, 1) <= comm.allreduce_time(k, 32, bw, alpha)
    inside = Layout(dp=8)
    assert comm.dp_collective("ar", 1e6, inside, hw, 1) == pytest.approx(
        comm.allreduce_time(1e6, 8, hw.intra_bw, hw.intra_latency))


def test_zero3_pays_latency_per_unit_and_prefetch_hides_the_rest():
    """ZeRO-3 gathers block by block: the latency term grows with the units; with compute to
    hide behind, only the first unit's gather and the last reduce-scatter stay exposed."""
    m, hw = PRESETS["7B"], Hardware.from_catalogue("a100-80gb", devices_per_node=8)
    lay = Layout(dp=8, zero=3)
    one = comm.dp_traffic(lay, m.params, hw, Batch(8), units=1)
    per_unit = comm.dp_traffic(lay, m.params, hw, Batch(8), units=m.layers)
    steps = (8 - 1) * hw.intra_latency
    assert per_unit.per_microbatch_ag - one.per_microbatch_ag == pytest.approx(
        2 * (m.layers - 1) * steps)
    from shardwise.planner.cost import _exposed_per_microbatch
    n = m.layers
    lots = _exposed_per_microbatch(per_unit, 1e3, 1e3, n)
    gather, rs = per_unit.per_microbatch_ag / 2 / n, per_unit.per_microbatch_rs / n
    assert lots == pytest.approx(2 * gather + rs)
    none = _exposed_per_microbatch(per_unit, 0.0, 0.0, n)
    assert none == pytest.approx(per_unit.per_microbatch_ag + per_unit.per_microbatch_rs)


def test_search_has_interleaving_zb_h1_selective_and_offload_combinations():
    """``everything=True`` (the CLI) searches interleaved 1F1B, ZB-H1, selective recompute and
    ZeRO-3 parameter offload; the default (``--strategy auto``) only what shardwise runs:
    parameters offloaded only with the optimizer (``--offload cpu|disk --offload-params``)."""
    m = PRESETS["7B"]
    hw = Hardware.from_catalogue("a100-80gb", devices_per_node=4)
    every = list(layouts(m, hw, Batch(16), micro_batch=1, everything=True))
    auto = list(layouts(m, hw, Batch(16), micro_batch=1))
    assert {(lay.schedule, lay.virtual_stages) for lay in every if lay.pp == 4} >= {
        ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1)}
    assert {lay.recompute for lay in every} == {"none", "selective", "full"}
    combos = {(lay.offload, lay.offload_params) for lay in every if lay.zero == 3}
    assert combos == {(o, p) for o in ("none", "cpu", "disk") for p in ("none", "cpu", "disk")}
    assert all(lay.schedule in ("1f1b", "gpipe") and lay.recompute != "selective"
               and lay.offload_params in ("none", lay.offload) for lay in auto)
    assert {(lay.offload, lay.offload_params) for lay in auto if lay.offload_params != "none"} \
        == {("cpu", "cpu"), ("disk", "disk")}
    inter = estimate(Layout(pp=4, schedule="interleaved-1f1b", virtual_stages=2), m, hw,
                     Batch(16))
    plain = estimate(Layout(pp=4), m, hw, Batch(16))
    assert inter.bubble_s == pytest.approx(plain.bubble_s / 2, rel=0.05)


def test_deepspeed_convention_from_the_cli(capsys):
    argv = ["--model", "gpt-tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--micro-batch", "4",
            "--format", "json", "--top", "1"]
    assert main(argv + ["--convention", "deepspeed"]) == 0
    ds = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    paper = json.loads(capsys.readouterr().out)
    assert ds["batch"]["convention"] == "deepspeed"
    assert paper["batch"]["convention"] == "zero-paper"
    assert main(argv + ["--convention", "megatron"]) == 2
    assert main(argv + ["--tie-band", "2"]) == 2
    assert "--tie-band: " in capsys.readouterr().err


def test_validation_models_dp_replicas_at_once_and_ps_workers_on_their_cores(monkeypatch):
    """benchmarks' planner validation (shardwise/bench/validate_planner.py): one process's R
    replicas run at once, one per core (not one after the other); the parameter server's
    workers compute with a calibration of their own count while its links stay the world's."""
    from dataclasses import replace
    from shardwise.launch import auto as autoplan
    from shardwise.bench.harness import gpt_bench_config
    from shardwise.bench import validate_planner as vp
    hw = Hardware.custom(nodes=1, devices_per_node=1, memory_bytes=8 * 2**30, peak_flops=1e11,
                         intra_bw=1e9)
    cfg = gpt_bench_config("dp", parallel={"replicas": 2})
    layout = Layout(micro_batch=4)
    whole = estimate(layout, autoplan.model_spec(cfg), hw, autoplan.batch_of(cfg))
    half = estimate(layout, autoplan.model_spec(cfg), hw, Batch(4, precision="fp32"))
    monkeypatch.setattr(vp.os, "cpu_count", lambda: 2)
    two_cores = vp._dp_step(layout, cfg, hw, whole)
    assert half.step_s < two_cores < half.step_s * 1.2 < whole.step_s     # at once, + reduce
    monkeypatch.setattr(vp.os, "cpu_count", lambda: 1)
    assert vp._dp_step(layout, cfg, hw, whole) == pytest.approx(two_cores + half.step_s)
    links = replace(hw, intra_bw=5e8, intra_latency=3e-4)
    mixed = vp._computing_on(links, replace(hw, peak_flops=2e11, mem_bw=7e10))
    assert (mixed.peak_flops, mixed.mem_bw) == (2e11, 7e10)
    assert (mixed.intra_bw, mixed.intra_latency) == (5e8, 3e-4)
