"""Peak memory and tokens/s of each memory technique at the 57M-parameter GPT, in one run.

    python -m shardwise.bench.techniques                  # table on stdout, JSON + PNG to a temp dir
    python -m shardwise.bench.techniques --save           # shardwise/bench/results/techniques-57m.{json,png}

Model, world, batch and the memory measurement are shardwise/bench/memory.py's (8 x 768 GPT, 57.2M
parameters, world 2, global batch 4, AdamW, malloc returning freed blocks so that peak RSS tracks
live bytes; ``peak - baseline`` is what the training state cost). Sides, each in its own fresh
forked gloo world: DDP fp32 (the baseline), then each technique alone on DDP (freeze the first
half of the blocks, LoRA rank 8 on every attention and MLP linear, 8-bit AdamW, bf16 autocast,
activation checkpointing, 2 accumulation micro-steps), ZeRO-2 alone, and ZeRO-2 + bf16 +
activation checkpointing + 8-bit AdamW + LoRA together. Tokens/s: median step after one warm-up.
The chart stacks each side's ledger at its peak instant (shardwise/parallel/ledger.py) by
category, with the measured training peak minus baseline beside it. Two peaks are read from
/proc/self/status: VmHWM after ``prepare`` (the peak of building the model and applying the
layout: a side that casts or shards the model can peak here, holding the fp32 model and its new
form at once), then, after resetting VmHWM (``/proc/self/clear_refs``), the training phase's
own peak, which is what the ledger describes.
"""
from __future__ import annotations

import os
import resource
import statistics
import sys

from shardwise.config.names import Strategy
from shardwise.bench.memory import (MODEL, MiB, _rss_now, cli_args, ledger_total,
                               write_results)
from shardwise.run.allocator import track_live_bytes


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Reset this process's peak resident memory (VmHWM) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")

LORA = {"lora_rank": 8, "lora_targets": "*attn.qkv,*attn.proj,*mlp.fc,*mlp.proj"}
SIDES = {
    "ddp (baseline)": (Strategy.DDP, {}, {}),
    "freeze blocks 0-3": (Strategy.DDP,
                          {"freeze": "blocks.0.*,blocks.1.*,blocks.2.*,blocks.3.*"}, {}),
    "LoRA r8": (Strategy.DDP, LORA, {}),
    "8-bit AdamW": (Strategy.DDP, {}, {"optimizer": "adamw8bit"}),
    "bf16": (Strategy.DDP, {"mixed_precision": "bf16"}, {}),
    "activation checkpointing": (Strategy.DDP, {"activation_checkpointing": True}, {}),
    "grad accumulation 2": (Strategy.DDP, {"grad_accum": 2}, {}),
    Strategy.ZERO2: (Strategy.ZERO2, {}, {}),
    "zero2 + bf16 + ckpt + 8-bit + LoRA": (Strategy.ZERO2, {**LORA, "mixed_precision": "bf16",
                                                     "activation_checkpointing": True},
                                           {"optimizer": "adamw8bit"}),
}


def side(rank: int, world: int, name: str, steps: int, batch: int) -> dict:
    track_live_bytes()
    import torch
    from shardwise.bench.harness import gpt_bench_config, threads_for, timed_steps
    from shardwise.data import build_data
    threads_for(world)
    strategy, memory, train = SIDES[name]
    cfg = gpt_bench_config(strategy, model=MODEL, memory=memory,
                           train={"steps": steps, "batch_size": batch, **train})
    data = build_data(cfg)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])   # torch._dynamo: every side pays
    baseline = _rss_now()
    import shardwise
    from shardwise.run.api import optimizer_factory
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    engine = shardwise.prepare(build_model(cfg.model, cfg.train.seed), optimizer_factory(cfg),
                               cfg, loss_fn=loss_for(cfg.model), runtime=init_runtime(cfg))
    build_peak = _status_kib("VmHWM")    # the peak so far: building and preparing the model
    _reset_peak()                         # from here on VmHWM is the training phase's peak
    state = {"step": 0}

    def step():
        x, y = data.batch(state["step"], batch, rank, world)
        state["step"] += 1
        engine.train_step(x, y)
    seconds = timed_steps(step, max(1, steps - 1), warmup=1)
    at_peak = engine.strategy.memory_at_peak()
    engine.close()
    return {"side": name, "baseline": baseline, "build_peak": build_peak,
            "train_peak": _status_kib("VmHWM"),
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "ledger_at_peak": at_peak, "items_per_s": batch * cfg.model.block_size / seconds}


