"""Reference runs: the `single` strategy's losses and final parameters for a config.

Equivalence tests train the same config under a strategy in a world of N and compare with
``single_run(cfg)``, computed in the test process itself (world of one).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from shardwise.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train


def tiny_config(strategy: str = "single", steps: int = 10, **parallel) -> Config:
    """A GPT small enough for many equivalence runs on 2 cores (2 layers, width 32, seq 16).

    The vocabulary (67) makes the embedding and head sizes indivisible by 2, 3 or 4 ranks; the
    other tensors divide evenly, so tests of padding in sharded strategies narrow the width
    (test_zero.py uses width 27 with 3 heads).
    """
    return Config(
        model=ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=67),
        data=DataConfig(dataset="synthetic"),
        parallel=ParallelConfig(strategy=strategy, **parallel),
        train=TrainConfig(steps=steps, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=0,
                          eval_batches=1, device="cpu"),
        logging=LoggingConfig(progress=False, out_dir="/tmp/shardwise-test-runs"),
    )


def run(cfg: Config) -> tuple[list[float], dict]:
    """Train cfg in the current world (quietly); return (losses, full parameters)."""
    summary = train(cfg, init_runtime(cfg), quiet=True)
    engine = summary["engine"]
    try:
        return summary["losses"], engine.full_state_dict()
    finally:          # its threads (dp's replicas, offload writers) must not outlive the test:
        engine.close()   # run_world forks this process later, and a fork copies no thread



def single_run(cfg: Config) -> tuple[list[float], dict]:
    """The same config under the single strategy, in this process."""
    return run(replace(cfg, parallel=replace(cfg.parallel, strategy="single", dp=0, tp=1, pp=1,
                                             cp=1, cp_impl="ring")))

# Tolerances for fp32 equivalence under Adam, and why:
# RTOL 1e-5: strategies sum the same gradients in another order (ranks, buckets, replicas), which
#   changes the last bits of fp32 sums; after 10-20 steps that stays within ~100 ulps.
# ATOL 1e-5: Adam divides each gradient element by its own running RMS, so an element whose
#   gradient is near zero turns reordering noise into an update of up to lr; 1e-5 is 0.1% of one
#   step at tiny_config's lr 1e-2 — any real error (a wrong shard, a missing average) is >= 1e-3.
RTOL, ATOL = 1e-5, 1e-5


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def assert_overflow_step_skipped(r: dict, inject: int) -> None:
    """An fp16 run whose gradient was poisoned at step ``inject``: ``r["params"]`` holds the
    parameters after every step. That step left them bit-identical, the clean steps around it
    moved them, and everything stayed finite."""
    p = r["params"]
    assert _same(p[inject - 1], p[inject])                   # the poisoned step: skipped
    assert not _same(p[inject - 2], p[inject - 1])           # a clean step moved them
    assert not _same(p[inject], p[inject + 1])               # and training goes on
    assert all(torch.isfinite(t).all() for t in p[-1].values())
    assert all(torch.isfinite(torch.tensor(r["losses"])))
