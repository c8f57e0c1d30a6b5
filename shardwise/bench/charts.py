"""The report's PNG charts, each drawn from row results (the JSON shardwise.bench.run writes) alone.

Every function takes the loaded rows (and the output folder) and returns the path it wrote, or
None when no row carries the figures it needs (the report then omits the chart and says so):

* throughput: ours / peer per row, whiskers from the worst and best pairing of the two sides' runs
* memory: peak RSS of the largest rank, ours beside the peer, our ledger's categories stacked
* traffic: bytes sent per step by rank 0 (ps: the busiest ps task), ours beside the peer's
* scaling: tokens/s against world size for rows of one ``series`` (the same row at 1 / 2 / 4)
* sizes: tokens/s and peak RSS against the model's parameters for the ``size:`` series (one
  strategy and its peer at 3M, 57M and 350M parameters, the same world)
* busbw: ring against the backend's allreduce, bus bandwidth over message sizes
* ps: loss curves and throughput of the parameter-server rows (a straggler) beside allreduce DP
* planner: the planner's predicted step time and state bytes against the measured ones
  (``planner_validation.json`` of shardwise/bench/validate_planner.py, when in the folder)
"""
from __future__ import annotations

import os
from shardwise.config.names import Strategy

MiB = 2 ** 20
LEDGER_KEYS = ("parameters", "gradients", "optimizer_states", "master_weights", "comm_buffers",
               "activations_peak")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def throughput(rows: list[dict], out: str) -> str | None:
    paired = [r for r in rows if r.get("throughput_ratio")]
    if not paired:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(paired) + 1.5))
    y = [len(paired) - 1 - i for i in range(len(paired))]
    ratio = [r["throughput_ratio"] for r in paired]
    low = [min(r["runs"]["ours"]) / max(r["runs"]["peer"]) for r in paired]
    high = [max(r["runs"]["ours"]) / min(r["runs"]["peer"]) for r in paired]
    err = [[max(0.0, q - lo) for q, lo in zip(ratio, low)],
           [max(0.0, hi - q) for q, hi in zip(ratio, high)]]
    ax.barh(y, ratio, 0.6, xerr=err, capsize=2, color=["C2" if q >= 1.0 else "C3" for q in ratio])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(y, [r["row"] for r in paired], fontsize=8)
    for v, q in zip(y, ratio):
        ax.text(q, v + 0.32, f"{q:.2f}", fontsize=7)
    ax.set(xlabel="ours / PyTorch peer (median; whiskers: worst and best pairing of runs)",
           title="throughput against the peer measured in the same run")
    return _save(fig, out, "throughput.png")


def _pairs(ax, rows, ours, peer, at=(0.2, -0.2), width=0.35):
    y = [len(rows) - 1 - i for i in range(len(rows))]
    ax.barh([v + at[0] for v in y], ours, width, label="shardwise")
    ax.barh([v + at[1] for v in y], peer, width, label="PyTorch peer")
    ax.set_yticks(y, [r["row"] for r in rows], fontsize=8)
    return y


def memory(rows: list[dict], out: str) -> str | None:
    rows = [r for r in rows if r["ours"].get("peak_rss_max_rank")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.58 * len(rows) + 2))
    ours = [r["ours"]["peak_rss_max_rank"] / MiB for r in rows]
    peer = [((r.get("peer_result") or {}).get("peak_rss_max_rank") or 0) / MiB for r in rows]
    y = _pairs(ax, rows, ours, peer, at=(0.28, 0.0), width=0.26)
    ledgers = [((r["ours"].get("extra") or {}).get("ledger") or {}) for r in rows]
    left = [0.0] * len(rows)
    for key in LEDGER_KEYS:
        widths = [lg.get(key, 0) / MiB for lg in ledgers]
        if any(widths):
            ax.barh([v - 0.28 for v in y], widths, 0.26, left=left, label=f"our ledger: {key}")
            left = [a + w for a, w in zip(left, widths)]
    ax.set(xlabel="MiB, largest rank (measured peak RSS; ledger: bytes the strategy counts)",
           title="peak resident memory, and our ledger by category")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out, "memory.png")


def traffic(rows: list[dict], out: str) -> str | None:
    rows = [r for r in rows if r["ours"].get("bytes_sent") or
            (r.get("peer_result") or {}).get("bytes_sent")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ours = [(r["ours"].get("bytes_sent") or 0) / MiB for r in rows]
    peer = [((r.get("peer_result") or {}).get("bytes_sent") or 0) / MiB for r in rows]
    _pairs(ax, rows, ours, peer)
    ax.set(xlabel="MiB sent per step by rank 0 (ps rows: the busiest ps task), metered",
           title="traffic per step (a missing bar: that side does not meter its traffic)")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out, "traffic.png")


def scaling(rows: list[dict], out: str) -> str | None:
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("series") and not r["series"].startswith("size:"):
            series.setdefault(r["series"], []).append(r)
    series = {k: sorted(v, key=lambda r: r["world"]) for k, v in series.items() if len(v) >= 2}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, group in series.items():
        worlds = [r["world"] for r in group]
        ax.plot(worlds, [r["ours"]["items_per_s"] for r in group], "o-", label=f"shardwise {name}")
        peer = [(r.get("peer_result") or {}).get("items_per_s") for r in group]
        if all(peer):
            ax.plot(worlds, peer, "s--", label=f"{group[0].get('peer') or 'peer'}")
        ax.set_xticks(worlds)
    cpus = rows[0].get("machine", {}).get("cpus")
    ax.set(xlabel="world size (processes)", ylabel="tokens/s of the world (median)",
           title=f"scaling with world size, same global batch ({cpus or '?'} CPU cores)")
    ax.legend(fontsize=8)
    return _save(fig, out, "scaling.png")