def measure(steps: int, batch: int, reps: int = 1) -> dict:
    """Every side ``reps`` times, in alternated passes (A B C .. A B C: a slow moment of the
    machine hits every side alike). Per side: the pass with the highest peak (memory repeats
    within a few MiB), with ``items_per_s`` replaced by the median of the passes and
    ``items_per_s_runs`` holding every pass's figure (the spread)."""
    from shardwise.launch.world import run_world
    runs: dict[str, list[dict]] = {name: [] for name in SIDES}
    for rep in range(reps):
        for name in SIDES:
            ranks = run_world(side, 2, name, steps, batch, timeout=1800)
            r = max(ranks, key=lambda r: r["peak"])
            runs[name].append(r)
            print(f"[{rep + 1}/{reps}] {name:36s} peak {r['peak'] / MiB:7,.0f} MiB  training "
                  f"{(r['train_peak'] - r['baseline']) / MiB:6,.0f} MiB over baseline  "
                  f"{r['items_per_s']:7,.0f} tok/s", flush=True)
    out = {}
    for name, rs in runs.items():
        rates = sorted(r["items_per_s"] for r in rs)
        out[name] = {**max(rs, key=lambda r: r["peak"]), "items_per_s": statistics.median(rates),
                     "items_per_s_runs": rates}
    return out


def table(res: dict) -> str:
    base = res["ddp (baseline)"]
    lines = ["| side | peak RSS / rank (MiB) | vs DDP | set while building (MiB) | training "
             "peak - baseline (MiB) | ledger at peak (MiB) | at peak / used | tokens/s | vs DDP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res.items():
        train_peak = r.get("train_peak", r["peak"])
        used, led = train_peak - r["baseline"], ledger_total(r["ledger_at_peak"])
        build = r.get("build_peak", 0)
        lines.append(f"| {name} | {r['peak'] / MiB:,.0f} | {r['peak'] / base['peak']:.2f} | "
                     f"{build / MiB:,.0f} | {used / MiB:,.0f} | {led / MiB:,.0f} | {led / used:.2f} | "
                     f"{r['items_per_s']:,.0f}{_spread(r)} | "
                     f"{r['items_per_s'] / base['items_per_s']:.2f} |")
    return "\n".join(lines)


def _spread(r: dict) -> str:
    runs = r.get("items_per_s_runs") or []
    return f" [{runs[0]:,.0f}-{runs[-1]:,.0f}]" if len(runs) > 1 else ""


def chart(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = ["parameters", "gradients", "optimizer_states", "master_weights", "comm_buffers",
            "activations_peak"]
    names = list(res)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    bottom = [0.0] * len(names)
    for cat in cats:
        vals = [res[n]["ledger_at_peak"].get(cat, 0) / MiB for n in names]
        ax.bar([i - 0.18 for i in range(len(names))], vals, 0.36, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([i + 0.18 for i in range(len(names))],
           [(res[n].get("train_peak", res[n]["peak"]) - res[n]["baseline"]) / MiB for n in names],
           0.36, color="0.35", label="measured training peak - baseline")
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title("57M GPT, world 2: ledger at the peak instant (stacked) vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = cli_args("python -m shardwise.bench.techniques", __doc__, argv)
    from shardwise.bench.run import results_dir
    res = measure(args.steps, args.batch, args.reps)
    print(table(res))
    out_dir = results_dir(args)
    chart(res, os.path.join(out_dir, "techniques-57m.png"))
    write_results(out_dir, "techniques-57m", args, res, table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
