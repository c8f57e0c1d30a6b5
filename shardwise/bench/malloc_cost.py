"""What ``MALLOC_MMAP_THRESHOLD_=131072`` costs a training step: why speed is measured without it.

    python -m shardwise.bench.malloc_cost [--size 57m] [--rounds 3] [--steps 8] [--save]

The memory measurements set it (freed blocks of 128 KiB or more go back to the OS, so peak RSS
follows live bytes: shardwise/bench/memory.py). The price is that every large tensor a step
allocates is a fresh mapping whose pages the kernel faults in and zeroes on first touch, every
step. This runs ``shardwise train``'s ``single`` step (``shardwise.prepare``, ``train_step``) on
the scaling family's GPT at ``--size`` in fresh processes, three sides alternated ``--rounds``
times (A B C A B C), fp32 and bf16 autocast: ``with`` the variable, ``without`` it (glibc as it
is: ``--cpu-allocator system``), and ``cache`` (``--cpu-allocator cache``, what ``auto``
chooses on a CPU: run/allocator.py keeps freed blocks under 256 MiB in the heap for the next
step). Each run records its median step (after two untimed ones), the minor page faults of its
last step and of its timed step with the fewest (``getrusage``: without the variable the heap may
still grow in a step), and its peak RSS (``ru_maxrss``). Writes ``malloc-cost-<size>.json``
(``--save``: into shardwise/bench/results/).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from shardwise.bench.harness import result_path, script_parser
from shardwise.config.names import Strategy

THRESHOLD = "131072"
PRECISIONS = ("no", "bf16")


def _run(size: str, steps: int, precision: str, allocator: str = "system") -> dict:
    """In this process: the median seconds of a timed step, the minor faults of the last step
    (``faults_last_step``) and of the timed step with the fewest (``faults_fewest_step``: without
    the variable the last step may still grow the heap)."""
    import resource
    import time
    from dataclasses import replace

    import shardwise
    from shardwise.bench.harness import sized_config, threads_for
    from shardwise.data import build_data
    from shardwise.models import build_model, lm_loss
    from shardwise.run.api import optimizer_factory
    threads_for(1)
    cfg = sized_config(Strategy.SINGLE, size, steps)
    cfg = replace(cfg, memory=replace(cfg.memory, mixed_precision=precision),
                  train=replace(cfg.train, cpu_allocator=allocator))
    data = build_data(cfg)
    engine = shardwise.prepare(build_model(cfg.model, cfg.train.seed), optimizer_factory(cfg),
                               cfg, loss_fn=lm_loss)
    times, faults = [], []
    for i in range(steps + 2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        engine.train_step(*data.batch(i, cfg.train.batch_size, 0, 1))
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    heap = engine.runtime.allocator
    engine.close()
    return {"step_s": statistics.median(times[2:]), "faults_last_step": faults[-1],
            "faults_fewest_step": min(faults[2:]), "cpu_allocator": heap,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


SIDES = {"with": "system", "without": "system", "cache": "cache"}   # side: train.cpu_allocator


def _in_process(size: str, steps: int, precision: str, side: str) -> dict:
    """One run in a fresh process: ``with`` the variable, ``without`` it (glibc as it is), or
    ``cache`` (train.cpu_allocator cache, shardwise's default on a CPU: run/allocator.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if side == "with":
        env["MALLOC_MMAP_THRESHOLD_"] = THRESHOLD
    code = ("import json, sys; from shardwise.bench.malloc_cost import _run; "
            f"print(json.dumps(_run({size!r}, {steps}, {precision!r}, {SIDES[side]!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"malloc_cost: the run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(size: str, rounds: int, steps: int) -> dict:
    """Both precisions, with and without the variable, alternated ``rounds`` times."""
    out = {}
    for precision in PRECISIONS:
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for i in range(rounds):
            for side in SIDES:
                print(f"{precision}: round {i + 1}/{rounds}, {side}", file=sys.stderr, flush=True)
                runs[side].append(_in_process(size, steps, precision, side))
        med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                      if k != "cpu_allocator"} for side, rs in runs.items()}
        out[precision] = {"runs": runs, **med,
                          "slowdown": med["with"]["step_s"] / med["without"]["step_s"],
                          "cache_speedup": med["without"]["step_s"] / med["cache"]["step_s"],
                          "cache_peak_rss_ratio": med["cache"]["peak_rss"] /
                          med["without"]["peak_rss"]}
    return out


NAMES = {"without": "glibc as it is (--cpu-allocator system)",
         "cache": "--cpu-allocator cache (auto's choice here)",
         "with": "MALLOC_MMAP_THRESHOLD_=131072 (the memory rows)"}


def table(result: dict) -> str:
    """Each precision's three sides: median step, its speed against glibc as it is, the last
    step's minor page faults and the peak RSS."""
    rows = ["| precision | heap | step (s) | speed vs glibc as it is | page faults, last step "
            "| peak RSS |", "|---|---|---|---|---|---|"]
    for precision in PRECISIONS:
        r = result[precision]
        for side in ("without", "cache", "with"):
            m = r[side]
            rows.append(f"| {'fp32' if precision == 'no' else precision} | {NAMES[side]} | "
                        f"{m['step_s']:.3f} | {r['without']['step_s'] / m['step_s']:.2f}x | "
                        f"{m['faults_last_step']:,.0f} | {m['peak_rss'] / 2**20:,.0f} MiB |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = script_parser("malloc_cost", __doc__)
    ap.add_argument("--rounds", type=int, default=3, help="A B rounds (default 3)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    a = ap.parse_args(argv)
    for field, value in (("--rounds", a.rounds), ("--steps", a.steps)):
        if value < 1:
            print(f"malloc_cost: {field} {value}: must be at least 1", file=sys.stderr)
            return 2
    from shardwise.bench.run import machine
    result = {"size": a.size, "rounds": a.rounds, "steps": a.steps, "threshold": THRESHOLD,
              **measure(a.size, a.rounds, a.steps), "machine": machine()}
    result["table"] = table(result)
    path = result_path(f"malloc-cost-{a.size}.json", a.save)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for precision in PRECISIONS:
        r = result[precision]
        print(f"{precision}: step {r['without']['step_s']:.3f} s without the variable, "
              f"{r['with']['step_s']:.3f} s with it ({r['slowdown']:.2f}x); faults per step "
              f"{r['without']['faults_last_step']:,.0f} against {r['with']['faults_last_step']:,.0f}"
              f"; --cpu-allocator cache {r['cache']['step_s']:.3f} s ({r['cache_speedup']:.2f}x "
              f"faster than without), {r['cache']['faults_last_step']:,.0f} faults, peak RSS "
              f"{r['cache_peak_rss_ratio']:.2f}x")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
