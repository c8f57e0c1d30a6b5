"""Run benchmark rows: ours and the PyTorch peer alternately, medians and ratios to JSON, then
REPORT.md and its charts (shardwise.bench.report) in the same folder.

    shardwise bench --quick                         # one row or more per family, 2 reps (< 10 min)
    shardwise bench                                 # every row, 3 reps
    shardwise bench --rows 'zero3-*,ps'             # globs over row names and family names
    shardwise bench single-vs-torch --reps 5        # rows by name (or a family: 'foundation')
    shardwise bench --list

Results go to ``--out DIR`` (default: a fresh temporary folder, printed), one ``<row>.json``
each, and a line per row on stdout. ``--save`` writes them to shardwise/bench/results/ instead,
over the committed figures; only do that from a quiet machine when you mean to update them.
On a machine with CUDA the run ends with the single-GPU part (shardwise/bench/gpu.py, family
``gpu``); on CPU it says in one line that it skipped it.
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import importlib
import json
import os
import pkgutil
import platform
import statistics
import sys
import time

import torch

from shardwise.bench.harness import RESULTS, Row
from shardwise.launch.world import run_world


# --quick: every family at least once (single, ddp with world 1/2/4, zero1/2/3 and one 57M memory
# row, tp, pp, a composed layout, the three ps modes with a straggler, the ring), 2 reps.
QUICK = ("single-vs-torch", "single-defaults-vs-torch-defaults", "ddp-vs-torch-ddp-w1", "ddp-vs-torch-ddp", "ddp-vs-torch-ddp-w4",
         "zero1-vs-torch-zero", "zero2-vs-fsdp2", "zero3-vs-fsdp2", "zero3-memory-57m-vs-fsdp2",
         "mp-tp-vs-dtensor", "mp-pp-1f1b-vs-torch", "compose-zero3-tp-vs-fsdp2-tp",
         "ps-sync-straggler3x", "ps-async-straggler3x", "ps-ssp2-straggler3x", "ring-busbw-w2",
         "hf-llama-tp-vs-dtensor", "cp-ring-vs-ulysses-long")
QUICK_REPS = 2


def all_rows() -> dict[str, tuple[str, Row]]:
    import shardwise.bench.rows as pkg
    rows = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"shardwise.bench.rows.{info.name}")
        for row in getattr(module, "ROWS", []):
            rows[row.name] = (info.name, row)
    return rows


def select(rows: dict[str, tuple[str, Row]], patterns: list[str]) -> tuple[list[Row], list[str]]:
    """The rows whose name or family matches one of ``patterns`` (fnmatch globs), in listing
    order, and the patterns that matched nothing. No patterns: every row."""
    if not patterns:
        return [r for _, r in rows.values()], []
    hit = lambda pat, name, fam: fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(fam, pat)
    chosen = [r for n, (fam, r) in rows.items() if any(hit(p, n, fam) for p in patterns)]
    unmatched = [p for p in patterns if not any(hit(p, n, f) for n, (f, _) in rows.items())]
    return chosen, unmatched


def _side(fn, world: int, args: dict, allocator: str = "auto") -> dict:
    """One run of one side of a row in a world of ``world``; ``allocator``: the CPU heap its
    ranks start with (run/allocator.py: ``auto`` as train.cpu_allocator's default, or
    ``system``, glibc as it is; our side's init_runtime applies its config's own)."""
    def body(rank, n, args):
        import torch

        from shardwise.bench.harness import peak_rss
        from shardwise.run.allocator import configure
        heap = configure(allocator, torch.device("cpu"))
        out = fn(rank, n, **args)
        out["peak_rss"] = peak_rss()
        out["cpu_allocator"] = heap
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
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(), "dirty": dirty(),
            "load": [round(x, 2) for x in os.getloadavg()],
            # glibc's allocator settings change a step's time (bench/malloc_cost.py) and RSS
            "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}


@functools.lru_cache(maxsize=1)
def dirty() -> bool | None:
    """Whether the checkout had uncommitted changes to tracked files, results folders
    (RESULT_PATHS) aside, when this process first asked;
    SHARDWISE_DIRTY=0/1 when a copy of the tree says so itself; None where no git answers."""
    if os.environ.get("SHARDWISE_DIRTY") in ("0", "1"):
        return os.environ["SHARDWISE_DIRTY"] == "1"
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no",
                               "--", ".", *(f":(exclude){p}" for p in RESULT_PATHS)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() != "" if done.returncode == 0 else None


RESULT_PATHS = ("shardwise/bench/results", "docs/bench")
"""Where runs write their results: a changed result is not a change to the code that ran."""


def commit(folder: str | None = None) -> str | None:
    """The HEAD commit (short) of the checkout holding ``folder`` (default: this package), read
    from .git's files (no git binary), in a plain checkout or a ``git worktree``; None when
    the package does not sit in a git checkout (an installed wheel). SHARDWISE_COMMIT wins when
    set: a copy of the tree on another machine says which commit it is (its .git, if any, may
    be stale)."""
    if os.environ.get("SHARDWISE_COMMIT"):
        return os.environ["SHARDWISE_COMMIT"]
    try:
        dirs = _git_dirs(folder or os.path.dirname(os.path.abspath(__file__)))
        if dirs is None:
            return None
        git, common = dirs
        head = open(os.path.join(git, "HEAD")).read().strip()
        if not head.startswith("ref: "):
            return head[:7] or None
        ref = head[5:]
        for where in (git, common):          # a worktree's branches live in the common dir
            path = os.path.join(where, ref)
            if os.path.exists(path):
                return open(path).read().strip()[:7] or None
        with open(os.path.join(common, "packed-refs")) as fh:
            for line in fh:
                if line.rstrip().endswith(" " + ref):
                    return line.split()[0][:7]
    except OSError:
        pass
    return None


def _git_dirs(folder: str) -> tuple[str, str] | None:
    """(git dir, common dir) of the checkout holding ``folder``: ``.git`` is the folder in a
    plain checkout; in a ``git worktree`` it is a file ``gitdir: PATH`` whose ``commondir``
    names the main checkout's git dir (where branches and packed-refs are)."""
    while True:
        dot = os.path.join(folder, ".git")
        if os.path.isdir(dot):
            return dot, dot
        if os.path.isfile(dot):
            line = open(dot).read().strip()
            if not line.startswith("gitdir: "):
                return None
            git = os.path.join(folder, line[len("gitdir: "):])
            common = os.path.join(git, "commondir")
            if os.path.isfile(common):
                return git, os.path.normpath(os.path.join(git, open(common).read().strip()))
            return git, git
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _summary(runs: list[dict]) -> dict:
    return {"items_per_s": _median(runs, "items_per_s"),
            "peak_rss_max_rank": statistics.median(max(r["peak_rss_per_rank"]) for r in runs),
            "peak_rss_per_rank": runs[-1]["peak_rss_per_rank"],
            "peak_mem": _median(runs, "peak_mem"), "bytes_sent": _median(runs, "bytes_sent"),
            "extra": runs[-1].get("extra"), "cpu_allocator": runs[-1].get("cpu_allocator")}


