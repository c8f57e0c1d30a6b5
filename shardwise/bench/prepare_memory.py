"""Peak resident memory of ``prepare`` (before the first step): meta-device init against the
eager build, for ZeRO-3, tp 2 and pp 2 at world 2 (issue 30 item 1).

    MALLOC_MMAP_THRESHOLD_=131072 python -m shardwise.bench.prepare_memory       # JSON to a temp folder
    python -m shardwise.bench.prepare_memory --out DIR --layouts zero3,tp2

The model is shardwise/bench/memory.py's GPT (8 x 768, 12 heads, seq 128, byte vocabulary: 57.0M
parameters, 228 MB in fp32). Each (layout, init) runs in its own fresh forked gloo world of 2.
Per rank: ``baseline`` is the resident memory once torch is imported, the process group is up
and a first torch.optim optimizer has been built (it imports torch._dynamo, which every side
pays), before the model exists; then the peak is reset (``/proc/self/clear_refs``, so the peak
is this phase's: ``VmHWM``), the model is built (``--init meta`` or ``eager``) and prepared;
``peak`` is VmHWM after ``prepare``. Each process sets ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``
as bench/memory.py does, so freed blocks go back to the OS and RSS tracks live bytes.

The bound the meta path must meet (within 10%): ``baseline + full / N + unit``, with ``full``
the model's fp32 bytes, N = 2 and ``unit`` the largest init unit (one block: models/init.py);
``kept`` is what the rank holds after prepare (its local parameters and buffers, each storage
once). The eager path is measured beside it for contrast: every rank builds the whole model.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from shardwise.config.names import Axis, Strategy
from shardwise.bench.memory import MODEL, MiB, _rss_now
from shardwise.run.allocator import track_live_bytes

LAYOUTS = {Strategy.ZERO3: {"strategy": Strategy.ZERO3},
           "tp2": {"strategy": Strategy.TP, Axis.TP: 2},
           "pp2": {"strategy": Strategy.PP, Axis.PP: 2}}


def _peak_reset() -> None:
    """Reset this process's resident high-water mark to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _kept(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters and buffers, each storage counted once (ZeRO-3's freed
    whole units count 0; its shards are in the strategy's chunks, counted by the caller)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def rank_run(rank: int, world: int, layout: str, init: str) -> dict:
    """Build and prepare the 57M GPT under ``layout`` with ``init``; this rank's memory."""
    track_live_bytes()
    from shardwise.bench.harness import gpt_bench_config, threads_for
    from shardwise.models import build_model, lm_loss
    from shardwise.models.init import init_units
    from shardwise.run.api import optimizer_factory, prepare
    from shardwise.run.runtime import init_runtime
    threads_for(world)
    cfg = gpt_bench_config(LAYOUTS[layout]["strategy"], model={**MODEL, "init": init},
                           parallel=LAYOUTS[layout])
    rt = init_runtime(cfg)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])   # torch._dynamo, as bench/memory.py
    baseline = _rss_now()
    _peak_reset()
    model = build_model(cfg.model, cfg.train.seed, init=init)
    engine = prepare(model, optimizer_factory(cfg), cfg, loss_fn=lm_loss, runtime=rt)
    peak = _hwm()
    shards = sum(c.shard.untyped_storage().nbytes() for c in getattr(engine.strategy, "chunks", []))
    shape = build_model(cfg.model, cfg.train.seed, init="meta")
    full = sum(p.numel() * p.element_size() for p in shape.parameters())
    unit = max(sum(t.numel() * t.element_size() for t in u.module.parameters())
               for u in init_units(shape))
    out = {"rank": rank, "baseline": baseline, "peak": peak, "full": full, "unit": unit,
           "kept": _kept(engine.model) + shards,
           "sent_at_start": {k: s["bytes_sent"] for k, s in rt.comm.meter.snapshot().items()
                             if s["calls"]}}
    engine.close()
    return out


def measure(layouts: list[str], world: int = 2) -> dict:
    from shardwise.launch.world import run_world
    out = {}
    for layout in layouts:
        for init in ("meta", "eager"):
            ranks = run_world(rank_run, world, layout, init, timeout=900)
            worst = max(ranks, key=lambda r: r["peak"] - r["baseline"])
            bound = worst["baseline"] + worst["full"] / world + worst["unit"]
            out[f"{layout}/{init}"] = {**worst, "ranks": ranks, "bound": bound,
                                       "peak_over_bound": worst["peak"] / bound}
            print(f"{layout:6s} {init:5s} peak {worst['peak'] / MiB:7,.0f} MiB  baseline "
                  f"{worst['baseline'] / MiB:5,.0f}  bound {bound / MiB:6,.0f}  peak/bound "
                  f"{worst['peak'] / bound:5.2f}  kept {worst['kept'] / MiB:5,.0f}", flush=True)
    return out


def main(argv=None) -> None:
    from shardwise.bench.run import machine
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = {"machine": machine(), "model": MODEL, "world": 2,
           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
           "results": measure([s for s in args.layouts.split(",") if s])}
    folder = args.out or tempfile.mkdtemp(prefix="shardwise-prepare-memory-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "prepare-memory-57m.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(path)


if __name__ == "__main__":
    main()
