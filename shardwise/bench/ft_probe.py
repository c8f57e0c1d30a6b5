"""Replica groups under fire: a random group SIGKILLed every 50 steps (``ft-probe``).

    python -m shardwise.bench.ft_probe --save        # A B A B, about 8 minutes on 2 cores

Every run is ``shardwise train`` as a user types it (a subprocess): DDP over 3 replica groups of
one rank (``--nproc-per-node 3 --ft-replicas 3 --max-restarts 6``), shardwise's GPT (4 x 256,
4 heads, byte vocabulary, sequence 128), the stdlib text, global batch 24, AdamW, 300 steps,
``OMP_NUM_THREADS=1``. Two sides, alternated (A B A B with ``--reps 2``) so that drift in a
shared machine's speed hits both:

* **A (kills)**: this process is the killer, from outside. At steps 50, 100, ..., 250 it waits
  until the slowest *live* group (its newest process joined and has stepped since, and is
  alive) has committed that step (its ``metrics.jsonl``), picks one of the live groups with a
  seeded ``random.Random`` and SIGKILLs that group's rank process (the pid of its newest
  ``start`` event in ``ft.jsonl``). It never kills the last live group (that would lose the
  state): with one live group it waits for a rejoin. Once the process is dead it copies the
  group's ``metrics.jsonl`` into ``<run>/probe/`` (the restarted process rewrites that file).
* **B (no kills)**: the same command.

From the files only (:func:`account`), per group, a *life* is one process: its ``join`` step J
(ft.jsonl) and the step numbers of its metrics records (``--log-every 1``: one record per
committed step).

* **steps completed**: the last step of the group's newest life (goal: 300 for every group).
* **steps lost**: in each life, a step recorded twice, a step at or before its join step, or a
  step missing between J + 1 and its last record; across lives, the steps by which a rejoin went
  back behind the last step of the life before (taken twice by that group); and the steps from
  1 to the furthest completed step that no group recorded. Goal 0. The steps a killed group
  misses between its last record and its rejoin step are not lost: the live groups took them
  (the data rule gives every step the whole global batch: parallel/replicas.py).
* **kills, rejoins**: the killer's kills; a rejoin is a ``join`` event of a restarted process,
  and a kill's rejoin step is its group's first join after the kill. Restarts that no kill
  caused (a group left out of a quorum) are counted apart.
* **throughput**: 300 x batch x sequence tokens over the training window (the first group's
  join at step 0 to the last write of a ``metrics.jsonl``), and over the command's wall time.
  Ratio A / B of the medians, and its range over every pairing of runs (the noise).
* **bit-identical**: the three groups' ``final.safetensors`` tensor by tensor; and across runs,
  a sha256 of the final weights (a run with kills against one without).
* **steps without a group**: per kill, its rejoin step less the step the kill came after: the
  steps the survivors took with fewer groups (0 when the restart registers for the quorum's
  round before the dead process's heartbeat goes stale; the survivors then wait for it).
* **stall**: per kill, the survivors' longest step among the 5 after the kill (a dead peer is
  declared after its heartbeat stood still for comm/quorum.STALE_S).

The JSON carries the commit, the dirty flag, the date, the machine and its load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from shardwise.config.names import Strategy

STEPS, EVERY, GROUPS, POLL = 300, 50, 3, 0.05
MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 128}
BATCH = 24                # a multiple of lcm(1, 2, 3) = 6: equal shares for 1, 2 or 3 live groups
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_args(steps: int, out_dir: str, name: str) -> list[str]:
    """``shardwise train`` flags of both sides (what follows ``python -m shardwise.cli``)."""
    model = [a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return ["train", "--strategy", Strategy.DDP, "--nproc-per-node", str(GROUPS),
            "--ft-replicas", str(GROUPS), "--max-restarts", "6", "--collective-timeout", "60",
            *model, "--dataset", "stdlib", "--max-bytes", "400000", "--batch-size", str(BATCH),
            "--lr", "1e-3", "--warmup-steps", "10", "--steps", str(steps), "--eval-every", "0",
            "--eval-batches", "1", "--log-every", "1", "--no-progress", "--device", "cpu",
            "--out-dir", out_dir, "--run-name", name]


# -- reading a run's files --------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """The whole lines of a JSONL file that may be being written (a torn last line is skipped)."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


def group_dir(run: str, g: int) -> str:
    return os.path.join(run, f"replica{g}")