def run_row(row: Row, reps: int, quick: bool = False) -> dict:
    """``reps`` alternating runs of the row's two sides (``quick``: its quick_args too)."""
    args = {**row.args, **row.quick_args} if quick else row.args
    ours, peer = [], []
    t0 = time.perf_counter()
    start = machine()
    for _ in range(reps):  # A B A B ...: drift hits both sides alike
        ours.append(_side(row.ours, row.world, args))
        if row.peer is not None:
            peer.append(_side(row.peer, row.peer_world or row.world, args, row.peer_allocator))
    out = {"row": row.name, "world": row.world, "peer_world": row.peer_world or row.world,
           "reps": reps, "quick": quick, "goal": row.goal, "series": row.series,
           "peer": row.peer_name, "args": args, "machine": start, "ours": _summary(ours),
           "runs": {"ours": [r["items_per_s"] for r in ours], "peer": [r["items_per_s"] for r in peer]}}
    if peer:
        out["peer_result"] = _summary(peer)
        out["throughput_ratio"] = out["ours"]["items_per_s"] / out["peer_result"]["items_per_s"]
        out["peak_rss_ratio"] = out["ours"]["peak_rss_max_rank"] / out["peer_result"]["peak_rss_max_rank"]
        if out["ours"]["peak_mem"] and out["peer_result"]["peak_mem"]:
            out["peak_mem_ratio"] = out["ours"]["peak_mem"] / out["peer_result"]["peak_mem"]
    out["seconds"] = time.perf_counter() - t0
    return out


def results_dir(args) -> str:
    """Where this invocation writes: --save = the committed folder, else --out or a temp dir."""
    if args.save:
        out = RESULTS
    elif args.out:
        out = args.out
    else:
        import tempfile
        out = tempfile.mkdtemp(prefix="shardwise-bench-")
    os.makedirs(out, exist_ok=True)
    return out


