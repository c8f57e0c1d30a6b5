"""Where DDP's step goes against one process with every core: a torch.profiler trace of both.

    python -m shardwise.bench.profile_limit --size 57m --save

(without ``MALLOC_MMAP_THRESHOLD_``, whose page faults would be part of every op's time:
shardwise/bench/malloc_cost.py)

The "physical limit" of data parallelism on one host (issue 35 item 3) is one process that runs
the whole batch with all the cores (``torch.set_num_threads(cores)``): it communicates nothing.
DDP at world N runs 1/N of the batch per rank on cores/N threads each and adds the gradient
allreduce. This script runs both sides on the same model and global batch, through the
same public API a user's loop calls (``shardwise.prepare``: forward, loss, ``engine.backward``,
``engine.step``; the one-process side is the world of one, which is plain PyTorch), alternating
sides ``--rounds`` times (A B A B), and profiles ``--steps`` steps of each with
``torch.profiler`` (CPU activities) after two untimed ones. It reports, per side, per step:

- the wall time of the step and of its phases (``forward`` = forward + loss, ``backward``,
  ``step`` = the gradient sync's wait + the optimizer), medians over the profiled steps, and
  the minor page faults of each (``minor_faults``, ``getrusage``: the first touch of memory
  the allocator took from the kernel, on rank 0);
- each operator's self time (torch's own ops, gloo's ``gloo:all_reduce`` and the
  shared-memory allreduce's ``shm:*`` ranges, the optimizer's ``Optimizer.step#*`` range),
  summed per step on rank 0 (every DDP rank runs the same ops on its half of the batch);
- the difference table: operators ordered by how much more time per step DDP's rank 0 spends
  in them than the one process, which names where the gap goes.

``--mixed-precision bf16`` runs both sides in bf16 autocast (the loss in fp32, as training
computes it) and writes ``profile-limit-<size>-bf16.json``; ``--compile`` compiles both sides'
blocks (``-compiled``). docs/memory.md reads these files for ``--compile``'s ceiling
(:func:`compile_ceiling`) and for where the compiled step's time goes.

Self time is wall time on the calling thread, so an op that runs on 2 threads in the one
process and on 1 thread in a DDP rank shows the difference the threads make. Writes
``profile-limit-<size>.json`` (``--save``: into shardwise/bench/results/) with the machine
(commit, dirty flag, date, load) and, with ``--trace DIR``, a Chrome trace of each side
(``chrome://tracing`` or https://ui.perfetto.dev).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace

import torch

from shardwise.bench.harness import result_path, script_parser, sized_config, threads_for
from shardwise.config.names import Strategy

PHASES = ("forward", "backward", "step")
# ranges reported with everything they ran: the collectives and the optimizer's step
RANGES = ("shm:", "gloo:", "Optimizer.step#")


def _profiled_loop(rank: int, world: int, size: str, steps: int, trace: str | None,
                   precision: str = "no", compiled: bool = False) -> dict:
    """Build the sized GPT, prepare it for DDP (a world of one is plain PyTorch), train 2
    untimed steps and ``steps`` profiled ones; per-step phase times and op self times.
    ``precision``: memory.mixed_precision (``bf16``: autocast, the loss in fp32 as training
    computes it). ``compiled``: memory.compile (``--compile``'s blocks; the two untimed steps
    compile them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import shardwise
    from shardwise.data import build_data
    from shardwise.models import build_model, lm_loss
    from shardwise.run.api import optimizer_factory
    threads_for(world)
    cfg = sized_config(Strategy.DDP if world > 1 else Strategy.SINGLE, size, steps + 2)
    cfg = replace(cfg, memory=replace(cfg.memory, mixed_precision=precision, compile=compiled))
    data = build_data(cfg)
    model = build_model(cfg.model, cfg.train.seed)
    dtypes: list[torch.dtype] = []          # the dtype the forward's logits come out in (autocast's)
    hook = model.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    engine = shardwise.prepare(model, optimizer_factory(cfg), cfg, loss_fn=lm_loss)
    b = cfg.train.batch_size                     # the global batch; engine.shard takes our rows
    phases: dict[str, list[float]] = defaultdict(list)

    faults: dict[str, list[int]] = defaultdict(list)

    def now() -> tuple[float, int]:
        """The wall clock and this process's minor page faults so far."""
        return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def one_step(i: int, timed: bool) -> None:
        x, y = engine.shard(*data.batch(i, b, 0, 1))
        marks = [now()]
        with record_function("forward"):
            loss = engine.loss(x, y)
        marks.append(now())
        with record_function("backward"):
            engine.backward(loss)
        marks.append(now())
        with record_function("step"):
            engine.step()
        marks.append(now())
        if timed:
            spans = [*zip(PHASES, marks, marks[1:]), ("total", marks[0], marks[-1])]
            for name, (t0, f0), (t1, f1) in spans:
                phases[name].append(t1 - t0)
                faults[name].append(f1 - f0)

    for i in range(2):
        one_step(i, False)
    hook.remove()
    if not dtypes:
        raise RuntimeError("profile_limit: the model's forward hook never fired; the engine "
                           "no longer calls the module it was given")
    logits_dtype = str(dtypes[-1])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(2, steps + 2):
            one_step(i, True)
    if trace and rank == 0:
        os.makedirs(trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace, f"{'ddp' if world > 1 else 'one'}-{size}.json"))
    ops: dict[str, float] = defaultdict(float)
    ranges: dict[str, float] = {}
    shapes = {tuple(p.shape) for p in engine.model.parameters()}
    weight_casts = sum(ev.self_cpu_time_total for ev in prof.key_averages(group_by_input_shape=True)
                       if ev.key == "aten::copy_" and ev.input_shapes
                       and tuple(ev.input_shapes[0]) in shapes) / 1e6 / steps
    for ev in prof.key_averages():
        if ev.key.startswith(RANGES):      # whole time inside, the ops they ran included
            ranges[ev.key] = ev.cpu_time_total / 1e6 / steps
        if ev.key not in PHASES:
            ops[ev.key] += ev.self_cpu_time_total / 1e6 / steps
    engine.close()
    return {"threads": torch.get_num_threads(), "rows_per_rank": b // world,
            "logits_dtype": logits_dtype,
            "phases": {k: statistics.median(v) for k, v in phases.items()},
            "minor_faults": {k: statistics.median(v) for k, v in faults.items()},
            "ops_s_per_step": dict(ops), "ranges_s_per_step": ranges,
            "weight_casts_s_per_step": weight_casts}


