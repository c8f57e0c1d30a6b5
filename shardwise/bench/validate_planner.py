"""The planner against this machine: predicted vs measured memory per rank and step time.

    python -m shardwise.bench.validate_planner [--steps 10] [--reps 3] [--only ddp,zero2]
    python -m shardwise.bench.validate_planner --held-out [--runs 3] [--steps 8] [--save]

``--held-out``: calibrated on this benchmark GPT only, validated on models it never saw
(shardwise/bench/validate_planner_heldout.py).

For each strategy shardwise has here (``shardwise.parallel.available()``), the benchmark GPT
(``shardwise.bench.harness.gpt_bench_config``: 4 layers, width 256, seq 128, batch 8, fp32 AdamW)
trains briefly in a forked gloo world (``shardwise.launch.world.run_world``). Rank by rank the
strategy's ``memory_ledger()`` gives the bytes it holds by category; the fullest rank is
compared with the planner's ``estimate()`` for the same layout (the planner also reports its
fullest device), on the Hardware that ``shardwise.launch.auto.calibrate`` measures for that world
size (matmul, GPT forward+backward fit, copy bandwidth, the optimizer step, gloo's and data
parallelism's allreduce) around its runs: ``--reps`` runs (3), each between two calibrations,
medians of both sides (``Calibrations``: this machine's speed drifts within a minute). Goals
(issue 7): memory within 10% per category, step time within 25%.

Writes shardwise/bench/results/planner_validation.json and planner_validation.md.
"""
from __future__ import annotations

import argparse
import tempfile
import json
import os
import statistics
import time
from dataclasses import replace

import torch

from shardwise.config.names import Axis, Strategy
from shardwise.bench.harness import RESULTS, discard_run, gpt_bench_config
from shardwise.launch import auto as autoplan
from shardwise.planner import Layout, estimate

STATES = ("parameters", "gradients", "optimizer_states", "master_weights")
MEM_GOAL, TIME_GOAL = 0.10, 0.25

# strategy -> (world, parallel overrides, the planner's layout of that run; batch 8)
CASES = {
    Strategy.SINGLE: (1, {}, Layout(micro_batch=8)),
    Strategy.DP: (1, {"replicas": 2}, Layout(micro_batch=4)),        # 2 replicas in one process
    Strategy.DDP: (2, {}, Layout(dp=2, micro_batch=4)),
    Strategy.ZERO1: (2, {}, Layout(dp=2, zero=1, micro_batch=4)),
    Strategy.ZERO2: (2, {}, Layout(dp=2, zero=2, micro_batch=4)),
    Strategy.ZERO3: (2, {}, Layout(dp=2, zero=3, micro_batch=4)),
    Strategy.TP: (2, {Axis.TP: 2}, Layout(tp=2, micro_batch=8)),
    Strategy.PP: (2, {Axis.PP: 2, "num_microbatches": 4}, Layout(pp=2, micro_batch=2)),
    Strategy.THREE_D: (4, {Axis.DP: 2, Axis.PP: 2, "num_microbatches": 2, "zero1_over_dp": True},
           Layout(dp=2, pp=2, zero=1, micro_batch=2)),
    Strategy.PS: (3, {"num_ps": 1, "num_workers": 2}, Layout(dp=2, num_ps=1, micro_batch=4)),
}


def _train(rank: int, world: int, cfg) -> dict:
    """One rank: train, return its ledger and the run's throughput (tokens/s)."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    rt = init_runtime(cfg)
    summary = train(cfg, rt, quiet=True)
    ledger = {k: int(v) for k, v in summary["ledger"].items()}
    discard_run(summary, rt)
    return {"ledger": ledger, "throughput": summary["throughput"], "pp_rank": rt.mesh.pp_rank,
            "last_stage": rt.mesh.is_last_stage, "server": "replica_for_gather" in ledger}


def _same_role(ranks: list[dict], role: str) -> list[dict]:
    """The ranks playing the planner's ``memory_role`` (its fullest device)."""
    pick = {"stage 0": lambda r: r["pp_rank"] == 0, "last stage": lambda r: r["last_stage"],
            "worker": lambda r: not r["server"], "server": lambda r: r["server"]}
    return [r for r in ranks if pick.get(role, lambda r: True)(r)] or ranks


