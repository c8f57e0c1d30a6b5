"""The hang report: which rank is behind, in which collective, at which step.

When a rank's collective times out (a peer stalled or died), that rank prints its one error
line and leaves a marker (``flight/failed-rank-<r>.json``: :func:`mark_failed`). The launcher
(torchrun.py), seeing the error, reads every rank's flight record (comm/flight.py) while the
ranks are still there, with each rank's process state (``/proc/<pid>/stat``: stopped, gone or
running), and writes the report to ``<run dir>/flight/report.txt`` before it ends the run; it
prints it after the run's error line. ``shardwise doctor RUN_DIR`` prints it again (or, when the
launcher could not write it, builds it from the records alone).

Who is behind, in this order:
1. a rank whose process is stopped (SIGSTOP, a debugger);
2. a rank in flight in another collective (operation, size, group) than the others at the
   same sequence number: it skipped a collective, or ran them in another order (gloo may
   notice the mismatch itself and end that rank: the report says so);
3. a rank whose process is gone without a timeout of its own (killed, crashed);
4. the rank with the lowest last completed sequence number that is not itself waiting in a
   collective (it is computing, or stuck outside the collectives).
Sequence numbers count each rank's collectives in program order, so ranks that run the same
program (data parallelism, ZeRO) agree on them; pipeline stages' sends differ by design and
are compared by operation only.
"""
from __future__ import annotations

import glob
import json
import os
import time

from shardwise.comm import flight

REPORT = "report.txt"


def mark_failed(run_dir: str, rank: int, op: str, step) -> None:
    """A rank whose collective failed says so (the launcher then writes the report)."""
    folder = os.path.join(run_dir, "flight")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"failed-rank-{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "op": op, "step": step, "time": time.time()}, fh)


def failed(run_dir: str) -> set[int]:
    """The ranks whose collective failed (they leave on their own after the timeout)."""
    out = set()
    for path in glob.glob(os.path.join(run_dir, "flight", "failed-rank-*.json")):
        try:
            out.add(int(path.rsplit("-", 1)[1].split(".")[0]))
        except ValueError:
            continue
    return out


def process_state(pid: int) -> str:
    """'stopped', 'gone' or 'running' (Linux /proc; 'running' where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def records(run_dir: str) -> dict[int, dict]:
    """{rank: flight.read(...)} of every readable record file of the run."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "flight", "rank-*.bin"))):
        try:
            r = flight.read(path)
        except (OSError, ValueError):
            continue
        out[r["rank"]] = r
    return out


def _last_done(r: dict) -> dict | None:
    done = [x for x in r["records"] if x["end"] > 0]
    return done[-1] if done else None


def _waiting(r: dict) -> dict | None:
    open_ = [x for x in r["records"] if x["end"] == 0]
    return open_[-1] if open_ else None


def _describe(x: dict | None) -> str:
    if x is None:
        return "none recorded"
    return f"'{x['op']}' #{x['seq']} (group {x['group']}, {x['bytes']:,} bytes) at step {x['step']}"


def build(run_dir: str, states: dict[int, str] | None = None) -> str:
    """The report's lines (module docstring); ``states``: {rank: process state} when known."""
    recs = records(run_dir)
    if not recs:
        return "hang report: no flight records in " + os.path.join(run_dir, "flight")
    states = states or {}
    now = time.time()
    behind = _behind(recs, states, failed(run_dir))
    lines = [f"hang report ({len(recs)} ranks' flight records in {os.path.join(run_dir, 'flight')}):"]
    for rank, why in behind:
        lines.append(f"  rank {rank} is behind: {why}; its last completed collective: "
                     f"{_describe(_last_done(recs[rank]))}")
    culprits = {rank for rank, _ in behind}
    waits: dict[tuple, list[int]] = {}
    for rank, r in sorted(recs.items()):
        w = _waiting(r)
        if rank not in culprits and w is not None:
            waits.setdefault((w["op"], w["seq"], w["step"], w["group"]), []).append(rank)
    for (op, seq, step, group), ranks in sorted(waits.items(), key=lambda kv: kv[1]):
        since = min(recs[r]["records"][-1]["start"] for r in ranks)
        lines.append(f"  rank(s) {','.join(map(str, ranks))} wait in '{op}' #{seq} (group "
                     f"{group}) at step {step}, for {now - since:.0f} s")
    if not behind:
        lines.append("  no rank is behind by the records: every rank reached the same "
                     "collective (a slow network or a timeout shorter than a step?)")
    return "\n".join(lines)


