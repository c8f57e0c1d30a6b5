"""The measured pipeline: bubble fraction, peak micro-batches in flight, and the PNG timeline.

Measured bubble of a step = 1 - (time all stages spent in F and B) / (p x step span), the step
span running from the first stage's first action to the last stage's last one. With equal stage
costs and free transfers it equals (p-1)/(m+p-1) (schedule.simulate shows it exactly); a real
run adds transfer time and uneven stages (the first and last stages carry the embedding and the
head), so it comes out above the formula.
"""
from __future__ import annotations

from shardwise.parallel.pipeline.executor import StepRecord
from shardwise.parallel.pipeline.schedule import bubble_formula


def measured_bubble(records: list[StepRecord]) -> float:
    """Idle fraction of one step from every stage's records (wall-clock times)."""
    all_rows = [r for rec in records for r in rec.records]
    start, end = min(r[2] for r in all_rows), max(r[3] for r in all_rows)
    busy = sum(t1 - t0 for op, _, t0, t1 in all_rows if op in ("F", "B"))
    return 1 - busy / (len(records) * (end - start)) if end > start else 0.0


def summary(records: list[StepRecord], schedule: str, m: int) -> dict:
    """The figures a run reports: measured vs formula bubble, peak in-flight per stage."""
    p = len(records)
    return {"schedule": schedule, "stages": p, "num_microbatches": m,
            "bubble_measured": measured_bubble(records), "bubble_formula": bubble_formula(p, m),
            "peak_in_flight": [rec.peak_in_flight for rec in records]}


def describe(s: dict) -> str:
    return (f"pipeline {s['schedule']} p={s['stages']} m={s['num_microbatches']}: measured bubble "
            f"{s['bubble_measured']:.3f} (formula (p-1)/(m+p-1) = {s['bubble_formula']:.3f}); "
            f"peak micro-batches in flight per stage {s['peak_in_flight']}")


def draw(records: list[StepRecord], path: str, title: str = "") -> str:
    """One row per stage; F blocks blue, B blocks green, labelled by micro-batch; transfers grey."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = min(r[2] for rec in records for r in rec.records)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(records) + 1.2))
    colours = {"F": "#4C72B0", "B": "#55A868"}
    for rec in records:
        y = len(records) - 1 - rec.stage
        for op, mb, t0, t1 in rec.records:
            x0, w = (t0 - start) * 1e3, (t1 - t0) * 1e3
            if op in colours:
                ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=colours[op], edgecolor="white")
                ax.text(x0 + w / 2, y, f"{op}{mb}", ha="center", va="center", fontsize=7,
                        color="white")
            else:
                ax.broken_barh([(x0, w)], (y - 0.15, 0.3), facecolors="#BBBBBB")
    ax.set_yticks(range(len(records)), [f"stage {len(records) - 1 - i}" for i in range(len(records))])
    ax.set_xlabel("ms since the step began")
    ax.set_title(title or "pipeline schedule (blue: forward, green: backward, grey: transfers)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
