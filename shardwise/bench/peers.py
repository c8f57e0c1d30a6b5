"""Plain-PyTorch training steps on shardwise's benchmark GPT: the peers our strategies race.

Each returns the world's tokens/s (median step after warm-up) for the same model, data and
optimizer as ``gpt_bench_config``, so the only difference from our side is the strategy.
"""
from __future__ import annotations

import statistics
import time

import torch

from shardwise.bench.harness import discard_run, parameters, sized_config, threads_for, timed_steps
from shardwise.data import build_data
from shardwise.models import build_model, lm_loss


def _setup(cfg, rank: int, world: int):
    threads_for(world)
    data = build_data(cfg)
    model = build_model(cfg.model, cfg.train.seed)
    return data, model


def plain_loop_tokens_per_s(cfg, rank: int, world: int, wrap=None, steps: int = 10,
                            torch_defaults: bool = False, timings: dict | None = None) -> float:
    """A textbook loop (forward, loss, backward, AdamW step, zero_grad) around ``wrap(model)``;
    ``torch_defaults``: ``torch.optim.AdamW(params, lr)`` as a user writes it (torch's own
    betas, weight decay and implementation: a loop over tensors on CPU) instead of ours.
    ``timings``: filled with the median seconds of a step and of its optimizer step (the
    optimizer's share of the step, which the product row's goal reads)."""
    data, model = _setup(cfg, rank, world)
    if wrap is not None:
        model = wrap(model)
    opt = (torch.optim.AdamW(model.parameters(), lr=cfg.train.lr) if torch_defaults
           else same_optimizer(cfg, model.parameters()))
    state = {"step": 0}
    b = cfg.train.batch_size
    optimizer_s = []

    def step():
        x, y = data.batch(state["step"], b, rank, world)
        state["step"] += 1
        loss = lm_loss(model(x), y)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        optimizer_s.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, steps)
    if timings is not None:
        timings.update(step_s=dt, optimizer_step_s=statistics.median(optimizer_s[-steps:]))
        if torch_defaults:      # what ours steps instead, on the same model and gradients
            x, y = data.batch(state["step"], b, rank, world)
            lm_loss(model(x), y).backward()
            # after two warm-up steps, the first of which allocates the optimizer's states
            timings["ours_optimizer_step_s"] = timed_steps(
                same_optimizer(cfg, model.parameters()).step, 5, warmup=2)
    return b * cfg.model.block_size / dt


def step_ceiling(step_s: float, optimizer_s: float, replacement_s: float) -> dict:
    """What replacing a loop's optimizer step (``optimizer_s`` of its ``step_s``) by one taking
    ``replacement_s``, and changing nothing else, can give: ``ceiling``, the loop's speed-up
    ``step_s / (step_s - optimizer_s + replacement_s)``; ``goal``, the product row's ``1 +
    share``; ``replacement_limit_s``, the longest the replacement may take for the ceiling to
    reach that goal: ``optimizer_s * share / (1 + share)``, a fraction ``share / (1 + share)`` of
    the step it replaces."""
    share = optimizer_s / step_s
    return {"ceiling": step_s / (step_s - optimizer_s + replacement_s), "goal": 1 + share,
            "replacement_limit_s": optimizer_s * share / (1 + share)}


def torch_ddp_tokens_per_s(cfg, rank: int, world: int, bucket_mb: float = 25.0,
                           steps: int = 10) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    return plain_loop_tokens_per_s(cfg, rank, world, wrap=lambda m: DDP(m, bucket_cap_mb=bucket_mb),
                                   steps=steps)


def ours_tokens_per_s(cfg, world: int) -> dict:
    """Run shardwise's own loop on cfg in the current world; its figures (the run's folder is
    removed: harness.discard_run)."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    threads_for(world)
    rt = init_runtime(cfg)
    s = train(cfg, rt, quiet=True)
    discard_run(s, rt)
    steps = s["steps"]
    extra = {"ledger": s["ledger"], "comm": s["comm"]}
    if s.get("compile_seconds") is not None:    # --compile: the first step's compilation
        extra["compile_seconds"] = s["compile_seconds"]
    return {"items_per_s": s["throughput"], "bytes_sent": rt.comm.meter.total().bytes_sent / steps,
            "peak_mem": sum(s["ledger"].values()), "extra": extra}


def ours_sized(strategy: str, size: str, steps: int, world: int, **parallel) -> dict:
    """shardwise's own loop for ``strategy`` at one of the scaling family's sizes
    (harness.SIZES), with the model's parameter count in ``extra`` (the sizes chart's x)."""
    cfg = sized_config(strategy, size, steps, **parallel)
    out = ours_tokens_per_s(cfg, world)
    out["extra"]["parameters"] = parameters(cfg)
    return out


def same_optimizer(cfg, params):
    """The optimizer shardwise's side of a row runs (run/api.optimizer_factory: AdamW with the
    config's lr, betas, weight decay and train.optimizer_kernel), for a PyTorch peer: a row
    compares the strategies, not two implementations of the optimizer step."""
    from shardwise.run.api import optimizer_factory
    return optimizer_factory(cfg)(list(params))