def _refuse(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def parser() -> argparse.ArgumentParser:
    """``shardwise bench``'s options (also the docs' CLI reference: scripts/gen_docs.py)."""
    ap = argparse.ArgumentParser(prog="shardwise bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="ROW",
                    help="row names or families (globs allowed); default: all")
    ap.add_argument("--rows", default="", metavar="PATTERN",
                    help="comma-separated globs over row names and family names, e.g. 'zero3-*,ps'")
    ap.add_argument("--quick", action="store_true",
                    help=f"a subset covering every family, {QUICK_REPS} reps (see --list)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"alternating repetitions (default 3; {QUICK_REPS} with --quick)")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    ap.add_argument("--out", default="", help="folder for the JSON results and REPORT.md "
                    "(default: a fresh temp dir)")
    ap.add_argument("--save", action="store_true",
                    help="write to shardwise/bench/results/ (overwrites the committed figures)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    dirty()          # the tree as it was before this run writes any result (cached)
    rows = all_rows()
    if args.list:
        return _list(rows)
    if args.save and args.out:
        return _refuse("--save and --out both given; fix: use one of them")
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else 3)
    if reps < 1:
        return _refuse(f"--reps is {reps}, must be >= 1; fix: --reps 2")
    patterns = list(args.names) + [p.strip() for p in args.rows.split(",") if p.strip()]
    gpu_asked = any(fnmatch.fnmatchcase("gpu", p) or fnmatch.fnmatchcase("gpu-single", p)
                    for p in patterns)
    chosen, unmatched = select(rows, [p for p in patterns if p not in ("gpu", "gpu-single")])
    if unmatched:
        return _refuse(f"--rows: {', '.join(unmatched)} matches no row or family; "
                       "fix: see 'shardwise bench --list'")
    if args.quick:
        missing = [n for n in QUICK if n not in rows]
        if missing:
            return _refuse(f"--quick names rows that do not exist: {missing}; fix: update "
                           "shardwise/bench/run.py QUICK")
        chosen = [r for r in chosen if r.name in QUICK] if patterns else [rows[n][1] for n in QUICK]
    if patterns and not chosen and not gpu_asked:
        return _refuse("--quick with that pattern selects no row; fix: drop --quick or widen it")
    out_dir = results_dir(args)
    print(f"results: {out_dir} ({len(chosen)} rows, {reps} reps, load "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    started = time.perf_counter()
    failed = []
    for row in chosen:
        if not _run_and_write(row, reps, args.quick, out_dir):
            failed.append(row.name)
    gpu = None
    if not patterns or gpu_asked:
        from shardwise.bench.gpu import run_gpu_part
        gpu = run_gpu_part(out_dir, quick=args.quick)
    print(f"total: {time.perf_counter() - started:.0f} s")
    ran = [r for r in chosen if r.name not in failed]
    if not ran and gpu is None:
        print("report: none (no row ran)")
    else:
        from shardwise.bench.report import write_report
        print(f"report: {write_report(out_dir)}")
    if failed:
        print(f"error: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _list(rows) -> int:
    for name, (family, row) in rows.items():
        mark = " [quick]" if name in QUICK else ""
        print(f"{family:14s} {name:32s} world={row.world} peer={row.peer_name or '-'} "
              f"goal={row.goal}{mark}")
    print(f"{'gpu':14s} {'gpu-single':32s} world=1 (CUDA machines only; shardwise/bench/gpu.py)")
    return 0


def _run_and_write(row, reps: int, quick: bool, out_dir: str) -> bool:
    """Run one row, write ``<row>.json`` and print its line; False (and one line) if a rank
    failed, so the other rows still run."""
    try:
        result = run_row(row, reps, quick=quick)
    except (RuntimeError, TimeoutError) as exc:
        print(f"{row.name}: failed, no result written: {_last_error(exc)}", file=sys.stderr,
              flush=True)
        return False
    with open(os.path.join(out_dir, f"{row.name}.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    ratio = result.get("throughput_ratio")
    print(f"{row.name}: ours {result['ours']['items_per_s']:,.0f}/s"
          + (f", {row.peer_name} {result['peer_result']['items_per_s']:,.0f}/s, ratio {ratio:.3f}"
             if ratio else "") + (f" (goal: {row.goal})" if row.goal else "")
          + f" [{result['seconds']:.0f} s]", flush=True)
    return True


def _last_error(exc: BaseException) -> str:
    """The last line of a failed rank's traceback (the error itself), or the exception's."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(("File ", "Traceback", "---", "^"))]
    return (errors[-1] if errors else type(exc).__name__)[:300]


if __name__ == "__main__":
    sys.exit(main())
