"""fp16 dynamic loss scaling under every layout (parallel/scaling.py, memory/loss_scale.py).

At step 3 of 4 rank 0 alone multiplies one of its gradients by inf. Every rank must skip that
step (parameters bit-identical before and after it), halve the scale, count one skipped step,
and train on: the steps before and after move the parameters and the loss stays finite. Ranks
that disagreed (rank 0 skipping, rank 1 stepping) would leave the gathered parameters
unequal to the skip's; a step that ignored the inf would make them nan.
"""
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import assert_overflow_step_skipped, tiny_config
from shardwise.memory.loss_scale import LossScaler, has_nonfinite

pytestmark = pytest.mark.timeout(300)
INJECT = 2          # the 0-based step whose gradient rank 0 poisons


def _fp16(strategy, **parallel):
    cfg = tiny_config(strategy, steps=4, **parallel)
    return replace(cfg, memory=replace(cfg.memory, mixed_precision="fp16"),
                   train=replace(cfg.train, grad_clip=1.0))


def _run(rank, world, cfg):
    import shardwise
    from shardwise.run.api import optimizer_factory
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    data = build_data(cfg)
    engine = shardwise.prepare(build_model(cfg.model, cfg.train.seed), optimizer_factory(cfg),
                               cfg, loss_fn=loss_for(cfg.model), runtime=init_runtime(cfg))
    state = {"poison": False}
    target = next(p for p in engine.model.parameters() if p.requires_grad)
    target.register_hook(lambda g: g * float("inf") if state["poison"] and rank == 0 else g)
    index, count = engine.strategy.data_shard()
    losses, params = [], []
    for step in range(cfg.train.steps):
        state["poison"] = step == INJECT
        x, y = data.batch(step, cfg.train.batch_size, index, count)
        losses.append(engine.train_step(x, y))
        params.append(engine.full_state_dict())
    return {"losses": losses, "params": params, "scaler": engine.strategy.scaler.state_dict()}


LAYOUTS = {
    "ddp": _fp16("ddp"), "tp2": _fp16("tp", tp=2), "pp2": _fp16("pp", pp=2),
    "zero1": _fp16("zero1"), "zero3": _fp16("zero3"),
}


def _run_all(rank, world, cfgs):
    return {name: _run(rank, world, cfg) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def runs():
    ranks = run_world(_run_all, 2, LAYOUTS, timeout=280)   # one world for every layout
    return {name: [r[name] for r in ranks] for name in LAYOUTS}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_overflow_is_skipped_on_every_rank_and_training_recovers(runs, name):
    for r in runs[name]:
        assert_overflow_step_skipped(r, INJECT)
        assert r["scaler"]["skipped_steps"] == 1
        assert r["scaler"]["scale"] == 2.0 ** 15                # 2^16 halved once
    assert _same(runs[name][0]["params"][-1], runs[name][1]["params"][-1])


def test_the_scaler_grows_after_clean_steps_and_shrinks_on_overflow():
    s = LossScaler(True, init_scale=8.0, growth_interval=3)
    for overflow, scale in [(False, 8), (False, 8), (False, 16), (True, 8), (False, 8)]:
        s.update(overflow)
        assert s.scale == scale
    assert s.skipped_steps == 1 and LossScaler(False).scaled(torch.ones(())) == 1
    assert has_nonfinite([torch.ones(3), torch.tensor([1.0, float("nan")])], "cpu").item() == 1
    assert has_nonfinite([torch.ones(3)], "cpu").item() == 0
