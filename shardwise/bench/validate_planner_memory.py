"""The planner's predicted memory against the measured peak resident memory, per strategy, at 57M.

    python -m shardwise.bench.validate_planner_memory [--steps 4] [--only ddp,zero3] [--save]

shardwise/bench/validate_planner.py checks the planner against each strategy's own ledger (its
count of its own bytes), which agrees with the formulas by construction. This checks it against
what the operating system saw: every strategy of ``validate_planner.CASES`` (same worlds, same
parallel settings, the pipeline's micro-batch count set so that the run's micro-batch is the
layout's) trains shardwise's GPT at the size of shardwise/bench/memory.py (8 layers x 768, 12
heads, seq 128, byte vocabulary: 57.0M parameters, fp32 AdamW) at global batch 4, so model
states dominate, for a few steps in a fresh forked gloo world.

Measuring (as shardwise/bench/memory.py): each rank first sets ``mallopt(M_MMAP_THRESHOLD,
131072)`` (``MALLOC_MMAP_THRESHOLD_=131072``: freed blocks of 128 KiB or more go back to the OS,
so resident memory tracks live bytes); ``baseline`` is its resident memory after torch, the
process group, the data and a first torch.optim optimizer, before the model is built; ``peak``
is ``ru_maxrss`` at the end. The model is built and handed to ``shardwise.prepare`` as
``shardwise.run.train.train`` does, then the loop's steps run (``engine.train_step``; no evaluation
and no final gather of the weights, which are not training state). ``used = peak - baseline``.

Compared: the planner's fullest device (``Estimate.memory_role``) with the fullest measured rank
playing that role (``validate_planner._same_role``), on this machine's committed calibration
(shardwise/bench/results/planner_validation.json; memory depends on it only through the
capacity and the backend's collective copies, ``Hardware.collective_copies``). Predicted figures: ``memory_total`` (every category's own high-water mark added up)
and ``memory_peak`` (the peak instant, shardwise/planner/memory.py); shardwise's GPT uses
``F.scaled_dot_product_attention``, so the spec says ``fused_attention=True``. ``dp`` runs R
replicas in one process, each on its own thread at once: R whole devices of batch / R. Goal
(issue 17): ``|memory_peak - used| / used <= 10%`` per strategy.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import replace

from shardwise.config.names import Axis, Strategy
from shardwise.bench.memory import MODEL, MiB, _rss_now
from shardwise.run.allocator import track_live_bytes
from shardwise.bench.validate_planner import CASES, RESULTS, _gap, _pct, _same_role, write_results

GOAL = 0.10
BATCH = 4                  # global batch (sequences): model states dominate at 57M
MICROBATCHES = {Strategy.PP: 2, Strategy.THREE_D: 2}      # pipeline micro-batches per step (mb 2 and 1)
SHOWN = ("parameters", "gradients", "optimizer_states", "master_weights", "activations",
         "buffers")


def case(name: str, batch: int = BATCH):
    """(world, parallel overrides, the planner's Layout) of ``name`` at global ``batch``: the
    overrides of ``validate_planner.CASES``, the layout's micro-batch that of the run (batch /
    (replicas x micro-batches); ``dp``'s layout is one replica's)."""
    world, par, layout = CASES[name]
    par = dict(par)
    if name in MICROBATCHES:
        par["num_microbatches"] = MICROBATCHES[name]
    rows = batch // max(layout.dp, par.get("replicas", 1))
    return world, par, replace(layout, micro_batch=max(1, rows // par.get("num_microbatches", 1)))


def config(name: str, steps: int, batch: int = BATCH):
    from shardwise.bench.harness import gpt_bench_config
    world, par, _ = case(name, batch)
    return gpt_bench_config(name, model=MODEL, parallel=par,
                            train={"steps": steps, "batch_size": batch, "eval_every": 0})


def _rank(rank: int, world: int, cfg) -> dict:
    """One rank: baseline, train ``cfg.train.steps`` steps, peak RSS, ledger, role."""
    track_live_bytes()                       # first thing: before any large allocation
    import torch
    import shardwise
    from shardwise.run.api import optimizer_factory
    from shardwise.bench.harness import threads_for
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import lr_at
    threads_for(world)
    rt = init_runtime(cfg)
    data = build_data(cfg)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])   # imports torch._dynamo (~74 MiB)
    baseline = _rss_now()
    model = build_model(cfg.model, cfg.train.seed)
    engine = shardwise.prepare(model, optimizer_factory(cfg), cfg, loss_fn=loss_for(cfg.model),
                               runtime=rt)
    del model                                 # train() keeps no other reference either
    index, count = engine.strategy.data_shard()
    for step in range(cfg.train.steps):
        engine.strategy.set_lr(lr_at(step, cfg))
        x, y = data.batch(step, cfg.train.batch_size, index, count)
        engine.train_step(x, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ledger = {k: int(v) for k, v in engine.strategy.memory_ledger().items()}
    at_peak = engine.strategy.memory_at_peak()
    engine.close()
    return {"rank": rank, "baseline": baseline, "peak": peak, "used": peak - baseline,
            "ledger": ledger, "ledger_at_peak": {k: int(v) for k, v in at_peak.items()},
            "pp_rank": rt.mesh.pp_rank, "last_stage": rt.mesh.is_last_stage,
            "server": "replica_for_gather" in ledger}


def hardware(world: int, path: str = os.path.join(RESULTS, "planner_validation.json")):
    """This machine's committed calibration for ``world`` processes (planner Hardware)."""
    from shardwise.planner import Hardware
    with open(path) as fh:
        cal = json.load(fh)["calibration"]
    return Hardware(**cal[str(world) if str(world) in cal else sorted(cal)[-1]]["hardware"])


