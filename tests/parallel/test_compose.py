"""The composer (shardwise/parallel/compose.py): any data-parallel stage x tensor parallel on one
mesh, equal to single-process training, and the presets / contradictions of shardwise/parallel/layout.py.

Tolerance: fp32 rtol 1e-5 / atol 1e-5 (tests/reference.py): tp splits matmul sums and dp
averages ranks' gradients in another order than one process.
"""
from dataclasses import replace

import pytest
import torch

from harness import assert_close_runs, run_world
from test_hybrid import WHY, _plain, _user_cfg, _user_world
from shardwise.config import Config, ConfigError, ParallelConfig
from shardwise.parallel.layout import describe, reads, resolve

pytestmark = pytest.mark.timeout(300)


def _par(**kw) -> Config:
    return Config(parallel=ParallelConfig(**kw))


def test_presets_and_composition_resolve():
    cases = [  # (parallel fields, strategy named explicitly?) -> (strategy, stage)
        ({"dp": 2, "tp": 2, "zero_stage": 3}, False, ("3d", 3)),
        ({"zero_stage": 2}, False, ("zero2", 2)),
        ({}, False, ("ddp", 0)),
        ({"strategy": "zero3"}, True, ("zero3", 3)),
        ({"strategy": "tp", "tp": 2, "zero_stage": 3}, True, ("tp", 3)),
        ({"strategy": "3d", "pp": 2, "zero1_over_dp": True}, True, ("3d", 1)),
        ({"strategy": "ps"}, True, ("ps", -1)),
        ({"pp": 2, "zero_stage": 2}, False, ("3d", 2)),      # a pipeline of ZeRO-2 stages
        ({"dp": 2, "pp": 2, "zero_stage": 3}, False, ("3d", 3)),
    ]
    for fields, named, (name, stage) in cases:
        p = resolve(_par(**fields), explicit_strategy=named).parallel
        assert (p.strategy, p.zero_stage) == (name, stage), fields
    assert describe(resolve(_par(tp=2, zero_stage=3))) == "ZeRO-3 over dp x tensor parallel over tp=2"


@pytest.mark.parametrize("fields,field", [
    ({"strategy": "ddp", "tp": 2}, "parallel.tp"),
    ({"strategy": "zero3", "zero_stage": 1}, "parallel.zero_stage"),
    ({"strategy": "zero1", "pp": 2}, "parallel.pp"),
    ({"strategy": "pp", "pp": 2, "tp": 2}, "parallel.tp"),
    ({"zero_stage": 4}, "parallel.zero_stage"),
    ({"strategy": "3d", "zero_stage": 2, "zero1_over_dp": True}, "parallel.zero1_over_dp"),
])
def test_contradictions_are_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as exc:
        resolve(_par(**fields), explicit_strategy="strategy" in fields)
    assert exc.value.field_name == field and "fix:" in str(exc.value)


def test_what_each_layout_reads():
    zero3_tp = reads(resolve(_par(tp=2, zero_stage=3)))
    assert zero3_tp["zero3_units"] and zero3_tp["offload"] and not zero3_tp["bucket_mb"]
    assert not zero3_tp["find_unused"] and not zero3_tp["num_microbatches"]
    ddp = reads(resolve(_par()))
    assert ddp["bucket_mb"] and ddp["find_unused"] and not ddp["offload"]
    pipe = reads(resolve(_par(pp=2, zero_stage=1)))   # the same component as without pp
    assert pipe["schedule"] and pipe["allreduce"] and pipe["overlap"] and pipe["bucket_mb"]
    assert pipe["offload"] and not pipe["find_unused"]
    pipe3 = reads(resolve(_par(pp=2, zero_stage=3)))
    assert pipe3["zero3_units"] and not pipe3["bucket_mb"]
    pipe0 = reads(resolve(_par(pp=2)))
    assert pipe0["overlap"] and pipe0["bucket_mb"] and pipe0["grad_compression"]
    assert not pipe0["find_unused"]