def read_events(run: str, g: int) -> list[dict]:
    """Group g's ft.jsonl events, as its rank 0 wrote them."""
    return [e for e in read_jsonl(os.path.join(group_dir(run, g), "ft.jsonl"))
            if e.get("rank", 0) == 0]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (torchrun reaps its dead rank a moment later)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def newest_life(run: str, g: int) -> dict | None:
    """Group g's newest process: pid, its join step (None before it joined), its last step
    since the join (None before its first committed step), and whether it is alive."""
    events = read_events(run, g)
    starts = [e for e in events if e["event"] == "start"]
    if not starts:
        return None
    pid = starts[-1]["pid"]
    joins = [e["step"] for e in events if e["event"] == "join" and e["pid"] == pid]
    joined = joins[-1] if joins else None
    steps = [r["step"] for r in read_jsonl(os.path.join(group_dir(run, g), "metrics.jsonl"))]
    last = max((s for s in steps if joined is not None and s > joined), default=None)
    return {"pid": pid, "joined": joined, "last": last, "alive": alive(pid), "life": len(starts) - 1}


# -- the killer ---------------------------------------------------------------------------------
def kill_group(run: str, g: int, life: dict) -> dict:
    """SIGKILL group g's rank process; once it is dead, keep its metrics.jsonl in <run>/probe/."""
    os.kill(life["pid"], signal.SIGKILL)
    killed = time.time()
    while alive(life["pid"]) and time.time() - killed < 10:
        time.sleep(0.01)
    kept = f"replica{g}.life{life['life']}.metrics.jsonl"
    os.makedirs(os.path.join(run, "probe"), exist_ok=True)
    shutil.copy(os.path.join(group_dir(run, g), "metrics.jsonl"), os.path.join(run, "probe", kept))
    return {"group": g, "pid": life["pid"], "time": killed, "kept": kept}


def killer(run: str, proc: subprocess.Popen, targets: list[int], seed: int) -> list[dict]:
    """Kill a random live group once the slowest live group has committed each target step."""
    rng, kills, pending = random.Random(seed), [], list(targets)
    while pending and proc.poll() is None:
        lives = {g: newest_life(run, g) for g in range(GROUPS)}
        live = {g: v for g, v in lives.items() if v and v["alive"] and v["last"] is not None}
        if len(live) >= 2 and min(v["last"] for v in live.values()) >= pending[0]:
            g = rng.choice(sorted(live))
            kills.append({"target": pending.pop(0), **kill_group(run, g, live[g]),
                          "step_seen": min(v["last"] for v in live.values()),
                          "live": sorted(live)})
        time.sleep(POLL)
    return kills


# -- accounting (pure: from the files' contents) -----------------------------------------------
def _life(records: list[dict], join: int) -> tuple[int, int]:
    """(steps lost inside one life, its last step)."""
    steps = [r["step"] for r in records]
    end = max(steps, default=join)
    twice = len(steps) - len(set(steps)) + sum(1 for s in set(steps) if s <= join)
    missing = len(set(range(join + 1, end + 1)) - set(steps))
    return twice + missing, end


def account(steps: int, groups: dict[int, dict], kills: list[dict]) -> dict:
    """The probe's figures from each group's ``events`` (ft.jsonl) and ``lives`` (one
    ``(pid, metrics records)`` per process, oldest first); module docstring."""
    out = {"completed": {}, "lost": {}, "rejoins": {}, "restarts": {}, "unexplained_restarts": 0}
    seen: set[int] = set()
    for g, data in sorted(groups.items()):
        events = data["events"]
        joins = {e["pid"]: e["step"] for e in events if e["event"] == "join"}
        first = next(e["pid"] for e in events if e["event"] == "start")
        lost, prev = 0, None
        for pid, records in data["lives"]:
            join = joins.get(pid, 0)
            if prev is not None:
                lost += max(0, prev - join)        # a rejoin behind its own last step
            n, prev = _life(records, join)
            lost += n
            seen |= {r["step"] for r in records}
        out["completed"][g], out["lost"][g] = prev or 0, lost
        out["rejoins"][g] = [{"step": e["step"], "time": e["time"], "pid": e["pid"]}
                             for e in events if e["event"] == "join" and e["pid"] != first]
        out["restarts"][g] = sum(1 for e in events if e["event"] == "start" and e["restart"] > 0)
        out["unexplained_restarts"] += max(0, out["restarts"][g] - sum(
            1 for k in kills if k["group"] == g))
    furthest = max(out["completed"].values(), default=0)
    out["uncovered"] = len(set(range(1, furthest + 1)) - seen)
    out["steps_lost"] = sum(out["lost"].values()) + out["uncovered"]
    out["kills"] = [_rejoin_of(k, out["rejoins"][k["group"]], groups) for k in kills]
    return out


