"""Single-process DP (k replicas driven by threads) equals single-process training.

Tolerance: fp32 rtol 1e-5 — the replicas' gradients are summed in another order than the single
model's backward sums its rows.
"""
from dataclasses import replace

import pytest

from harness import assert_close_runs
from reference import ATOL, RTOL, run, single_run, tiny_config
from shardwise.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainConfig

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("replicas", [2, 4])
def test_dp_equals_single(replicas):
    cfg = tiny_config("dp", steps=20, replicas=replicas)
    losses, params = run(cfg)
    expected = single_run(cfg)
    assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL,
                      why="fp32, gradients summed across replicas in another order")


def test_dp_with_accumulation_equals_single():
    cfg = tiny_config("dp", steps=5, replicas=2)
    cfg = replace(cfg, memory=replace(cfg.memory, grad_accum=2))
    losses, params = run(cfg)
    expected = single_run(replace(cfg, memory=replace(cfg.memory, grad_accum=1)))
    assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why="fp32 reordering")


def _lenet(strategy, replicas):
    return Config(model=ModelConfig(name="lenet"), data=DataConfig(dataset="digits"),
                  parallel=ParallelConfig(strategy=strategy, replicas=replicas),
                  train=TrainConfig(steps=120, batch_size=64, lr=0.2, optimizer="sgd",
                                    warmup_steps=0, lr_schedule="constant", eval_every=0,
                                    eval_batches=6, device="cpu"),
                  logging=LoggingConfig(progress=False, out_dir="/tmp/shardwise-test-runs"))


def test_d2l_lenet_one_and_two_replicas_reach_the_same_accuracy():
    """d2l's multi-GPU experiment on scikit-learn's digits: same batch and learning rate,
    1 vs 2 GPUs."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    acc = {}
    for k in (1, 2):
        cfg = _lenet("single" if k == 1 else "dp", k)
        acc[k] = train(cfg, init_runtime(cfg), quiet=True)["val_accuracy"]
    assert acc[1] > 0.9, acc           # it really learned
    assert abs(acc[1] - acc[2]) <= 0.01, acc