def busbw(rows: list[dict], out: str) -> str | None:
    rows = [r for r in rows if (r["ours"].get("extra") or {}).get("busbw_bytes_per_s_by_mb")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        for side, style, label in (("ours", "o-", "ring"), ("peer_result", "s--", "native")):
            table = ((r.get(side) or {}).get("extra") or {}).get("busbw_bytes_per_s_by_mb")
            if table:
                sizes = sorted(table, key=float)
                ax.plot([float(s) for s in sizes], [table[s] / 1e9 for s in sizes], style,
                        label=f"{label}, world {r['world']}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="allreduce size (MiB)", ylabel="bus bandwidth 2(N-1)/N K / t (GB/s)",
           title="ring allreduce against the backend's own")
    ax.legend(fontsize=8)
    return _save(fig, out, "busbw.png")


def ps(rows: list[dict], out: str) -> str | None:
    rows = [r for r in rows if (r["ours"].get("extra") or {}).get("losses")]
    if not rows:
        return None
    plt = _plt()
    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    names, rates, peer_done = [], [], False
    for r in rows:
        losses = r["ours"]["extra"]["losses"]
        ax_loss.plot(range(1, len(losses) + 1), losses, label=r["row"])
        names.append(r["row"])
        rates.append(r["ours"]["items_per_s"])
        peer = (r.get("peer_result") or {}).get("extra") or {}
        if peer.get("losses") and not peer_done:
            ax_loss.plot(range(1, len(peer["losses"]) + 1), peer["losses"], "--",
                         label=f"{r.get('peer') or 'peer'} (worker 0)")
            names.append("peer: " + (r.get("peer") or "peer").split(",")[0])
            rates.append(r["peer_result"]["items_per_s"])
            peer_done = True
    ax_loss.set(xlabel="step", ylabel="train loss", title="loss curves")
    ax_loss.legend(fontsize=7)
    ax_rate.barh(names[::-1], rates[::-1], color="C0")
    ax_rate.tick_params(axis="y", labelsize=7)
    ax_rate.set(xlabel="tokens/s (whole run, median of reps)", title="throughput")
    return _save(fig, out, "ps.png")


def planner(validation: dict | None, out: str) -> str | None:
    rows = (validation or {}).get("rows") or []
    rows = [r for r in rows if r.get("step_predicted_s") and r.get("step_measured_s")]
    if not rows:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (pred, meas, scale, unit) in zip(axes, (
            ("step_predicted_s", "step_measured_s", 1.0, "step time (s)"),
            ("states_predicted", "states_measured", MiB, "state bytes per rank (MiB)"))):
        xs = [r[pred] / scale for r in rows if r.get(pred) and r.get(meas)]
        ys = [r[meas] / scale for r in rows if r.get(pred) and r.get(meas)]
        labels = [f"{r['strategy']} w{r['world']}" for r in rows if r.get(pred) and r.get(meas)]
        ax.scatter(xs, ys)
        for x, y, label in zip(xs, ys, labels):
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        top = max(xs + ys) * 1.1 if xs else 1.0
        ax.plot([0, top], [0, top], "k:", lw=1)
        ax.set(xlabel=f"predicted {unit}", ylabel=f"measured {unit}", xlim=(0, top), ylim=(0, top))
    fig.suptitle("shardwise plan: prediction against measurement (dotted: equal)")
    return _save(fig, out, "planner.png")


def _parameters(r: dict) -> int | None:
    return ((r.get("ours") or {}).get("extra") or {}).get("parameters")


def sizes(rows: list[dict], out: str) -> str | None:
    series: dict[str, list[dict]] = {}
    for r in rows:
        if (r.get("series") or "").startswith("size:") and _parameters(r):
            series.setdefault(r["series"][5:], []).append(r)
    series = {k: sorted(v, key=_parameters) for k, v in series.items() if len(v) >= 2}
    if not series:
        return None
    plt = _plt()
    fig, (speed, mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, group in series.items():
        params = [_parameters(r) / 1e6 for r in group]
        peer = [r.get("peer_result") or {} for r in group]
        speed.plot(params, [r["ours"]["items_per_s"] for r in group], "o-",
                   label=f"shardwise {name}")
        mem.plot(params, [r["ours"]["peak_rss_max_rank"] / MiB for r in group], "o-",
                 label=f"shardwise {name}")
        if all(p.get("items_per_s") for p in peer):
            label = group[0].get("peer") or "peer"
            speed.plot(params, [p["items_per_s"] for p in peer], "s--", label=label)
            mem.plot(params, [p["peak_rss_max_rank"] / MiB for p in peer], "s--", label=label)
    world = next(iter(series.values()))[0].get("world")
    for ax, what in ((speed, "tokens/s of the world (median)"),
                     (mem, "peak RSS of the largest rank (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel="parameters (millions)", ylabel=what)
        ax.legend(fontsize=7)
    fig.suptitle(f"cost against model size, world {world}")
    return _save(fig, out, "sizes.png")


def all_charts(rows: list[dict], out: str, validation: dict | None = None) -> dict[str, str | None]:
    """Every chart, by name: its path, or None where the rows have no figures for it."""
    return {"throughput": throughput(rows, out), "memory": memory(rows, out),
            "traffic": traffic(rows, out), "scaling": scaling(rows, out),
            "sizes": sizes(rows, out), "busbw": busbw(rows, out),
            Strategy.PS: ps(rows, out), "planner": planner(validation, out)}