def _rejoin_of(kill: dict, rejoins: list[dict], groups: dict[int, dict]) -> dict:
    """The kill with its group's first rejoin after it, and the survivors' longest step among
    the 5 after the kill's step (the stall while the dead peer is found out)."""
    after = [r for r in rejoins if r["time"] > kill["time"]]
    back = after[0] if after else None
    near = [r["step_seconds"] for g, d in groups.items() if g != kill["group"]
            for _, records in d["lives"] for r in records
            if kill["step_seen"] < r["step"] <= kill["step_seen"] + 5 and "step_seconds" in r]
    return {**kill, "rejoin_step": back["step"] if back else None,
            "rejoin_seconds": round(back["time"] - kill["time"], 2) if back else None,
            "stall_seconds": round(max(near), 2) if near else None}


def load_groups(run: str, kills: list[dict]) -> dict[int, dict]:
    """Each group's events and lives: the killed processes' kept metrics, then the newest's."""
    out = {}
    for g in range(GROUPS):
        lives = [(k["pid"], read_jsonl(os.path.join(run, "probe", k["kept"])))
                 for k in kills if k["group"] == g]
        events = read_events(run, g)
        newest = [e["pid"] for e in events if e["event"] == "start"][-1]
        lives.append((newest, read_jsonl(os.path.join(group_dir(run, g), "metrics.jsonl"))))
        out[g] = {"events": events, "lives": lives}
    return out


def final_weights(run: str) -> tuple[bool, str | None]:
    """(every group's final.safetensors equal to group 0's tensor by tensor, a sha256 of
    group 0's tensors by name: equal digests across runs = the same final weights)."""
    import hashlib
    import torch
    from safetensors.torch import load_file
    try:
        params = [load_file(os.path.join(group_dir(run, g), "final.safetensors"))
                  for g in range(GROUPS)]
    except (FileNotFoundError, OSError):
        return False, None
    same = all(p.keys() == params[0].keys() and all(torch.equal(p[k], params[0][k]) for k in p)
               for p in params[1:])
    digest = hashlib.sha256()
    for name in sorted(params[0]):
        digest.update(name.encode() + params[0][name].contiguous().view(torch.uint8).numpy().tobytes())
    return same, digest.hexdigest()


def train_window(groups: dict[int, dict], run: str) -> float:
    """Seconds from the first join at step 0 to the last write of a metrics.jsonl."""
    begin = min(e["time"] for d in groups.values() for e in d["events"]
                if e["event"] == "join" and e["step"] == 0)
    end = max(os.path.getmtime(os.path.join(group_dir(run, g), "metrics.jsonl")) for g in groups)
    return end - begin


# -- one run, all runs --------------------------------------------------------------------------
def run_env(pace: float) -> dict:
    """This checkout first on the path (torchrun's ranks import this code); one thread a rank;
    the step pace (parallel/replicas.ENV_PACE) when one is asked for."""
    from shardwise.parallel.replicas import ENV_PACE
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env.pop(ENV_PACE, None)
    return {**env, ENV_PACE: str(pace)} if pace else env


