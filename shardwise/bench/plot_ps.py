"""One PNG of the parameter-server rows: loss curves and throughput of sync / async / ssp (s=2)
with worker 1 at 3x step time, next to allreduce DP with the same straggler.

    python -m shardwise.bench.run ps --reps 3 --out DIR && python -m shardwise.bench.plot_ps --results DIR
draws ps_straggler.png from DIR/ps-*.json (default: the committed shardwise/bench/results/) into a
temporary folder (printed), or over the committed picture with ``--save``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MODES = [("sync", "ps-sync-straggler3x"), ("async", "ps-async-straggler3x"),
         ("ssp s=2", "ps-ssp2-straggler3x")]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.plot_ps")
    ap.add_argument("--results", default=RESULTS, help="folder of the ps-*.json results")
    ap.add_argument("--save", action="store_true", help="overwrite shardwise/bench/results/ps_straggler.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {label: json.load(open(os.path.join(args.results, f"{name}.json")))
            for label, name in MODES}
    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    names, rates = [], []
    for label, r in rows.items():
        ax_loss.plot(range(1, len(r["ours"]["extra"]["losses"]) + 1), r["ours"]["extra"]["losses"],
                     label=f"ps {label}")
        names.append(f"ps {label}")
        rates.append(r["ours"]["items_per_s"])
    peer = rows["sync"].get("peer_result")
    if peer:
        ax_loss.plot(range(1, len(peer["extra"]["losses"]) + 1), peer["extra"]["losses"],
                     "--", label="allreduce DP (worker 0)")
        names.append("allreduce DP")
        rates.append(peer["items_per_s"])
    ax_loss.set(xlabel="step (ps: mean of the workers' losses)", ylabel="train loss",
                title="loss, worker 1 at 3x step time")
    ax_loss.legend()
    ax_rate.bar(names, rates, color=["C0", "C1", "C2", "C3"][:len(rates)])
    ax_rate.set(ylabel="tokens/s (whole run, median of reps)", title="throughput")
    for i, v in enumerate(rates):
        ax_rate.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    fig.tight_layout()
    out = os.path.join(RESULTS if args.save else tempfile.mkdtemp(prefix="shardwise-plot-"),
                       "ps_straggler.png")
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    print(main())
