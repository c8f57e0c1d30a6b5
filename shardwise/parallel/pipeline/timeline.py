"""The measured pipeline: bubble fraction, peak micro-batches in flight, and the PNG timeline.

Measured bubble of a step = 1 - (time all stages spent in F, B and W) / (p x step span), the
step span running from the first stage's first action to the last stage's last one. With equal
stage costs and free transfers it equals the schedule's formula (schedule.bubble_formula:
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 with
equal F, B and W; schedule.simulate shows it exactly); a real run adds transfer time and uneven
stages (the first and last stages carry the embedding and the head), so it comes out above the
formula. :func:`ideal_records` turns a simulation into the same records, so the picture of the
ideal schedule and of a measured step are drawn alike.
"""
from __future__ import annotations

from shardwise.parallel.pipeline.executor import StepRecord
from shardwise.parallel.pipeline.schedule import FORMULA, bubble_formula

COMPUTE = ("F", "B", "W")


def measured_bubble(records: list[StepRecord]) -> float:
    """Idle fraction of one step from every stage's records (wall-clock times)."""
    all_rows = [r for rec in records for r in rec.records]
    start, end = min(r[2] for r in all_rows), max(r[3] for r in all_rows)
    busy = sum(t1 - t0 for op, _, t0, t1 in all_rows if op in COMPUTE)
    return 1 - busy / (len(records) * (end - start)) if end > start else 0.0


def summary(records: list[StepRecord], schedule: str, m: int, v: int = 1) -> dict:
    """The figures a run reports: measured vs formula bubble, peak in-flight per stage."""
    p = len(records)
    return {"schedule": schedule, "stages": p, "num_microbatches": m, "virtual_stages": v,
            "bubble_measured": measured_bubble(records),
            "bubble_formula": bubble_formula(p, m, schedule, v),
            "peak_in_flight": [rec.peak_in_flight for rec in records]}


def describe(s: dict) -> str:
    v = s.get("virtual_stages", 1)
    shape = f"p={s['stages']}" + (f" v={v}" if v > 1 else "") + f" m={s['num_microbatches']}"
    return (f"pipeline {s['schedule']} {shape}: measured bubble {s['bubble_measured']:.3f} "
            f"(formula {FORMULA.get(s['schedule'], '(p-1)/(m+p-1)')} = "
            f"{s['bubble_formula']:.3f}); peak micro-batches in flight per stage "
            f"{s['peak_in_flight']}")


def ideal_records(sim: dict, unit_s: float = 1e-3) -> list[StepRecord]:
    """schedule.simulate's timeline as records (one cost unit drawn as ``unit_s`` seconds)."""
    out = []
    for s, (intervals, chunks) in enumerate(zip(sim["intervals"], sim["chunks"])):
        rec = StepRecord(s, [(op, mb, t0 * unit_s, t1 * unit_s) for op, mb, t0, t1 in intervals],
                         chunks=list(chunks))
        out.append(rec)
    return out


def _colour(op: str, chunk: int) -> str:
    """F blue, B green, W orange; a later chunk in a lighter shade of its colour."""
    shades = {"F": ("#4C72B0", "#8FA9D6", "#B9CBEA"), "B": ("#55A868", "#8CCB99", "#B7E0BF"),
              "W": ("#DD8452", "#EDB189", "#F5CFB3")}[op]
    return shades[min(chunk, len(shades) - 1)]


def draw(records: list[StepRecord], path: str, title: str = "",
         xlabel: str = "ms since the step began") -> str:
    """One row per stage; F blocks blue, B green, W orange (lighter for later chunks), labelled
    by micro-batch (and chunk: ``F3.1``); transfers grey."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = min(r[2] for rec in records for r in rec.records)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(records) + 1.2))
    for rec in records:
        y = len(records) - 1 - rec.stage
        chunks = rec.chunks or [0] * len(rec.records)
        for (op, mb, t0, t1), c in zip(rec.records, chunks):
            x0, w = (t0 - start) * 1e3, (t1 - t0) * 1e3
            if op in COMPUTE:
                ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=_colour(op, c),
                               edgecolor="white")
                ax.text(x0 + w / 2, y, f"{op}{mb}" + (f".{c}" if c else ""), ha="center",
                        va="center", fontsize=6 if c else 7, color="black" if c else "white")
            else:
                ax.broken_barh([(x0, w)], (y - 0.15, 0.3), facecolors="#BBBBBB")
    ax.set_yticks(range(len(records)), [f"stage {len(records) - 1 - i}" for i in range(len(records))])
    ax.set_xlabel(xlabel)
    ax.set_title(title or "pipeline schedule (blue: forward, green: backward, orange: weight "
                 "gradient, grey: transfers)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