def run_side(side: str, rep: int, args, scratch: str) -> dict:
    """One ``shardwise train`` run, with the killer for side ``kills``; its figures."""
    name = f"{side.replace(' ', '-')}-{rep}"
    run = os.path.join(scratch, name)
    cmd = [sys.executable, "-m", "shardwise.cli", *train_args(args.steps, scratch, name)]
    targets = list(range(args.every, args.steps, args.every)) if side == "kills" else []
    load, began = os.getloadavg()[0], time.time()
    with open(run + ".log", "w") as log:
        proc = subprocess.Popen(cmd, env=run_env(args.pace), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            kills = killer(run, proc, targets, args.seed + rep) if targets else []
            proc.wait(timeout=max(1.0, args.run_seconds - (time.time() - began)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.time() - began
    groups = load_groups(run, kills)
    acc = account(args.steps, groups, kills)
    window = train_window(groups, run)
    tokens = max(acc["completed"].values()) * BATCH * MODEL["block_size"]
    same, digest = final_weights(run)
    finals = [read_json(os.path.join(group_dir(run, g), "summary.json")).get("final_loss")
              for g in range(GROUPS)]
    return {"side": side, "rep": rep, "returncode": proc.returncode, "load_before": round(load, 2),
            "wall_seconds": round(wall, 1), "train_seconds": round(window, 1),
            "tokens": tokens, "tokens_per_s": tokens / window, "tokens_per_s_wall": tokens / wall,
            "bit_identical": same, "weights_sha256": digest, "final_loss": finals,
            **{k: v for k, v in acc.items() if k != "rejoins"},
            "rejoins": sum(len(v) for v in acc["rejoins"].values())}


def read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def summarize(runs: list[dict]) -> dict:
    """Medians per side, the ratio kills / no kills and its range over every pairing of runs."""
    a = [r["tokens_per_s"] for r in runs if r["side"] == "kills"]
    b = [r["tokens_per_s"] for r in runs if r["side"] == "no kills"]
    pairs = [x / y for x in a for y in b]
    killed = [r for r in runs if r["side"] == "kills"]
    return {"tokens_per_s_kills": statistics.median(a), "tokens_per_s_no_kills": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b),
            "ratio_min": min(pairs), "ratio_max": max(pairs),
            "steps_lost": sum(r["steps_lost"] for r in runs),
            "completed_min": min(min(r["completed"].values()) for r in runs),
            "kills": sum(len(r["kills"]) for r in killed),
            "rejoins": sum(r["rejoins"] for r in killed),
            "all_bit_identical": all(r["bit_identical"] for r in runs),
            "steps_without_a_group": sum(k["rejoin_step"] - k["step_seen"] for r in killed
                                         for k in r["kills"] if k["rejoin_step"] is not None),
            "same_weights_as_no_kills": len({r["weights_sha256"] for r in runs}) == 1}


def table(res: dict) -> str:
    """The markdown table of the runs, then the ratio line."""
    rows = ["| run | steps completed (groups 0 / 1 / 2) | steps lost | kills: after step, group "
            "-> rejoined at step (s after the kill; survivors' longest step, s) | training s | "
            "tokens/s | wall s | replicas bit-identical |", "|---|---|---:|---|---:|---:|---:|---|"]
    for r in res["runs"]:
        kills = "; ".join(f"{k['step_seen']}: g{k['group']} -> {k['rejoin_step']} "
                          f"({k['rejoin_seconds']}; {k['stall_seconds']})" for k in r["kills"])
        done = " / ".join(str(r["completed"][g]) for g in sorted(r["completed"]))
        rows.append(f"| {r['side']} {r['rep'] + 1} | {done} | {r['steps_lost']} | {kills or '-'} "
                    f"| {r['train_seconds']:.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['wall_seconds']:.1f} | {'yes' if r['bit_identical'] else 'no'} |")
    f = res["figures"]
    rows.append("")
    rows.append(f"Throughput with kills / without: {f['ratio']:.3f} (medians; "
                f"{f['ratio_min']:.3f} to {f['ratio_max']:.3f} over every pairing of runs); "
                f"{f['kills']} kills, {f['rejoins']} rejoins, {f['steps_lost']} steps lost, "
                f"{f['steps_without_a_group']} steps taken by the survivors without a killed group; "
                "final weights of every run (kills or not) bit-identical: "
                f"{'yes' if f['same_weights_as_no_kills'] else 'no'}.")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.ft_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--every", type=int, default=EVERY, help="kill a group every this many steps")
    ap.add_argument("--reps", type=int, default=2, help="pairs of runs, alternated: A B A B")
    ap.add_argument("--seed", type=int, default=0, help="the killer's RNG (plus the rep)")
    ap.add_argument("--pace", type=float, default=0.0, help="least seconds a step (both sides)")
    ap.add_argument("--run-seconds", type=float, default=600.0, help="cap per run")
    ap.add_argument("--save", action="store_true", help="write to shardwise/bench/results/")
    ap.add_argument("--out", default="", help="folder for ft-probe.json (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders")
    args = ap.parse_args(argv)
    from shardwise.bench.run import machine, results_dir
    where = machine()                                 # commit and dirty flag, before the run
    scratch, began, runs = tempfile.mkdtemp(prefix="shardwise-ft-probe-"), time.time(), []
    for rep in range(args.reps):
        for side in ("kills", "no kills"):
            runs.append(run_side(side, rep, args, scratch))
            r = runs[-1]
            print(f"{side} {rep + 1}: exit {r['returncode']}, completed {r['completed']}, lost "
                  f"{r['steps_lost']}, kills {len(r['kills'])}, rejoins {r['rejoins']}, "
                  f"{r['tokens_per_s']:,.0f} tok/s over {r['train_seconds']} s", flush=True)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    res = {"command": "shardwise " + " ".join(train_args(args.steps, "DIR", "NAME")),
           "steps": args.steps, "every": args.every, "seed": args.seed, "pace": args.pace,
           "model": MODEL, "batch_size": BATCH, "groups": GROUPS, "runs": runs,
           "figures": summarize(runs), "machine": where, "seconds": round(time.time() - began)}
    res["table"] = table(res)
    print(res["table"])
    path = os.path.join(results_dir(args), "ft-probe.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"results: {path}" + (f"; runs kept in {scratch}" if args.keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
