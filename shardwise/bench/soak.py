"""Soak: resident memory per rank over a long run of ddp and of the parameter server (sync), to
show that nothing grows step by step (no leak in the buckets, the ps messages, the meters).

    python -m shardwise.bench.soak                          # 3,000 steps each, world 3
    python -m shardwise.bench.soak --steps 600 --every 50   # a quick look
    python -m shardwise.bench.soak --save                   # shardwise/bench/results/soak-w3.json

Each side runs in its own forked gloo world of 3 (shardwise.launch.world.run_world): ddp over 3
replicas; ps with one ps task and two workers. The model is tiny_config's GPT (2 layers, width
32, seq 16, vocabulary 67) with AdamW, global batch 12, the engine's own ``train_step`` called
``--steps`` times with no checkpoints, evaluation or logging (the loop's own growth, metrics
and log lines, is not what is measured).

Every ``--every`` steps each rank samples its resident set (``VmRSS`` of /proc/self/status)
and its peak so far (``VmHWM``). Each process first sets ``mallopt(M_MMAP_THRESHOLD, 131072)``
(bench/memory.py says why: RSS then tracks live bytes instead of glibc's cache). Warm-up is
the first ``--warmup`` steps (first-touch of thread pools, code pages, the allocator's arenas);
growth is the least-squares slope of RSS over the samples after it, and the peak's rise from
the end of warm-up to the end, both in MiB per 1,000 steps, per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from shardwise.config.names import Strategy

MiB = 2 ** 20
SIDES = {Strategy.DDP: {}, Strategy.PS: {"num_ps": 1, "ps_mode": "sync"}}
HERE = os.path.dirname(os.path.abspath(__file__))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _config(side: str, steps: int):
    from shardwise.config import (Config, DataConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, TrainConfig)
    return Config(
        model=ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=67),
        data=DataConfig(dataset="synthetic"),
        parallel=ParallelConfig(strategy=side, **SIDES[side]),
        train=TrainConfig(steps=steps, batch_size=12, lr=1e-3, warmup_steps=10, eval_every=0,
                          eval_batches=1, device="cpu", optimizer="adamw"),
        logging=LoggingConfig(progress=False, out_dir="/tmp/shardwise-soak", schedule_png="off"))


def _rank(rank: int, world: int, side: str, steps: int, every: int) -> dict:
    """One rank of one side: train ``steps`` steps, sampling (step, rss, hwm) in KiB."""
    from shardwise.run.allocator import track_live_bytes
    track_live_bytes()                                    # M_MMAP_THRESHOLD (docstring)
    from shardwise.run.api import optimizer_factory, prepare
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    cfg = _config(side, steps)
    rt = init_runtime(cfg)
    data = build_data(cfg)
    engine = prepare(build_model(cfg.model, cfg.train.seed), optimizer_factory(cfg), cfg,
                     loss_fn=loss_for(cfg.model), runtime=rt)
    index, count = engine.strategy.data_shard()
    samples, began = [], time.perf_counter()
    for step in range(steps):
        x, y = data.batch(step, cfg.train.batch_size, index, count)
        engine.train_step(x, y)
        if (step + 1) % every == 0:
            samples.append((step + 1, _status_kib("VmRSS"), _status_kib("VmHWM")))
            if rank == 0 and (step + 1) % (10 * every) == 0:
                print(f"  {side} step {step + 1}: rank 0 RSS {samples[-1][1] / 1024:.1f} MiB",
                      flush=True)
    seconds = time.perf_counter() - began
    engine.close()
    return {"samples": samples, "seconds": seconds,
            "role": getattr(engine.strategy, "task", f"replica {rank}")}


def growth(samples: list, warmup: int) -> dict:
    """MiB per 1,000 steps after warm-up: RSS's least-squares slope, the peak's rise."""
    after = [s for s in samples if s[0] >= warmup]
    if len(after) < 2:
        raise ValueError(f"fewer than 2 samples after the warm-up of {warmup} steps")
    xs, rss = [s[0] for s in after], [s[1] / 1024 for s in after]
    mx, my = sum(xs) / len(xs), sum(rss) / len(rss)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, rss)) / sum((x - mx) ** 2 for x in xs)
    span = (after[-1][0] - after[0][0]) / 1000
    return {"rss_slope_mib_per_1k": slope * 1000,
            "peak_rise_mib_per_1k": (after[-1][2] - after[0][2]) / 1024 / span,
            "rss_at_warmup_mib": after[0][1] / 1024, "rss_end_mib": after[-1][1] / 1024,
            "peak_end_mib": after[-1][2] / 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=100, help="sample RSS every N steps")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--sides", default="ddp,ps")
    ap.add_argument("--save", action="store_true", help="write bench/results/soak-w<world>.json")
    args = ap.parse_args(argv)
    if not 0 < args.every <= args.warmup < args.steps:
        print("error: need 0 < --every <= --warmup < --steps", file=sys.stderr)
        return 2
    from shardwise.bench.run import machine
    from shardwise.launch.world import run_world
    out = {"machine": machine(), "steps": args.steps, "every": args.every, "warmup": args.warmup,
           "world": args.world, "load": os.getloadavg(), "sides": {}}
    for side in args.sides.split(","):
        ranks = run_world(_rank, args.world, side, args.steps, args.every,
                          timeout=max(600.0, args.steps * 0.5))
        out["sides"][side] = [{**r, **growth(r["samples"], args.warmup)} for r in ranks]
        for rank, r in enumerate(out["sides"][side]):
            print(f"{side:4s} rank {rank} ({r['role']}): RSS {r['rss_at_warmup_mib']:.1f} -> "
                  f"{r['rss_end_mib']:.1f} MiB (slope {r['rss_slope_mib_per_1k']:+.2f} MiB per "
                  f"1k steps), peak {r['peak_end_mib']:.1f} MiB (rise "
                  f"{r['peak_rise_mib_per_1k']:+.2f} MiB per 1k steps), {r['seconds']:.0f} s",
                  flush=True)
    path = os.path.join(HERE, "results", f"soak-w{args.world}.json") if args.save else \
        os.path.join("/tmp", f"soak-w{args.world}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"curves: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
