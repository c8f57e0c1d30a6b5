"""Peak RSS per rank at a long sequence: one process against context parallel (``cp-memory``).

    python -m shardwise.bench.cp_memory --save          # about 11 minutes on 2 cores
    python -m shardwise.bench.cp_memory --seq 4096 --long-seq 8192 --limit 600MiB   # a quick look

Every run is ``shardwise train`` as a user types it, in a subprocess (torchrun is started by
shardwise itself for cp > 1): shardwise's GPT at 4 layers x 128 (4 heads, byte vocabulary),
batch 1, ``--dataset synthetic``, AdamW fp32, 3 steps, ``MALLOC_MMAP_THRESHOLD_=131072`` in the
environment (blocks of 128 KiB or more go back to the OS when freed, so peak RSS tracks live
bytes: shardwise/bench/memory.py). Sides at ``--seq`` (default 32,768 tokens): one process
(``--strategy single``), ``--cp 2`` ring, ``--cp 4`` ring, ``--cp 4`` Ulysses (the last three
``--strategy ddp`` at world = cp). Threads: one process runs 2 (the machine's cores), a rank of
cp N runs as shardwise sets it for world N.

Per side: the peak RSS per rank (``ru_maxrss``, max over ranks, from the run's summary.json),
the run's own ledger (``activations_peak``: the bytes autograd saved in one forward,
shardwise/parallel/ledger.py), seconds per step (median of steps 2-3) and tokens/s
(sequence / seconds per step). ``idle`` is the peak RSS of an idle rank: a process that imports
torch and shardwise, builds the same model (its position embedding is ``--seq`` long) and holds
its gradients and AdamW moments, that is the torch baseline plus the model states every cp rank
keeps whole. The activation-attributable memory of a side is ``peak - idle``, and

    ratio(cp N) = (peak(cp N) - idle) / (peak(one process) - idle)

is what cp N keeps of one process's activation memory (the issue's goal at cp 4: about 1/4).
The ledger's own ratio, ``activations_peak(cp N) / activations_peak(one process)``, is beside it.

Does not fit: at ``--long-seq`` (default 65,536) under ``--limit`` per process (default 1.5 GiB),
one process and cp 4 (ring) each run inside memory cgroups (shardwise/bench/largest_model.py's
:class:`MemoryCage`): the one process in a cgroup of ``--limit``; each rank of cp 4 in a cgroup of
its own of ``--limit`` (torchrun starts ``python -m shardwise.bench.cp_memory --caged-rank``,
which joins its rank's cgroup and then execs ``python -m shardwise.cli train`` with the same
flags: the rank is exactly the user's command), torchrun's agent in a parent cgroup of
cp x limit + 1 GiB. A side fits when it exits 0 after its ``--long-steps`` (2) steps with finite
losses and the cgroups' OOM killer killed nothing. Each run is capped at ``--run-seconds`` (900).
The JSON carries the commit, the dirty flag, the date and the machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from shardwise.config.names import Axis, Strategy

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256}
SIDES = {"one process": (1, ""), "cp 2 ring": (2, "ring"), "cp 4 ring": (4, "ring"),
         "cp 4 ulysses": (4, "ulysses")}
MiB, GiB = 2 ** 20, 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_env() -> dict:
    """Every run's environment: the returning allocator, and this checkout first on the path
    (so torchrun's ranks import the code that this script is, not another install)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": path}


def train_args(cp: int, impl: str, seq: int, steps: int, out_dir: str) -> list[str]:
    """``shardwise train`` flags of one side (what follows ``python -m shardwise.cli``)."""
    args = ["train", "--n-layer", str(MODEL["n_layer"]), "--n-embd", str(MODEL["n_embd"]),
            "--n-head", str(MODEL["n_head"]), "--vocab-size", str(MODEL["vocab_size"]),
            "--block-size", str(seq), "--batch-size", "1", "--steps", str(steps),
            "--dataset", "synthetic", "--eval-every", "0", "--eval-batches", "1",
            "--log-every", "1", "--no-progress", "--out-dir", out_dir, "--run-name", "t"]
    if cp == 1:
        return args + ["--strategy", Strategy.SINGLE]
    return args + ["--strategy", Strategy.DDP, "--nproc-per-node", str(cp), "--cp", str(cp),
                   "--cp-impl", impl]


def read_run(out_dir: str) -> dict:
    """What a run wrote: per-step loss and seconds, peak RSS per rank, its ledger."""
    out: dict = {"losses": [], "step_seconds": [], "peak_rss_per_rank": [], "ledger": None}
    for path in glob.glob(os.path.join(out_dir, "*", "metrics.jsonl")):
        with open(path) as fh:
            steps = [json.loads(line) for line in fh if line.strip()]
        out.update(losses=[s["loss"] for s in steps],
                   step_seconds=[s["step_seconds"] for s in steps])
    for path in glob.glob(os.path.join(out_dir, "*", "summary.json")):
        with open(path) as fh:
            summary = json.load(fh)
        out.update(peak_rss_per_rank=[int(v) for v in summary.get("peak_memory_per_rank") or []],
                   ledger=summary.get("ledger"))
    return out


def measure(name: str, seq: int, steps: int, seconds: float, scratch: str) -> dict:
    """One side at ``seq``, uncaged: the run's figures, tokens/s from the median step 2..n."""
    cp, impl = SIDES[name]
    work = tempfile.mkdtemp(prefix=f"cp{cp}{impl}-", dir=scratch)
    cmd = [sys.executable, "-m", "shardwise.cli", *train_args(cp, impl, seq, steps, work)]
    began = time.perf_counter()
    with open(os.path.join(scratch, f"cp{cp}{impl}-{seq}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env(),
                            timeout=seconds).returncode
    out = {"side": name, Axis.CP: cp, "impl": impl or None, "seq": seq, "returncode": rc,
           "wall_seconds": round(time.perf_counter() - began, 1), **read_run(work)}
    shutil.rmtree(work, ignore_errors=True)
    if len(out["step_seconds"]) >= 2:
        out["seconds_per_step"] = statistics.median(out["step_seconds"][1:])
        out["tokens_per_s"] = seq / out["seconds_per_step"]
    return out


def idle_rank(seq: int) -> dict:
    """The idle rank's figures at ``seq``, measured in a fresh process (``--idle-rank``)."""
    cmd = [sys.executable, "-m", "shardwise.bench.cp_memory", "--idle-rank", "--seq", str(seq)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=run_env(), timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"idle rank failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def idle_rank_main(seq: int) -> int:
    """Import what a rank imports, build the model with its gradients and AdamW moments; print
    the RSS after the imports, the peak RSS, and the model states' bytes."""
    import resource

    import torch

    import shardwise.run.train  # noqa: F401  (the loop a rank runs, and what it imports)
    from shardwise.bench.memory import _rss_now
    from shardwise.run.allocator import track_live_bytes
    from shardwise.config import ModelConfig
    from shardwise.models import build_model
    track_live_bytes()
    imports = _rss_now()
    model = build_model(ModelConfig(name="gpt", block_size=seq, dropout=0.0, **MODEL), 0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.optim.AdamW(model.parameters()).step()          # creates exp_avg, exp_avg_sq
    states = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"imports": imports, "states": states,
                      "idle": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return 0


def caged(name: str, seq: int, steps: int, limit: int, seconds: float, scratch: str) -> dict:
    """One side at ``seq`` with ``limit`` bytes per process (module docstring): the verdict."""
    from shardwise.bench.largest_model import MemoryCage, _error_line
    cp, impl = SIDES[name]
    work = tempfile.mkdtemp(prefix=f"caged-cp{cp}-", dir=scratch)
    args = train_args(cp, impl, seq, steps, work)
    tag = f"shardwise-cpmem-{os.getpid()}-cp{cp}"
    if cp == 1:
        outer = MemoryCage(limit, tag)
        cages = [outer]
        cmd = [sys.executable, "-m", "shardwise.cli", *args]
    else:
        outer = MemoryCage(cp * limit + GiB, tag)               # torchrun's agent
        cages = [MemoryCage(limit, f"{tag}/rank{r}") for r in range(cp)] + [outer]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(cp), "-m", "shardwise.bench.cp_memory",
               "--caged-rank", outer.path, *args]
    log = os.path.join(scratch, f"caged-cp{cp}-{seq}.log")
    try:
        rc, took = outer.run(cmd, seconds, run_env(), log)
        kills = sum(c.oom_kills() for c in cages)
        cage_peaks = [c.peak() for c in cages[:cp]]
    finally:
        for c in cages:                                         # children before the parent
            c.close()
    out = {"side": name, Axis.CP: cp, "impl": impl or None, "seq": seq, "limit": limit,
           "returncode": rc, "oom_kills": kills, "cgroup_peak_per_process": cage_peaks,
           "wall_seconds": round(took, 1), **read_run(work)}
    shutil.rmtree(work, ignore_errors=True)
    return {**out, **verdict(out, steps, seconds, _error_line(log))}


def verdict(run: dict, steps: int, seconds: float, error: str = "") -> dict:
    """fits, and the reason: killed by the limit, too slow, failed, or trained."""
    losses = run["losses"]
    if run["oom_kills"]:
        return {"fits": False, "reason": f"out of memory: the cgroup's OOM killer "
                f"({run['oom_kills']} kill(s)), exit {run['returncode']}"}
    if run["returncode"] is None:
        return {"fits": False, "reason": f"too slow: past the {seconds:.0f} s cap"}
    if run["returncode"] != 0:
        return {"fits": False, "reason": f"exit {run['returncode']}: {error}"}
    if len(losses) < steps or not all(math.isfinite(v) for v in losses):
        return {"fits": False, "reason": f"{len(losses)} of {steps} steps, losses {losses}"}
    return {"fits": True, "reason": f"trained {steps} steps, loss {losses[-1]:.3f}"}


def join_cage_and_train(cage: str, args: list[str]) -> int:
    """A rank started by torchrun: join ``cage``/rank<LOCAL_RANK>, then become ``shardwise
    train`` (exec: the rank's process is the CLI's, with nothing of this script left)."""
    with open(os.path.join(cage, f"rank{os.environ['LOCAL_RANK']}", "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
    os.execv(sys.executable, [sys.executable, "-m", "shardwise.cli", *args])
    return 1                                                    # not reached


def summarize(sides: dict, idle: dict) -> dict:
    """Per side: peak RSS per rank (max over ranks), peak - idle and its ratio to one process's,
    the ledger's activations and their ratio (formulas: the module docstring)."""
    base = sides["one process"]
    out = {}
    for name, r in sides.items():
        peak = max(r["peak_rss_per_rank"])
        used = peak - idle["idle"]
        acts = (r["ledger"] or {}).get("activations_peak")
        base_acts = (base["ledger"] or {}).get("activations_peak")
        out[name] = {"peak": peak, "above_idle": used,
                     "ratio": used / (max(base["peak_rss_per_rank"]) - idle["idle"]),
                     "activations": acts,
                     "activations_ratio": acts / base_acts if acts and base_acts else None}
    return out


def table(res: dict) -> str:
    """The two markdown tables: memory and speed per side at ``seq``; the caged runs."""
    idle, seq, fig = res["idle"]["idle"], res["seq"], res["figures"]
    lines = [f"| sequence {seq:,}, batch 1 | peak RSS / rank (MiB) | peak - idle (MiB) | "
             "ratio to one process | ledger activations (MiB) | ratio | s / step | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["sides"].items():
        f = fig[name]
        acts = f"{f['activations'] / MiB:,.0f} | {f['activations_ratio']:.3f}" \
            if f["activations"] else "- | -"
        lines.append(f"| {name} | {f['peak'] / MiB:,.0f} | {f['above_idle'] / MiB:,.0f} | "
                     f"{f['ratio']:.3f} | {acts} | {r['seconds_per_step']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} |")
    lines.append(f"| idle rank (torch, shardwise, model states) | {idle / MiB:,.0f} | 0 | - | - "
                 "| - | - | - |")
    lines += ["", f"| sequence {res['long_seq']:,}, limit {res['limit'] / GiB:.2f} GiB per "
              "process | exit | OOM kills | peak RSS / rank (MiB) | losses | verdict |",
              "|---|---:|---:|---:|---|---|"]
    for r in res["caged"]:
        rss = " / ".join(f"{v / MiB:,.0f}" for v in r["peak_rss_per_rank"]) or "-"
        losses = ", ".join(f"{v:.3f}" for v in r["losses"]) or "-"
        lines.append(f"| {r['side']} | {r['returncode']} | {r['oom_kills']} | {rss} | {losses} "
                     f"| {'fits' if r['fits'] else 'does not fit'}: {r['reason']} |")
    return "\n".join(lines) + "\n"


def run_all(args, say) -> dict:
    """Every side at ``--seq``, the idle rank, then the two caged runs at ``--long-seq``."""
    scratch = tempfile.mkdtemp(prefix="shardwise-cpmem-")
    sides = {}
    for name in args.sides:
        sides[name] = measure(name, args.seq, args.steps, args.run_seconds, scratch)
        r = sides[name]
        say(f"{name}: exit {r['returncode']}, peak RSS / rank "
            f"{[round(v / MiB) for v in r['peak_rss_per_rank']]} MiB, "
            f"{r.get('seconds_per_step', float('nan')):.1f} s/step, {r['wall_seconds']} s")
    idle = idle_rank(args.seq)
    say(f"idle rank: {idle['idle'] / MiB:,.0f} MiB (imports {idle['imports'] / MiB:,.0f} MiB)")
    caged_runs = []
    for name in ("one process", "cp 4 ring"):
        caged_runs.append(caged(name, args.long_seq, args.long_steps, args.limit,
                                args.run_seconds, scratch))
        say(f"caged {name} at {args.long_seq}: {caged_runs[-1]['reason']}")
    shutil.rmtree(scratch, ignore_errors=True)
    return {"sides": sides, "idle": idle, "caged": caged_runs,
            "figures": summarize(sides, idle)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--caged-rank"]:
        return join_cage_and_train(argv[1], argv[2:])
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.cp_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768, help="sequence of the measured sides")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES),
                    help="'one process' is needed (the ratios are to it)")
    ap.add_argument("--long-seq", type=int, default=65536, help="sequence of the caged runs")
    ap.add_argument("--long-steps", type=int, default=2)
    ap.add_argument("--limit", default="1.5GiB", help="memory limit per process, caged runs")
    ap.add_argument("--run-seconds", type=float, default=900.0, help="cap per run")
    ap.add_argument("--save", action="store_true", help="write to shardwise/bench/results/")
    ap.add_argument("--out", default="", help="folder for cp-memory.json (default: a temp dir)")
    ap.add_argument("--idle-rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.idle_rank:
        return idle_rank_main(args.seq)
    from shardwise.bench.largest_model import parse_bytes
    args.limit = parse_bytes(args.limit)
    began = time.time()
    res = run_all(args, lambda s: print(s, flush=True))
    from shardwise.bench.run import machine, results_dir
    res.update(seq=args.seq, long_seq=args.long_seq, limit=args.limit, model=MODEL, batch=1,
               steps=args.steps, long_steps=args.long_steps, run_seconds=args.run_seconds,
               machine=machine(), seconds=round(time.time() - began))
    res["table"] = table(res)
    print(res["table"])
    path = os.path.join(results_dir(args), "cp-memory.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