def _side(world: int, size: str, steps: int, trace: str | None, precision: str,
          compiled: bool) -> dict:
    from shardwise.launch.world import run_world
    return run_world(_profiled_loop, world, size, steps, trace, precision, compiled,
                     timeout=1800)[0]


def difference(ddp: dict, one: dict, top: int = 12) -> list[dict]:
    """Operators ordered by (DDP rank 0's seconds per step - the one process's), largest
    first: where DDP's extra time goes (negative: where DDP is faster)."""
    names = set(ddp) | set(one)
    rows = [{"op": n, "ddp_s": ddp.get(n, 0.0), "one_s": one.get(n, 0.0),
             "extra_s": ddp.get(n, 0.0) - one.get(n, 0.0)} for n in names]
    rows.sort(key=lambda r: -abs(r["extra_s"]))
    return rows[:top]


KERNELS = {     # what --compile hands on unchanged: (group, test on the profiler's op name)
    "matrix products": lambda op: op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": lambda op: "scaled_dot_product" in op,
    "optimizer step": lambda op: op.startswith(("aten::_fused_adam", "aten::_foreach_")),
    "gradient sync": lambda op: op.startswith(("gloo:", "shm:")) or "all_reduce" in op,
}
WEIGHT_CASTS = "weight-sized copies"
"""``aten::copy_`` on tensors of a parameter's shape (from the profile's shapes): under
autocast, each weight cast to the compute dtype in forward and its gradient cast back in
backward; under DDP, each gradient copied into its bucket. A compiled block casts its weights
too (the bytes are the parameters', whatever fuses around them), and the bucket copies run in
the gradient sync's hooks, outside the compiled blocks."""


def compile_ceiling(ops: dict[str, float], weight_casts: float = 0.0) -> dict:
    """Split a side's per-step self times (``ops_s_per_step``, which partition its step) into
    what ``--compile`` leaves as it is (:data:`KERNELS`: the BLAS / oneDNN matrix products,
    the attention kernels, the fused optimizer step, DDP's allreduce; and ``weight_casts``
    seconds of ``aten::copy_``, :data:`WEIGHT_CASTS`) and the rest, and the most compiling
    the rest could give: ``ceiling`` = step / (step - rest), reached only if Inductor removed
    the rest entirely (it also holds the embedding, head, loss and the autograd engine's own
    time, which it does not compile)."""
    groups = {name: 0.0 for name in KERNELS}
    rest = 0.0
    for op, seconds in ops.items():
        group = next((name for name, test in KERNELS.items() if test(op)), None)
        if group is None:
            rest += seconds
        else:
            groups[group] += seconds
    groups[WEIGHT_CASTS] = weight_casts
    rest -= weight_casts
    total = sum(groups.values()) + rest
    return {"groups": groups, "rest": rest, "total": total, "ceiling": total / (total - rest)}