def predicted(name: str, cfg, layout, hw) -> dict:
    """The planner's fullest device: role, categories, their sum and the peak instant (bytes)."""
    from shardwise.launch import auto as autoplan
    from shardwise.planner import estimate
    from shardwise.planner.memory import memory
    spec = autoplan.model_spec(cfg)          # fused attention: models/gpt.py uses SDPA
    batch = autoplan.batch_of(cfg)
    copies = cfg.parallel.replicas if name == Strategy.DP else 1     # dp: R whole replicas, at once
    batch = replace(batch, global_batch=max(1, batch.global_batch // copies))   # one replica's
    e = estimate(layout, spec, hw, batch)
    mem = memory(layout, spec, hw, batch)
    return {"role": e.memory_role, "categories": {k: v * copies for k, v in e.memory.items()},
            "total": e.memory_total * copies, "peak": mem.peak * copies}


def compare(name: str, pred: dict, ranks: list[dict]) -> dict:
    """The fullest measured rank in the planner's role against the prediction."""
    mine = _same_role(ranks, pred["role"])
    worst = max(mine, key=lambda r: r["used"])
    at = worst.get("ledger_at_peak") or {}
    at_sum = sum(v for k, v in at.items() if k not in ("on_disk", "replica_for_gather"))
    gap = _gap(pred["peak"], worst["used"])
    return {"strategy": name, "role": pred["role"], "rank": worst["rank"],
            "predicted": pred, "measured_used": worst["used"], "baseline": worst["baseline"],
            "peak": worst["peak"], "used_per_rank": [r["used"] for r in ranks],
            "ledger_at_peak": at_sum or None, "ledger": worst["ledger"],
            "gap_peak": gap, "gap_total": _gap(pred["total"], worst["used"]),
            "goal_met": gap is not None and abs(gap) <= GOAL}


def validate_one(name: str, steps: int, batch: int = BATCH) -> dict:
    from shardwise.launch.world import run_world
    world, _, layout = case(name, batch)
    cfg = config(name, steps, batch)
    pred = predicted(name, cfg, layout, hardware(world))
    t0 = time.perf_counter()
    ranks = run_world(_rank, world, cfg, timeout=900)
    row = compare(name, pred, ranks)
    return {**row, "world": world, "layout": layout.describe(),
            "run_seconds": time.perf_counter() - t0}


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:,.0f}"


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["| strategy | world | layout | role (rank) | predicted peak (MiB) | predicted sum "
           "(MiB) | measured peak - baseline (MiB) | ledger at peak (MiB) | gap (peak) | "
           "gap (sum) | within 10% |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['strategy']} | - | - | - | - | - | - | - | - | - | failed: "
                       f"{r['error'][:80]} |")
            continue
        p = r["predicted"]
        out.append(f"| {r['strategy']} | {r['world']} | {r['layout']} | {p['role']} "
                   f"({r['rank']}) | {_mib(p['peak'])} | {_mib(p['total'])} | "
                   f"{_mib(r['measured_used'])} | {_mib(r['ledger_at_peak'])} | "
                   f"{_pct(r['gap_peak'])} | {_pct(r['gap_total'])} | "
                   f"{'yes' if r['goal_met'] else 'no'} |")
    out += ["", "Predicted categories on the fullest device (MiB; each its own high-water mark):",
            "", "| strategy | " + " | ".join(SHOWN) + " |", "|---|" + "---:|" * len(SHOWN)]
    for r in rows:
        if "error" not in r:
            cats = r["predicted"]["categories"]
            out.append(f"| {r['strategy']} | " + " | ".join(_mib(cats[k]) for k in SHOWN) + " |")
    out += ["", f"Model {meta['model']}, global batch {meta['batch']}, {meta['steps']} steps, "
            f"fp32 AdamW; `MALLOC_MMAP_THRESHOLD_=131072` in every rank; load average "
            f"{meta['load'][0]:.1f} on {os.cpu_count()} cores."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from shardwise.parallel import available
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.validate_planner_memory",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (sequences)")
    ap.add_argument("--only", default="", help="comma-separated strategies (default: all)")
    ap.add_argument("--save", action="store_true",
                    help="write shardwise/bench/results/planner_memory_validation.{json,md}")
    args = ap.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else CASES) if n in available()]
    rows = []
    for name in names:
        try:
            row = validate_one(name, args.steps, args.batch)
        except Exception as exc:  # record it, keep going
            text = str(exc).strip()
            row = {"strategy": name, "error": f"{type(exc).__name__}: "
                   f"{text.splitlines()[-1] if text else ''}"}
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("strategy", "role", "measured_used",
                                                  "gap_peak", "gap_total", "error")},
                         default=str), flush=True)
    meta = {"model": MODEL, "batch": args.batch, "steps": args.steps, "load": os.getloadavg(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    table = markdown(rows, meta)
    write_results(args.save, "planner_memory_validation",
                  {**meta, "goal": GOAL, "rows": rows, "table": table}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
