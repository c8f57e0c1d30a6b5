"""REPORT.md and charts from a folder of benchmark results (the JSON files shardwise.bench.run writes).

    python -m shardwise.bench.report DIR [--out DIR]      # default: write into DIR itself

The report regenerates from the JSON alone, so a committed results folder and its report never
disagree. It holds: the machine, date, commit and load average; one table row per benchmark row
(ours and the peer in items/s, the ratio, each side's spread over its runs, the peak resident
memory of the largest rank on each side and its ratio, the goal); and the charts of
shardwise/bench/charts.py that the rows carry figures for: throughput.png, memory.png,
traffic.png, scaling.png, sizes.png, busbw.png, ps.png, planner.png (the last from a
``planner_validation.json`` in the folder). The report names the charts it could not draw.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from shardwise.config.names import Strategy
from shardwise.bench.charts import all_charts

PLANNER = "planner_validation.json"
CAPTIONS = {"throughput": "Throughput, ours / the PyTorch peer of each row",
            "memory": "Peak resident memory of the largest rank, and our ledger by category",
            "traffic": "Bytes sent per step (rank 0; ps: the busiest ps task)",
            "scaling": "Scaling with world size (rows of one series)",
            "sizes": "Cost against model size: tokens/s and peak RSS (the size: series)",
            "busbw": "Ring allreduce against the backend's, over message sizes",
            Strategy.PS: "Parameter server with a straggler: loss curves and throughput",
            "planner": f"Planner prediction against measurement ({PLANNER})"}


def load(folder: str) -> list[dict]:
    """Every row result in ``folder`` (files without a 'row' key are skipped), by name."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            data = json.load(open(path))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "row" in data and "ours" in data:
            rows.append(data)
    return rows


def spread(values: list[float]) -> str:
    return f"{min(values):,.0f}-{max(values):,.0f}" if values else "-"


