"""REPORT.md and charts from a folder of benchmark results (the JSON files shardwise.bench.run writes).

    python -m shardwise.bench.report DIR [--out DIR]      # default: write into DIR itself

The report regenerates from the JSON alone, so a committed results folder and its report never
disagree. It holds: the machine, date and commit; one table row per benchmark row (ours and the
peer in items/s, the ratio, each side's spread over its runs, the peak resident memory of the
largest rank on each side and its ratio, the goal); and two charts:

* ``throughput.png``: ours / peer throughput per row (1.0 marked), whiskers from the two sides'
  runs (the worst and the best pairing), so rows in different units share one axis;
* ``memory.png``: peak resident memory of the largest rank per row, ours beside the peer's, and
  our ledger's categories stacked beside them where the row recorded a ledger.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

LEDGER_KEYS = ("parameters", "gradients", "optimizer_states", "master_weights", "comm_buffers",
               "activations_peak")


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


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


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


def _bars(ax, rows, ours, peer, ours_err=None, peer_err=None, at=(0.2, -0.2), width=0.35):
    """Horizontal bars, one pair per row (ours above the peer, offsets ``at``), top to bottom."""
    y = [len(rows) - 1 - i for i in range(len(rows))]
    ax.barh([v + at[0] for v in y], ours, width, label="shardwise", xerr=ours_err, capsize=2)
    ax.barh([v + at[1] for v in y], peer, width, label="PyTorch peer", xerr=peer_err, capsize=2)
    ax.set_yticks(y, [r["row"] for r in rows], fontsize=8)
    return y


def _range(values: list[float], centre: float) -> list[float]:
    return [centre - min(values), max(values) - centre] if values else [0.0, 0.0]


def charts(rows: list[dict], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths, height = [], 0.45 * len(rows) + 1.5
    paired = [r for r in rows if r.get("throughput_ratio")]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(paired) + 1.5))
    y = [len(paired) - 1 - i for i in range(len(paired))]
    ratio = [r["throughput_ratio"] for r in paired]
    # whiskers: the worst and best pairing of the two sides' runs
    low = [min(r["runs"]["ours"]) / max(r["runs"]["peer"]) for r in paired]
    high = [max(r["runs"]["ours"]) / min(r["runs"]["peer"]) for r in paired]
    err = [[max(0.0, q - lo) for q, lo in zip(ratio, low)],
           [max(0.0, hi - q) for q, hi in zip(ratio, high)]]
    colours = ["C2" if q >= 1.0 else "C3" for q in ratio]
    ax.barh(y, ratio, 0.6, xerr=err, capsize=2, color=colours)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(y, [r["row"] for r in paired], fontsize=8)
    for v, q in zip(y, ratio):
        ax.text(q, v + 0.32, f"{q:.2f}", fontsize=7)
    ax.set(xlabel="ours / PyTorch peer (median; whiskers: worst and best pairing of runs)",
           title="throughput against the peer measured in the same run")
    fig.tight_layout()
    paths.append(os.path.join(out, "throughput.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, height * 1.3))
    mib = 2 ** 20
    ours_m = [(r["ours"].get("peak_rss_max_rank") or 0) / mib for r in rows]
    peer_m = [((r.get("peer_result") or {}).get("peak_rss_max_rank") or 0) / mib for r in rows]
    y = _bars(ax, rows, ours_m, peer_m, at=(0.28, 0.0), width=0.26)
    ledgers = [((r["ours"].get("extra") or {}).get("ledger") or {}) for r in rows]
    left = [0.0] * len(rows)
    for key in LEDGER_KEYS:
        widths = [lg.get(key, 0) / mib for lg in ledgers]
        if any(widths):
            ax.barh([v - 0.28 for v in y], widths, 0.26, left=left, label=f"our ledger: {key}")
            left = [a + w for a, w in zip(left, widths)]
    ax.set(xlabel="MiB, largest rank (measured peak RSS; ledger: bytes the strategy counts)",
           title="peak resident memory, and our ledger by category")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(os.path.join(out, "memory.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_report(folder: str, out: str | None = None) -> str:
    """Write REPORT.md (and the charts) for the results in ``folder``; return its path."""
    out = out or folder
    os.makedirs(out, exist_ok=True)
    rows = load(folder)
    if not rows:
        raise SystemExit(f"error: no benchmark results in {folder}; fix: run "
                         "'shardwise bench ROWS --out DIR' first")
    machine = rows[0].get("machine", {})
    pictures = charts(rows, out)
    text = [
        "# shardwise benchmark report", "",
        f"- date: {machine.get('date', '?')}; commit: {machine.get('commit') or commit()}",
        f"- machine: {machine.get('cpus', '?')} CPUs, {machine.get('processor', '?')}, "
        f"{machine.get('platform', '?')}; GPU: {machine.get('cuda') or 'none'}",
        f"- python {machine.get('python', '?')}, torch {machine.get('torch', '?')}", "",
        "Each row ran ours and the peer alternately in one invocation; figures are medians, "
        "'runs' the range over repetitions; ratio = ours / peer.", "",
        table(rows), *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pictures], ""]
    path = os.path.join(out, "REPORT.md")
    with open(path, "w") as fh:
        fh.write("\n".join(text))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="folder of row JSON files")
    ap.add_argument("--out", default="", help="where REPORT.md and the charts go (default: results)")
    args = ap.parse_args(argv)
    print(write_report(args.results, args.out or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
