"""3D: tensor parallel inside pipeline stages, data parallel across them, ZeRO-1 over dp; each
equal to single-process training. World size 1 is plain training, exactly.

Tolerance: fp32 rtol 1e-5 (atol 1e-5 on parameters): tp splits matmul sums, the pipeline sums
micro-batch gradients and dp averages ranks' gradients, each in another order than the single
process; Adam can turn the last bits of a nearly cancelling gradient element into a small
fraction of lr (1e-2) over 10 steps: 1e-5 absolute is 1/1000 of lr.
"""
from dataclasses import replace

import pytest

from harness import assert_close_runs, run_world
from reference import run, single_run, tiny_config

pytestmark = pytest.mark.timeout(300)
RTOL, ATOL = 1e-5, 1e-5
WHY = "fp32; tp, micro-batches and dp reduce in other orders"


def _cfg(strategy="3d", **parallel):
    c = tiny_config(strategy, steps=10, **parallel)
    return replace(c, logging=replace(c.logging, schedule_png="off"))


def _runs(rank, n, configs):
    out = [run(cfg) for cfg in configs]
    from shardwise.runtime import init_runtime
    from shardwise.train import train
    cfg = replace(configs[0], train=replace(configs[0].train, steps=1))
    rt = init_runtime(cfg)
    train(cfg, rt, quiet=True)
    return out, rt.comm.meter.snapshot(), rt.mesh.pp_rank


def _assert_equal_to_single(results, configs):
    for out, _, _ in results:
        for cfg, (losses, params) in zip(configs, out):
            expected = single_run(cfg)
            assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL,
                              why=f"{WHY}; {cfg.parallel}")


def test_world_of_one_is_plain_training_exactly():
    cfg = _cfg()
    losses, params = run(cfg)
    expected = single_run(cfg)
    assert_close_runs(losses, expected[0], params, expected[1], rtol=0, atol=0,
                      why="no reduction happens in a world of one")


def test_tp2_pp2_both_schedules_and_tp_traffic_per_microbatch():
    configs = [_cfg(tp=2, pp=2, schedule=s) for s in ("gpipe", "1f1b")]
    results = run_world(_runs, 4, configs)
    _assert_equal_to_single(results, configs)
    cfg = configs[0]
    m, L, h = cfg.parallel.num_microbatches, cfg.model.n_layer, cfg.model.n_embd
    b, s = cfg.train.batch_size // m, cfg.model.block_size
    per_stage = L // 2          # balanced split of 2 equal blocks: one per stage
    for _, meter, pp_rank in results:
        # one train step of m micro-batches (+ one evaluation forward of the whole batch)
        assert meter["tp_bwd"]["calls"] == 2 * per_stage * m
        assert meter["tp_bwd"]["bytes_sent"] == 2 * per_stage * m * int(b * s * h * 4)  # tp = 2
        assert meter["tp_fwd"]["calls"] == 2 * per_stage * (m + 1)
        # activations down / gradients up: one (b, s, h) tensor per micro-batch
        key = "pp_act" if pp_rank == 0 else "pp_grad"
        assert meter[key]["bytes_sent"] == m * b * s * h * 4


def test_dp2_with_zero1_over_dp_equals_single():
    configs = [_cfg(dp=2, pp=2, schedule="1f1b", zero1_over_dp=True),
               _cfg(dp=2, tp=2, zero1_over_dp=True)]
    results = run_world(_runs, 4, configs)
    _assert_equal_to_single(results, configs)
    meter = results[0][1]
    assert meter["zero1_grad"]["calls"] == 1 and meter["zero1_params"]["calls"] == 1
    assert "dp_grad" not in meter


@pytest.mark.slow
def test_dp2_tp2_pp2_world8_equals_single():
    configs = [_cfg(dp=2, tp=2, pp=2, schedule=s) for s in ("gpipe", "1f1b")]
    _assert_equal_to_single(run_world(_runs, 8, configs, timeout=600), configs)


def _mixed(rank, n, strategy, parallel):
    from dataclasses import replace as rep

    from reference import run, tiny_config
    cfg = tiny_config(strategy, steps=12, **parallel)
    cfg = rep(cfg, data=rep(cfg.data, dataset="stdlib", max_bytes=200_000),
              model=rep(cfg.model, vocab_size=256))
    fp32 = run(cfg)[0]
    bf16 = run(rep(cfg, memory=rep(cfg.memory, mixed_precision="bf16")))[0]
    return fp32, bf16


@pytest.mark.parametrize("strategy,parallel", [("tp", {"tp": 2}), ("pp", {"pp": 2})])
def test_mixed_precision_runs_under_tp_and_pp(strategy, parallel):
    fp32, bf16 = run_world(_mixed, 2, strategy, parallel)[0]
    assert bf16 != fp32                     # bf16 really ran (the losses differ in low bits)
    assert bf16[-1] < bf16[0]               # and it trains
    # bf16 keeps 8 mantissa bits: after 12 steps the loss stays within 5% of fp32's
    assert abs(bf16[-1] - fp32[-1]) < 0.05 * fp32[-1]
