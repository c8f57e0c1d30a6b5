"""What ``MALLOC_MMAP_THRESHOLD_=131072`` costs a training step: why speed is measured without it.

    python -m shardwise.bench.malloc_cost [--size 57m] [--rounds 3] [--steps 8] [--save]

The memory measurements set it (freed blocks of 128 KiB or more go back to the OS, so peak RSS
follows live bytes: shardwise/bench/memory.py). The price is that every large tensor a step
allocates is a fresh mapping whose pages the kernel faults in and zeroes on first touch, every
step. This runs ``shardwise train``'s ``single`` step (``shardwise.prepare``, ``train_step``) on
the scaling family's GPT at ``--size`` in a fresh process with the variable and one without,
alternated ``--rounds`` times (A B A B), fp32 and bf16 autocast, and records each run's median
step (after two untimed ones) and the minor page faults of its last step and of its timed step
with the fewest (``getrusage``: without the variable the heap may still grow in a step).
Writes ``malloc-cost-<size>.json`` (``--save``: into shardwise/bench/results/).
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


def _run(size: str, steps: int, precision: str) -> dict:
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
    cfg = replace(cfg, memory=replace(cfg.memory, mixed_precision=precision))
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
    engine.close()
    return {"step_s": statistics.median(times[2:]), "faults_last_step": faults[-1],
            "faults_fewest_step": min(faults[2:])}


def _in_process(size: str, steps: int, precision: str, threshold: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = THRESHOLD
    code = ("import json, sys; from shardwise.bench.malloc_cost import _run; "
            f"print(json.dumps(_run({size!r}, {steps}, {precision!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"malloc_cost: the run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(size: str, rounds: int, steps: int) -> dict:
    """Both precisions, with and without the variable, alternated ``rounds`` times."""
    out = {}
    for precision in PRECISIONS:
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for i in range(rounds):
            for side in ("with", "without"):
                print(f"{precision}: round {i + 1}/{rounds}, {side} the variable", file=sys.stderr,
                      flush=True)
                runs[side].append(_in_process(size, steps, precision, side == "with"))
        med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for side, rs in runs.items()}
        out[precision] = {"runs": runs, **med,
                          "slowdown": med["with"]["step_s"] / med["without"]["step_s"]}
    return out


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
    path = result_path(f"malloc-cost-{a.size}.json", a.save)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for precision in PRECISIONS:
        r = result[precision]
        print(f"{precision}: step {r['without']['step_s']:.3f} s without the variable, "
              f"{r['with']['step_s']:.3f} s with it ({r['slowdown']:.2f}x); faults per step "
              f"{r['without']['faults_last_step']:,.0f} against {r['with']['faults_last_step']:,.0f}")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
