"""The error gradient compression introduces: DDP at world 2 with fp32, bf16 and fp16 allreduce.

    python -m shardwise.bench.compression_error [--steps 20]

Prints, for each compressed run against the fp32 run of the same config, the largest relative
loss difference over the steps and the relative L2 distance of the final parameters.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from shardwise.config.names import Strategy
from shardwise.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.run.runtime import init_runtime
from shardwise.bench.harness import discard_run
from shardwise.launch.world import run_world
from shardwise.run.train import train


def _config(steps: int) -> Config:
    return Config(model=ModelConfig(n_layer=2, n_embd=64, n_head=4, block_size=32),
                  data=DataConfig(dataset="stdlib", max_bytes=500_000),
                  parallel=ParallelConfig(strategy=Strategy.DDP),
                  train=TrainConfig(steps=steps, batch_size=16, eval_every=0, eval_batches=1,
                                    device="cpu"),
                  logging=LoggingConfig(progress=False, out_dir="/tmp/shardwise-bench-runs"))


def _runs(rank, world, steps):
    out = {}
    for c in ("none", "bf16", "fp16"):
        cfg = _config(steps)
        cfg = replace(cfg, parallel=replace(cfg.parallel, grad_compression=c))
        rt = init_runtime(cfg)
        s = train(cfg, rt, quiet=True)
        out[c] = (s["losses"], s["engine"].full_state_dict())
        discard_run(s, rt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    steps = ap.parse_args().steps
    res = run_world(_runs, 2, steps, timeout=600)[0]
    base_losses, base = res["none"]
    for c in ("bf16", "fp16"):
        losses, params = res[c]
        rel = max(abs(a - b) / b for a, b in zip(losses, base_losses))
        num = sum(float(((params[k] - base[k]) ** 2).sum()) for k in base) ** 0.5
        den = sum(float((base[k] ** 2).sum()) for k in base) ** 0.5
        print(f"{c}: final loss {losses[-1]:.4f} vs fp32 {base_losses[-1]:.4f}; largest relative "
              f"loss difference over {steps} steps {rel:.2e}; parameters' relative L2 distance "
              f"{num / den:.2e}")


if __name__ == "__main__":
    main()