def test_every_stage_times_tp_equals_single_with_the_users_loop():
    """dp 2 x tp 2 (and dp 4 alone) at ZeRO stages 0-3: ranks seeded differently, two
    parameter groups, the global norm clipped (binding every step), the user's zero_grad and,
    every other step, the user's optimizer.step() instead of engine.step()."""
    base = _user_cfg(0.0)
    max_norm = 0.5 * min(_plain(base, float("inf"))[1])
    ref_losses, ref_norms, ref_params = _plain(base, max_norm)
    assert all(norm > max_norm for norm in ref_norms)
    configs = [_user_cfg(max_norm, dp=2, tp=2, zero_stage=s) for s in (0, 1, 2, 3)]
    configs += [_user_cfg(max_norm, dp=4, zero_stage=s) for s in (1, 2, 3)]
    for rank, out in enumerate(run_world(_user_world, 4, configs)):
        for cfg, (losses, norms, params) in zip(configs, out):
            why = f"rank {rank}, zero_stage {cfg.parallel.zero_stage}: {WHY}"
            assert_close_runs(losses, ref_losses, params, ref_params, 1e-5, 1e-5, why=why)
            torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-5, msg=why)


def _one_step_meter(cfg):
    from shardwise.run.api import optimizer_factory, prepare
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    rt = init_runtime(cfg)
    engine = prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg,
                     loss_fn=loss_for(cfg.model), runtime=rt)
    x, y = build_data(cfg).batch(0, cfg.train.batch_size, *engine.strategy.data_shard())
    rt.comm.meter.reset()
    engine.train_step(x, y)
    return rt.comm.meter.snapshot(), len(engine.strategy.grads.buckets.buckets)


def _pipeline_dp(rank, n, configs):
    from reference import run
    out = [run(cfg) for cfg in configs]
    meter, buckets = _one_step_meter(configs[0])
    compressed = replace(configs[0], parallel=replace(configs[0].parallel, grad_compression="bf16"))
    return out, meter, buckets, _one_step_meter(compressed)[0]


def test_pipeline_dp_is_the_ddp_component():
    """dp 2 x pp 2 at stage 0: DDP's buckets reduce once per step (during the last micro-batch's
    backward, not once per micro-batch), over the backend or the ring, equal to one process;
    with bf16 gradient compression the same buckets carry half the bytes."""
    from reference import single_run, tiny_config
    configs = [replace(tiny_config("3d", steps=6, dp=2, pp=2, bucket_mb=0.01, schedule=s,
                                   allreduce=a), logging=replace(tiny_config().logging,
                                                                 schedule_png="off"))
               for s, a in (("1f1b", "native"), ("gpipe", "ring"))]
    results = run_world(_pipeline_dp, 4, configs)
    for out, meter, buckets, bf16 in results:
        for cfg, (losses, params) in zip(configs, out):
            ref = single_run(cfg)
            assert_close_runs(losses, ref[0], params, ref[1], 1e-5, 1e-5, why=f"{cfg.parallel}")
        assert buckets >= 2 and meter["ddp_all_reduce"]["calls"] == buckets
        assert "dp_grad" not in meter
        # --grad-compression bf16 reaches the pipeline's dp: the same calls, half the bytes
        assert bf16["ddp_all_reduce"]["calls"] == buckets
        assert 2 * bf16["ddp_all_reduce"]["bytes_sent"] == meter["ddp_all_reduce"]["bytes_sent"]


def _tp_zero(rank, n, configs):
    from reference import run
    from shardwise.run.runtime import init_runtime
    mesh = init_runtime(configs[-1]).mesh
    return [run(cfg) for cfg in configs], mesh.group("tp").ranks, mesh.group("dp").ranks


def test_tp2_times_zero2_and_zero3_and_the_mesh_order():
    """tp 2 x ZeRO-2 / ZeRO-3 (dp 1, world 2) equal one process; and the mesh lays out dp 2 x
    tp 2 with tp innermost (tp groups are rank neighbours), so a change of axis order fails here
    rather than silently pairing the wrong ranks."""
    from reference import single_run, tiny_config
    configs = [tiny_config("3d", steps=6, tp=2, zero_stage=s) for s in (2, 3)]
    for out, tp_ranks, _ in run_world(_tp_zero, 2, configs):
        assert tp_ranks == (0, 1)
        for cfg, (losses, params) in zip(configs, out):
            ref = single_run(cfg)
            assert_close_runs(losses, ref[0], params, ref[1], 1e-5, 1e-5, why=f"{cfg.parallel}")
    grid = [tiny_config("3d", steps=1, dp=2, tp=2, zero_stage=3)]
    for rank, (_, tp_ranks, dp_ranks) in enumerate(run_world(_tp_zero, 4, grid)):
        assert tp_ranks == (rank - rank % 2, rank - rank % 2 + 1)
        assert dp_ranks == (rank % 2, rank % 2 + 2)