def _behind(recs: dict[int, dict], states: dict[int, str],
            timed_out: set[int]) -> list[tuple[int, str]]:
    """[(rank, why)] of the ranks that hold the others up (module docstring's order); a rank
    gone after its own timeout (``timed_out``) is a witness, not a culprit."""
    odd = _mismatched(recs)
    stopped = [(rank, f"its process is stopped (pid {recs[rank]['pid']})"
                + (f"; {odd[rank]}" if rank in odd else "")) for rank in sorted(recs)
               if states.get(rank) == "stopped"]
    if stopped:
        return stopped
    if odd:              # gone or not: where it went astray names it
        return [(rank, (f"its process is gone (pid {recs[rank]['pid']}); " if
                        states.get(rank) == "gone" else "") + why)
                for rank, why in sorted(odd.items())]
    gone = [(rank, f"its process is gone (pid {recs[rank]['pid']})") for rank in sorted(recs)
            if states.get(rank) == "gone" and rank not in timed_out]
    if gone:
        return gone
    waiting = {rank: _waiting(r) for rank, r in recs.items()}
    idle = {rank: (_last_done(r) or {"seq": 0})["seq"] for rank, r in recs.items()
            if waiting[rank] is None}
    out = []
    if idle and any(w is not None for w in waiting.values()):
        low = min(idle.values())
        out = [(rank, "it is not in any collective (computing, or stuck outside them)")
               for rank, seq in sorted(idle.items()) if seq == low]
    return out


def _mismatched(recs: dict[int, dict]) -> dict[int, str]:
    """{rank: why} of the ranks in flight in another collective (operation, size, group) than
    most ranks at the same sequence number: a collective skipped or run out of order."""
    by_seq: dict[int, dict[tuple, list[int]]] = {}
    for rank, r in recs.items():
        w = _waiting(r)
        if w is not None:
            key = (w["op"], w["bytes"], w["group"])
            by_seq.setdefault(w["seq"], {}).setdefault(key, []).append(rank)
    out = {}
    for seq, kinds in sorted(by_seq.items()):
        if len(kinds) < 2:
            continue
        common = max(kinds, key=lambda k: len(kinds[k]))
        theirs = ",".join(map(str, kinds[common]))
        for key, ranks in kinds.items():
            if key != common:
                for r in ranks:
                    out[r] = (f"it is in '{key[0]}' #{seq} ({key[1]:,} bytes) while ranks "
                              f"{theirs} are in '{common[0]}' #{seq} ({common[1]:,} bytes): it "
                              "skipped a collective or ran them in another order")
    return out


def snapshot(run_dir: str) -> str:
    """Build the report now, with every recorded rank's process state, and write it to
    ``flight/report.txt``; returns it."""
    recs = records(run_dir)
    states = {rank: process_state(r["pid"]) for rank, r in recs.items()}
    text = build(run_dir, states)
    try:
        with open(os.path.join(run_dir, "flight", REPORT), "w") as fh:
            fh.write(text + "\n")
    except OSError:
        pass
    return text


def saved(run_dir: str) -> str | None:
    """The report the launcher wrote, if any."""
    try:
        with open(os.path.join(run_dir, "flight", REPORT)) as fh:
            return fh.read().rstrip("\n")
    except OSError:
        return None