def _mib(n) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def table(rows: list[dict]) -> str:
    head = ("| row | world | ours /s | peer /s | ratio | ours runs | peer runs | peak RSS ours | "
            "peak RSS peer | RSS ratio | goal |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        peer = r.get("peer_result") or {}
        ratio = r.get("throughput_ratio")
        rss = r.get("peak_rss_ratio")
        lines.append("| " + " | ".join([
            r["row"], str(r["world"]), f"{r['ours']['items_per_s']:,.0f}",
            f"{peer['items_per_s']:,.0f}" if peer.get("items_per_s") else "-",
            f"{ratio:.3f}" if ratio else "-", spread(r["runs"]["ours"]), spread(r["runs"]["peer"]),
            _mib(r["ours"].get("peak_rss_max_rank")), _mib(peer.get("peak_rss_max_rank")),
            f"{rss:.3f}" if rss else "-", r.get("goal") or "-"]) + " |")
    return head + "\n".join(lines) + "\n"


def _planner(folder: str) -> dict | None:
    path = os.path.join(folder, PLANNER)
    try:
        return json.load(open(path)) if os.path.exists(path) else None
    except (OSError, ValueError):
        return None


def gpu_table(gpu: dict) -> str:
    """The single-GPU part (gpu.json of shardwise/bench/gpu.py) as markdown: every run, then
    shardwise / PyTorch per case (medians of the alternating runs)."""
    m = gpu.get("machine", {})
    lines = [f"Device: {m.get('gpu') or gpu.get('device', '?')}, driver {m.get('driver', '?')}, "
             f"torch {m.get('torch', '?')} (CUDA {m.get('cuda_runtime', '?')}); commit "
             f"{m.get('commit') or '?'}{' (uncommitted changes)' if m.get('dirty') else ''}; "
             f"{m.get('date', '?')}. Goal: {gpu.get('goal', '-')}.", "",
             "| size | case | run | tokens/s | step s (min-max) | MFU | peak CUDA memory | "
             "ledger | ledger gap |", "|---|---|---|---|---|---|---|---|---|"]
    for c in gpu.get("cases", []):
        who = f"{c.get('impl', '?')} #{c.get('rep', 0)}"
        if c.get("error") or c.get("skipped"):
            note = (c.get("error") or c.get("skipped")).replace("|", "/").splitlines()[0][:90]
            lines.append(f"| {c['size']} | {c['case']} | {who} | - | - | - | - | - | {note} |")
            continue
        mfu = f"{100 * c['mfu']:.1f}%" if c.get("mfu") is not None else "-"
        gap = f"{100 * c['ledger_gap']:+.1f}%" if c.get("ledger_gap") is not None else "-"
        lines.append(f"| {c['size']} | {c['case']} | {who} | {c['tokens_per_s']:,.0f} | "
                     f"{c['step_seconds']:.3f} ({c['step_min']:.3f}-{c['step_max']:.3f}) | {mfu} | "
                     f"{_mib(c.get('peak_memory'))} | {_mib(c.get('ledger_device_bytes'))} | "
                     f"{gap} |")
    if gpu.get("ratios"):
        lines += ["", "| size | case | shardwise tokens/s | PyTorch tokens/s | ratio | runs |",
                  "|---|---|---|---|---|---|"]
        for r in gpu["ratios"]:
            lines.append(f"| {r['size']} | {r['case']} | {r['shardwise_tokens_per_s']:,.0f} | "
                         f"{r['pytorch_tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
                         f"{r['runs'][0]} + {r['runs'][1]} |")
    return "\n".join(lines) + "\n"


def _gpu(folder: str) -> dict | None:
    path = os.path.join(folder, "gpu.json")
    try:
        return json.load(open(path)) if os.path.exists(path) else None
    except (OSError, ValueError):
        return None


def write_report(folder: str, out: str | None = None) -> str:
    """Write REPORT.md (and the charts) for the results in ``folder``; return its path."""
    out = out or folder
    os.makedirs(out, exist_ok=True)
    rows, gpu = load(folder), _gpu(folder)
    if not rows and not gpu:
        raise SystemExit(f"error: no benchmark results in {folder}; fix: run "
                         "'shardwise bench ROWS --out DIR' first")
    machine = (rows[0] if rows else gpu).get("machine", {})
    load_avg = machine.get("load")
    pictures = all_charts(rows, out, _planner(folder)) if rows else {}
    reps = sorted({r.get("reps") for r in rows if r.get("reps")})
    text = [
        "# shardwise benchmark report", "",
        f"- date: {machine.get('date', '?')}; commit: {machine.get('commit') or '?'}",
        f"- machine: {machine.get('cpus', '?')} CPUs, {machine.get('processor', '?')}, "
        f"{machine.get('platform', '?')}; GPU: {machine.get('cuda') or 'none'}",
        f"- python {machine.get('python', '?')}, torch {machine.get('torch', '?')}",
        f"- load average at the start of the first row: "
        f"{' / '.join(map(str, load_avg)) if load_avg else '?'} (1 / 5 / 15 min)",
        f"- {len(rows)} rows, {', '.join(map(str, reps))} alternating repetitions "
        f"(ours, peer, ours, peer, ...)", "",
        "Each row ran ours and the peer alternately in one invocation, each side in a fresh "
        "process world; figures are medians, 'runs' the range over repetitions; ratio = ours / "
        "peer (throughput: > 1 is faster; RSS: < 1 is smaller).", "",
        table(rows) if rows else "(no CPU rows in this folder)\n"]
    if gpu:
        text += ["## Single GPU (shardwise/bench/gpu.py)", "", gpu_table(gpu)]
    for name, path in pictures.items():
        if path:
            text += [f"## {CAPTIONS[name]}", "", f"![{name}]({os.path.basename(path)})", ""]
    absent = [n for n, p in pictures.items() if not p]
    if absent:
        text += [f"Not drawn (no row in this folder carries their figures): {', '.join(absent)}.", ""]
    path = os.path.join(out, "REPORT.md")
    with open(path, "w") as fh:
        fh.write("\n".join(text))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default="", help="folder of row JSON files")
    ap.add_argument("--out", default="", help="where REPORT.md and the charts go (default: results)")
    ap.add_argument("--gpu-table", nargs="+", default=[], metavar="GPU_JSON",
                    help="print the markdown tables of these gpu.json files (the README's)")
    args = ap.parse_args(argv)
    if args.gpu_table:
        for path in args.gpu_table:
            print(gpu_table(json.load(open(path))))
        return 0
    if not args.results:
        ap.error("give a results folder, or --gpu-table FILE")
    print(write_report(args.results, args.out or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
