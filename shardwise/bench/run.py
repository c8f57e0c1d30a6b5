"""Run benchmark rows: ours and the PyTorch peer alternately, medians and ratios to JSON.

    python -m shardwise.bench.run                     # every row
    python -m shardwise.bench.run single-vs-torch     # rows by name (or a family: 'foundation')
    python -m shardwise.bench.run --reps 5 --list

Results go to ``--out DIR`` (default: a fresh temporary folder, printed), one ``<row>.json``
each, and a line per row on stdout. ``--save`` writes them to shardwise/bench/results/ instead, over
the committed figures; only do that from a quiet machine when you mean to update them.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import statistics
import sys
import time

import torch

from shardwise.bench.harness import Row
from shardwise.testing import run_world

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def all_rows() -> dict[str, tuple[str, Row]]:
    import shardwise.bench.rows as pkg
    rows = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"shardwise.bench.rows.{info.name}")
        for row in getattr(module, "ROWS", []):
            rows[row.name] = (info.name, row)
    return rows


def _side(fn, world: int, args: dict) -> dict:
    def body(rank, n, args):
        from shardwise.bench.harness import peak_rss
        out = fn(rank, n, **args)
        out["peak_rss"] = peak_rss()
        return out
    results = run_world(body, world, args, timeout=1800)
    first = dict(results[0])
    first["peak_rss_per_rank"] = [r["peak_rss"] for r in results]
    return first


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit()}


def _commit() -> str | None:
    import subprocess
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def run_row(row: Row, reps: int) -> dict:
    ours, peer = [], []
    for _ in range(reps):  # A B A B ...: drift hits both sides alike
        ours.append(_side(row.ours, row.world, row.args))
        if row.peer is not None:
            peer.append(_side(row.peer, row.peer_world or row.world, row.args))
    out = {"row": row.name, "world": row.world, "reps": reps, "goal": row.goal,
           "peer": row.peer_name, "args": row.args, "machine": machine(),
           "ours": {"items_per_s": _median(ours, "items_per_s"),
                    "peak_rss_max_rank": statistics.median(max(r["peak_rss_per_rank"]) for r in ours),
                    "peak_mem": _median(ours, "peak_mem"), "bytes_sent": _median(ours, "bytes_sent"),
                    "extra": ours[-1].get("extra")},
           "runs": {"ours": [r["items_per_s"] for r in ours], "peer": [r["items_per_s"] for r in peer]}}
    if peer:
        out["peer_result"] = {"items_per_s": _median(peer, "items_per_s"),
                              "peak_rss_max_rank": statistics.median(max(r["peak_rss_per_rank"]) for r in peer),
                              "peak_mem": _median(peer, "peak_mem"), "bytes_sent": _median(peer, "bytes_sent"),
                              "extra": peer[-1].get("extra")}
        out["throughput_ratio"] = out["ours"]["items_per_s"] / out["peer_result"]["items_per_s"]
        out["peak_rss_ratio"] = out["ours"]["peak_rss_max_rank"] / out["peer_result"]["peak_rss_max_rank"]
        if out["ours"]["peak_mem"] and out["peer_result"]["peak_mem"]:
            out["peak_mem_ratio"] = out["ours"]["peak_mem"] / out["peer_result"]["peak_mem"]
    return out


def results_dir(args) -> str:
    """Where this invocation writes: --save = the committed folder, else --out or a temp dir."""
    if args.save and args.out:
        raise SystemExit("error: --save and --out both given; fix: use one of them")
    if args.save:
        out = RESULTS
    elif args.out:
        out = args.out
    else:
        import tempfile
        out = tempfile.mkdtemp(prefix="shardwise-bench-")
    os.makedirs(out, exist_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardwise bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="*", help="row names or families (module names); default: all")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    ap.add_argument("--out", default="", help="folder for the JSON results (default: a temp dir)")
    ap.add_argument("--save", action="store_true",
                    help="write to shardwise/bench/results/ (overwrites the committed figures)")
    args = ap.parse_args(argv)
    rows = all_rows()
    if args.list:
        for name, (family, row) in rows.items():
            print(f"{family:14s} {name:32s} world={row.world} peer={row.peer_name or '-'} goal={row.goal}")
        return 0
    chosen = [r for n, (fam, r) in rows.items() if not args.rows or n in args.rows or fam in args.rows]
    unknown = [n for n in args.rows if n not in rows and n not in {f for f, _ in rows.values()}]
    if unknown or args.reps < 1:
        print(f"error: unknown rows {unknown}; fix: see --list" if unknown else
              "error: --reps must be >= 1", file=sys.stderr)
        return 2
    out_dir = results_dir(args)
    print(f"results: {out_dir}", flush=True)
    for row in chosen:
        result = run_row(row, args.reps)
        with open(os.path.join(out_dir, f"{row.name}.json"), "w") as fh:
            json.dump(result, fh, indent=2)
        ratio = result.get("throughput_ratio")
        print(f"{row.name}: ours {result['ours']['items_per_s']:,.0f}/s"
              + (f", {row.peer_name} {result['peer_result']['items_per_s']:,.0f}/s, ratio {ratio:.3f}"
                 if ratio else "") + (f" (goal: {row.goal})" if row.goal else ""), flush=True)
    from shardwise.bench.report import write_report
    print(f"report: {write_report(out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