def predicted(name: str, layout: Layout, cfg, hw) -> tuple[dict, float]:
    """(bytes by ledger category on the fullest device, seconds per step) from the planner."""
    e = estimate(layout, autoplan.model_spec(cfg), hw, autoplan.batch_of(cfg))
    mem = {k: e.memory[k] for k in STATES}
    mem["comm_buffers"] = e.memory["buffers"]
    step, mem["role"] = e.step_s, e.memory_role
    if name == Strategy.DP:
        step = _dp_step(layout, cfg, hw, e)
        replicas = cfg.parallel.replicas   # R copies of the states in the one process
        mem = {k: v * (replicas if k in STATES else 1) for k, v in mem.items() if k != "role"}
    return mem, step


def _dp_step(layout: Layout, cfg, hw, whole) -> float:
    """Seconds per step of R replicas in one process (parallel/dp.py): each replica's rows
    (batch / R) on its own thread, as many at once as there are cores (torch drops the GIL in
    its kernels), their optimizer steps likewise, plus the reduction on replica 0: R - 1 adds
    into its gradients and R - 1 copies back out, each reading and writing the gradient bytes
    once (``whole``: the planner's estimate of one replica doing everything)."""
    replicas = cfg.parallel.replicas
    lanes = max(1, min(replicas, os.cpu_count() or 1))
    waves = -(-replicas // lanes)                       # rounds of concurrent replicas
    batch = autoplan.batch_of(cfg)
    share = replace(batch, global_batch=max(1, batch.global_batch // replicas))
    one = estimate(replace(layout, micro_batch=share.global_batch), autoplan.model_spec(cfg),
                   hw, share)
    grads = whole.memory["gradients"]
    reduce_s = (replicas - 1) * (3 + 2) * grads / hw.mem_bw   # add: 2 reads 1 write; copy: 1 + 1
    return waves * one.step_s + reduce_s


def _gap(pred: float, meas: float) -> float | None:
    """(predicted - measured) / measured; None when both are zero-ish."""
    if meas == 0:
        return None if pred == 0 else float("inf")
    return (pred - meas) / meas


class Calibrations:
    """The calibrations around the runs. This machine's speed drifts within tens of seconds (a
    shared VM: one process timing the same forward+backward read 146-181 ms in consecutive 5 s
    windows, and a world's calibration read 50% slower for 20 s), so every run sits between
    two calibrations of its world, and a strategy is predicted from the median of those around
    its runs (``validate_one``). The calibration after one run serves as the one before the
    next run of that world when nothing ran in between."""

    def __init__(self):
        self.taken: dict[int, list] = {}
        self._after: dict[int, object] = {}

    def _take(self, cfg, world: int):
        cal_cfg = replace(cfg, parallel=replace(cfg.parallel, nproc_per_node=world))
        cal = autoplan.calibrate(cal_cfg)
        self.taken.setdefault(world, []).append(cal)
        return cal

    def before(self, cfg, worlds) -> dict:
        """{world: its calibration just before the run} (the last run's after, or a new one)."""
        return {w: self._after.get(w) or self._take(cfg, w) for w in worlds}

    def after(self, cfg, worlds) -> dict:
        """{world: a calibration just after the run}; it is the next run's before."""
        self._after = {w: self._take(cfg, w) for w in worlds}
        return self._after

    def forget(self) -> None:
        """Something ran since the last calibration (a run that failed): the next run takes a
        calibration of its own before it."""
        self._after = {}

    def latest(self) -> dict:
        return {w: cals[-1] for w, cals in self.taken.items()}


def _hardware(cals: dict, world: int, computing: int):
    """The planner's Hardware of a run on ``world`` ranks (``computing`` of them computing)
    from ``cals`` ({world: Calibration})."""
    hw = cals[world].hardware(world)
    if computing != world:
        hw = _computing_on(hw, cals[computing].hardware(computing))
    return hw


def _computing_on(hw, compute_hw):
    """``hw`` (the whole world's links) with the compute figures of ``compute_hw``: a
    calibration of n processes measures each rank's kernels while n of them share the cores,
    and the parameter server's ps task computes no forward or backward, so its workers' share
    of the cores is that of a world of ``num_workers``; so is the delay a transfer pays after
    compute (``collective_overhead``: the workers' arrival skew; the ps task waits idle)."""
    return replace(hw, peak_flops=compute_hw.peak_flops, efficiency=compute_hw.efficiency,
                   block_overhead=compute_hw.block_overhead, mem_bw=compute_hw.mem_bw,
                   optimizer_bw=compute_hw.optimizer_bw,
                   collective_overhead=compute_hw.collective_overhead)


def validate_one(name: str, steps: int, calibrations: Calibrations, reps: int = 3) -> dict:
    """``name`` trained ``reps`` times, each run between two calibrations of its world
    (calibrate, run, calibrate, run, ..., calibrate: the one after a run is the next one's
    before): the prediction is the median over those ``reps + 1`` calibrations, the measure the
    median over the runs, as the benchmarks race a peer (A B A B)."""
    from shardwise.launch.world import run_world
    world, par, layout = CASES[name]
    cfg = gpt_bench_config(name, parallel=par, train={"steps": steps})
    computing = par.get("num_workers", world) if name == Strategy.PS else world
    worlds = sorted({world, computing})
    pred_mem, first = predicted(name, layout, cfg, _hardware(calibrations.before(cfg, worlds),
                                                              world, computing))
    role = pred_mem.pop("role", "rank")
    t0 = time.perf_counter()
    tokens = cfg.train.batch_size * cfg.model.block_size
    preds, measured = [first], []
    for _ in range(max(1, reps)):
        ranks = run_world(_train, world, cfg, timeout=600)
        measured.append(tokens / ranks[0]["throughput"])
        preds.append(predicted(name, layout, cfg, _hardware(calibrations.after(cfg, worlds),
                                                            world, computing))[1])
    fullest = max(_same_role(ranks, role),
                  key=lambda r: sum(r["ledger"].get(k, 0) for k in STATES))["ledger"]
    meas_mem = {k: fullest.get(k, 0) for k in (*STATES, "comm_buffers")}
    pred_step, meas_step = statistics.median(preds), statistics.median(measured)
    states = [sum(pred_mem[k] for k in STATES), sum(meas_mem[k] for k in STATES)]
    return {
        "strategy": name, "world": world, "layout": layout.describe(), "role": role,
        "predicted_memory": pred_mem, "measured_memory": meas_mem,
        "memory_gap": {k: _gap(pred_mem[k], meas_mem[k]) for k in pred_mem},
        "states_predicted": states[0], "states_measured": states[1],
        "states_gap": _gap(*states),
        "step_predicted_s": pred_step, "step_measured_s": meas_step,
        "step_predictions_s": preds, "step_measurements_s": measured,
        "step_gap": _gap(pred_step, meas_step), "run_seconds": time.perf_counter() - t0,
        "activations_peak_measured": fullest.get("activations_peak"),
    }


def _pct(x) -> str:
    return "-" if x is None else "inf" if x == float("inf") else f"{x:+.0%}"


def _spread(xs) -> str:
    """``(lo-hi)`` of several readings, empty for fewer than two."""
    return f"({min(xs):.3f}-{max(xs):.3f})" if xs and len(xs) > 1 else ""


def _mb(x) -> str:
    return f"{x / 1e6:.2f}"


def markdown(rows: list[dict], calibrations: Calibrations, load: tuple) -> str:
    out = ["| strategy | world | layout | model states pred / meas (MB) | gap | comm buffers "
           "pred / meas (MB) | step pred / meas (s), median (range) | gap | goals (10% / 25%) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['strategy']} | {r['world']} | - | - | - | - | - | - | "
                       f"failed: {r['error'][:80]} |")
            continue
        pm, mm = r["predicted_memory"], r["measured_memory"]
        mem_ok = all(g is None or abs(g) <= MEM_GOAL for k, g in r["memory_gap"].items()
                     if k in STATES)
        ok = ("yes" if mem_ok else "no") + " / " + (
            "yes" if abs(r["step_gap"]) <= TIME_GOAL else "no")
        out.append(f"| {r['strategy']} | {r['world']} | {r['layout']} | "
                   f"{_mb(r['states_predicted'])} / {_mb(r['states_measured'])} | "
                   f"{_pct(r['states_gap'])} | {_mb(pm['comm_buffers'])} / "
                   f"{_mb(mm['comm_buffers'])} | {r['step_predicted_s']:.3f} "
                   f"{_spread(r.get('step_predictions_s'))} / {r['step_measured_s']:.3f} "
                   f"{_spread(r.get('step_measurements_s'))} | {_pct(r['step_gap'])} | {ok} |")
    out += ["", "Per category, predicted / measured MB on the planner's fullest device (the same "
            "role measured: stage, worker or server):", "",
            "| strategy | parameters | gradients | optimizer_states | master_weights |",
            "|---|---|---|---|---|"]
    for r in rows:
        if "error" not in r:
            cells = [f"{_mb(r['predicted_memory'][k])} / {_mb(r['measured_memory'][k])}"
                     for k in STATES]
            out.append(f"| {r['strategy']} | " + " | ".join(cells) + " |")
    out += ["", "Calibration per world size (`shardwise.launch.auto.calibrate`), the last one taken, "
            "and the spread of the GPT's rate per rank over all taken (one between every two "
            "runs; a strategy's prediction is the median of those around its runs):", ""]
    for n, cals in sorted(calibrations.taken.items()):
        rates = [c.per_rank.model_flops / 1e9 for c in cals]
        out.append(f"- world {n} ({len(cals)} calibrations, GPT forward+backward "
                   f"{min(rates):.1f}-{max(rates):.1f} GFLOP/s per rank): "
                   + cals[-1].describe().replace("\n", "; "))
    out.append(f"- load average during the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
               f"on {os.cpu_count()} cores (the machine is shared: times are noisy)")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from shardwise.parallel import available
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.validate_planner")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per run (10; held-out: 8)")
    ap.add_argument("--held-out", action="store_true",
                    help="validate on models the calibration never saw (planner_heldout.*)")
    ap.add_argument("--runs", type=int, default=3, help="held-out: consecutive runs")
    ap.add_argument("--models", default="", help="held-out: comma-separated MODELS keys")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs per strategy, each between two calibrations (medians)")
    ap.add_argument("--only", default="", help="comma-separated strategies (default: all here)")
    ap.add_argument("--save", action="store_true",
                    help="write to shardwise/bench/results/ (overwrites the committed figures); "
                         "default: a temp dir, printed")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)           # calibrate with what each forked rank gets
    if args.held_out:
        from shardwise.bench import validate_planner_heldout
        args.steps = args.steps or 8
        return validate_planner_heldout.main(args)
    args.steps = args.steps or 10
    names = [n for n in (args.only.split(",") if args.only else CASES) if n in available()]
    calibrations = Calibrations()
    rows = []
    for name in names:
        try:
            row = validate_one(name, args.steps, calibrations, args.reps)
        except Exception as exc:  # a strategy still landing: record it, keep going
            row = {"strategy": name, "world": CASES[name][0], "error": f"{type(exc).__name__}: "
                   f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if "memory" not in k}), flush=True)
    load = os.getloadavg()
    doc = {"rows": rows, "load_average": load, "steps": args.steps, "reps": args.reps,
           "calibration": {n: {"text": c.describe(), "hardware": c.hardware(n).to_dict()}
                           for n, c in calibrations.latest().items()},
           "calibration_spread": {n: [c.per_rank.model_flops for c in cals]
                                  for n, cals in calibrations.taken.items()}}
    write_results(args.save, "planner_validation", doc, markdown(rows, calibrations, load))
    return 0


def write_results(save: bool, stem: str, doc: dict, table: str) -> str:
    """``stem``.json and ``stem``.md into shardwise/bench/results/ (``save``) or a new temp
    folder; prints the table and the folder, and returns the folder."""
    from shardwise.bench.run import machine
    doc = {**doc, "machine": machine()}     # the commit, whether the tree was dirty, the date
    out_dir = RESULTS if save else tempfile.mkdtemp(prefix=f"shardwise-{stem}-")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as fh:
        fh.write(table)
    print(table)
    print(f"results: {out_dir}")
    return out_dir


if __name__ == "__main__":
    raise SystemExit(main())
