"""Peak RSS per rank of ZeRO-3 replica groups once a group rejoins at another size (issue 34).

    MALLOC_MMAP_THRESHOLD_=131072 python -m shardwise.bench.ft_resize_memory --save

Two runs of ``shardwise train`` as a user types it (the launcher starts one torchrun per
group): the 57M GPT (8 x 768, 12 heads, byte vocabulary, sequence 128), ZeRO-3, AdamW fp32,
batch 12, ``--nproc-per-node 4 --ft-replicas 2`` (2 groups of 2 ranks), ``--steps`` steps,
``--dataset synthetic``, one thread per rank, ``MALLOC_MMAP_THRESHOLD_=131072`` (freed blocks of
128 KiB or more go back to the OS, so peak RSS tracks live bytes: shardwise/bench/memory.py):

- ``same sizes``: nothing fails; the groups sum shard by shard, lane by lane.
- ``back at 1 rank``: ``--ft-rejoin-nproc 1 --max-restarts 1``; group 1's rank 0 SIGKILLs itself
  at step ``--kill`` (the test hook ``SHARDWISE_FT_TEST_KILL``), the launcher restarts group 1
  with one rank, which rejoins; from then on the groups differ in size and every step takes
  the leaders' weighted sum of whole gradients (parallel/data/zero_resize.py).

Per run: each group's peak RSS per rank (``ru_maxrss``, from ``replica<G>/summary.json``; rank 0
of a group is its leader). What can fail: with groups of different sizes a ZeRO rank holding the
whole gradient and the lane's fp32 flat carries about 2 x 4P more bytes (P = 57M: 0.42 GiB);
only the leader should, so group 0's rank 1 should peak where it peaks with same sizes. The
JSON carries the commit, the dirty flag, the date and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from shardwise.config.names import Strategy

MODEL = ["--n-layer", "8", "--n-embd", "768", "--n-head", "12", "--block-size", "128"]
MiB = 2 ** 20


def train_args(steps: int, out_dir: str, name: str, resize: bool) -> list[str]:
    args = [sys.executable, "-m", "shardwise.cli", "train", *MODEL, "--strategy", Strategy.ZERO3,
            "--dataset", "synthetic", "--batch-size", "12", "--steps", str(steps),
            "--eval-every", "0", "--device", "cpu", "--no-progress", "--log-every", "1",
            "--nproc-per-node", "4", "--ft-replicas", "2", "--collective-timeout", "120",
            "--out-dir", out_dir, "--run-name", name]
    if resize:
        args += ["--ft-rejoin-nproc", "1", "--max-restarts", "1"]
    return args


def run(name: str, steps: int, kill: int, away: int, resize: bool, scratch: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    if resize:
        env["SHARDWISE_FT_TEST_KILL"] = f"1:{kill}:{away}"
    began = time.time()
    done = subprocess.run(train_args(steps, scratch, name, resize), env=env,
                          capture_output=True, text=True, timeout=1800)
    out = {"returncode": done.returncode, "wall_seconds": round(time.time() - began),
           "groups": {}}
    if done.returncode != 0:
        out["stderr"] = done.stderr[-2000:]
    for g in (0, 1):
        path = os.path.join(scratch, name, f"replica{g}", "summary.json")
        if os.path.exists(path):
            with open(path) as fh:
                summary = json.load(fh)
            out["groups"][g] = {"peak_rss_per_rank": summary.get("peak_memory_per_rank"),
                                "start_step": summary.get("start_step"),
                                "steps": len(summary.get("losses") or [])}
    return out


def table(res: dict) -> str:
    rows = ["| run | group 0 rank 0 (leader) | group 0 rank 1 | group 1 | exit | wall s |",
            "|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        g0 = (r["groups"].get("0") or r["groups"].get(0) or {}).get("peak_rss_per_rank") or []
        g1 = (r["groups"].get("1") or r["groups"].get(1) or {}).get("peak_rss_per_rank") or []
        cell = lambda v: f"{v / MiB:,.0f} MiB"     # noqa: E731
        rows.append(f"| {name} | {cell(g0[0]) if g0 else '-'} | "
                    f"{cell(g0[1]) if len(g0) > 1 else '-'} | "
                    f"{' / '.join(cell(v) for v in g1) or '-'} | {r['returncode']} | "
                    f"{r['wall_seconds']} |")
    f = res["figures"]
    rows.append("")
    rows.append(f"Group 0's peak RSS, back at 1 rank minus same sizes: leader "
                f"{f['leader_delta'] / MiB:+,.0f} MiB, rank 1 {f['rank1_delta'] / MiB:+,.0f} MiB "
                f"(2 x 4P = {f['two_copies'] / MiB:,.0f} MiB, P = {f['parameters']:,}).")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.ft_resize_memory",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--kill", type=int, default=3, help="the step group 1's rank 0 dies at")
    ap.add_argument("--away", type=int, default=2, help="rounds the restart waits")
    ap.add_argument("--save", action="store_true", help="write to shardwise/bench/results/")
    ap.add_argument("--out", default="", help="folder for ft-resize-memory.json")
    args = ap.parse_args(argv)
    began = time.time()
    scratch = tempfile.mkdtemp(prefix="shardwise-ftmem-")
    runs = {}
    for name, resize in (("same sizes", False), ("back at 1 rank", True)):
        runs[name] = run(name.replace(" ", "-"), args.steps, args.kill, args.away, resize,
                         scratch)
        print(f"{name}: {json.dumps(runs[name]['groups'])}", flush=True)
    from shardwise.bench.harness import gpt_bench_config, parameters
    p = parameters(gpt_bench_config(Strategy.ZERO3, model={"n_layer": 8, "n_embd": 768,
                                                    "n_head": 12}))
    same = runs["same sizes"]["groups"][0]["peak_rss_per_rank"]
    back = runs["back at 1 rank"]["groups"][0]["peak_rss_per_rank"]
    from shardwise.bench.run import machine, results_dir
    res = {"runs": runs, "steps": args.steps, "kill": args.kill, "away": args.away,
           "figures": {"leader_delta": back[0] - same[0], "rank1_delta": back[1] - same[1],
                       "two_copies": 2 * 4 * p, "parameters": p},
           "machine": machine(), "seconds": round(time.time() - began)}
    res = json.loads(json.dumps(res))          # group ids as the file has them
    res["table"] = table(res)
    print(res["table"])
    path = os.path.join(results_dir(args), "ft-resize-memory.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"results: {path}")
    return 0 if all(r["returncode"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