def _median_side(runs: list[dict]) -> dict:
    """Per-key medians over the rounds of one side."""
    keys = set().union(*(r["ops_s_per_step"] for r in runs))
    return {"threads": runs[0]["threads"], "rows_per_rank": runs[0]["rows_per_rank"],
            "logits_dtype": runs[0]["logits_dtype"],
            "weight_casts_s_per_step": statistics.median(r["weight_casts_s_per_step"] for r in runs),
            "phases": {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]},
            "phase_runs": {k: [r["phases"][k] for r in runs] for k in runs[0]["phases"]},
            "minor_faults": {k: statistics.median(r["minor_faults"][k] for r in runs)
                             for k in runs[0]["minor_faults"]},
            "ops_s_per_step": {k: statistics.median(r["ops_s_per_step"].get(k, 0.0) for r in runs)
                               for k in keys},
            "ranges_s_per_step": {k: statistics.median(r["ranges_s_per_step"].get(k, 0.0)
                                                       for r in runs)
                                  for k in set().union(*(r["ranges_s_per_step"] for r in runs))}}


def _table(result: dict) -> str:
    d, o = result["ddp"], result["one"]
    lines = ["| phase | DDP rank 0 (s) | one process (s) | DDP - one (s) | minor page faults, "
             "DDP rank 0 / one process |", "|---|---|---|---|---|"]
    for k in (*PHASES, "total"):
        lines.append(f"| {k} | {d['phases'][k]:.3f} | {o['phases'][k]:.3f} | "
                     f"{d['phases'][k] - o['phases'][k]:+.3f} | "
                     f"{d['minor_faults'][k]:,.0f} / {o['minor_faults'][k]:,.0f} |")
    lines += ["", "| range (with what it ran) | DDP rank 0 (s/step) | one process (s/step) |",
              "|---|---|---|"]
    for k in sorted(set(d["ranges_s_per_step"]) | set(o["ranges_s_per_step"])):
        lines.append(f"| `{k}` | {d['ranges_s_per_step'].get(k, 0.0):.3f} | "
                     f"{o['ranges_s_per_step'].get(k, 0.0):.3f} |")
    lines += ["", "| operator (self time) | DDP rank 0 (s/step) | one process (s/step) | DDP - one |",
              "|---|---|---|---|"]
    for r in result["difference"]:
        lines.append(f"| `{r['op']}` | {r['ddp_s']:.3f} | {r['one_s']:.3f} | {r['extra_s']:+.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = script_parser("profile_limit", __doc__)
    ap.add_argument("--world", type=int, default=2, help="DDP ranks (default 2)")
    ap.add_argument("--steps", type=int, default=4, help="profiled steps per run (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds (default 2)")
    ap.add_argument("--mixed-precision", default="no", choices=("no", "bf16"),
                    help="both sides in bf16 autocast (default: fp32); the file gets a -bf16 suffix")
    ap.add_argument("--compile", action="store_true",
                    help="both sides with --compile (the file gets a -compiled suffix)")
    ap.add_argument("--trace", metavar="DIR", help="write a Chrome trace of each side there")
    a = ap.parse_args(argv)
    for field, value in (("--world", a.world), ("--steps", a.steps), ("--rounds", a.rounds)):
        if value < 1 or (field == "--world" and value < 2):
            print(f"profile_limit: {field} {value}: must be at least "
                  f"{2 if field == '--world' else 1}", file=sys.stderr)
            return 2
    from shardwise.bench.run import machine
    runs: dict[str, list[dict]] = {"ddp": [], "one": []}
    t0 = time.perf_counter()
    for i in range(a.rounds):
        for side, world in (("ddp", a.world), ("one", 1)):
            print(f"round {i + 1}/{a.rounds}: {side} (world {world})", file=sys.stderr, flush=True)
            runs[side].append(_side(world, a.size, a.steps, a.trace if i == 0 else None,
                                    a.mixed_precision, a.compile))
    result = {"size": a.size, "world": a.world, "steps": a.steps, "rounds": a.rounds,
              "mixed_precision": a.mixed_precision, "compile": a.compile,
              "cores": os.cpu_count(), "ddp": _median_side(runs["ddp"]),
              "one": _median_side(runs["one"]), "seconds": time.perf_counter() - t0}
    result["difference"] = difference(result["ddp"]["ops_s_per_step"], result["one"]["ops_s_per_step"])
    result["step_ratio"] = result["one"]["phases"]["total"] / result["ddp"]["phases"]["total"]
    result["table"] = _table(result)
    result["machine"] = machine()
    suffix = ("" if a.mixed_precision == "no" else f"-{a.mixed_precision}") + \
        ("-compiled" if a.compile else "")
    path = result_path(f"profile-limit-{a.size}{suffix}.json", a.save)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(result["table"])
    print(f"DDP world {a.world} steps at {result['step_ratio']:.3f}x the one process's speed "
          f"(one-process step / DDP step); written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
