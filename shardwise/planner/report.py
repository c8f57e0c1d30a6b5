"""Printing a plan: a ranked table (rich) or JSON, and the estimated time to train.

``rich`` is imported only when a table is printed, so the planner itself stays stdlib-only.
"""
from __future__ import annotations

import json
import sys
from typing import TextIO

from shardwise.planner.cost import Estimate
from shardwise.planner.explain import why_lost
from shardwise.planner.model import PUBLISHED
from shardwise.planner.search import Ranking
from shardwise.planner.units import fmt_bytes, fmt_count, fmt_seconds


def train_line(plan: Ranking, tokens: float) -> str:
    """``Estimated time to train on 3e+11 tokens: 26.1 days (...)``, or why there is none."""
    w = plan.winner
    if w is None:
        return f"Estimated time to train on {fmt_count(tokens)} tokens: none (no layout fits)."
    steps = tokens / w.tokens_per_step
    days = fmt_seconds(w.time_to_train(tokens))
    return (f"Estimated time to train on {fmt_count(tokens)} tokens: {days}"
            f" ({steps:,.0f} steps of {w.tokens_per_step:,} tokens at {fmt_seconds(w.step_s)},"
            f" {w.tokens_per_s:,.0f} tokens/s, MFU {w.mfu:.1%}) with {w.layout.describe()}"
            f" on {plan.hardware.world_size} x {plan.hardware.name}.")


def startup_line(plan: Ranking) -> str:
    """What the winner's ranks build at start-up under the plan's init, against the other."""
    w = plan.winner
    if w is None:
        return ""
    whole = 4.0 * plan.model.params
    ranks = min(plan.hardware.devices_per_node, w.layout.world)
    eager = (f"the whole fp32 model on every rank, {fmt_bytes(whole)} per rank "
             f"({fmt_bytes(whole * ranks)} per node)")
    if plan.batch.init == "eager":
        return f"Start-up (--init eager): {eager}; --init meta builds {fmt_bytes(w.startup)}."
    return (f"Start-up (--init meta): each rank builds only what it keeps, "
            f"{fmt_bytes(w.startup)} per rank; --init eager would build {eager}.")


def _others(plan: Ranking, top: int) -> list[Estimate]:
    """The best layout of each kind that the top rows do not already show."""
    shown = {e.layout.family_name for e in plan.ranked[:top]}
    return [e for kind, e in plan.per_kind.items() if kind not in shown]


def verdict(e: Estimate, plan: Ranking) -> str | None:
    """None for the winner; a tie's step time against the winner's; else why it lost."""
    w = plan.winner
    if e is w:
        return None
    if w is None:
        return e.why_not
    if any(e is t for t in plan.ranked[:plan.ties]):
        return (f"tie: {e.step_s / w.step_s - 1:+.1%} step time, within the model's "
                f"{plan.band:.0%} error band; the winner has fewer moving parts")
    return why_lost(e, w)


def published_note(plan: Ranking) -> str:
    """A line when the winner's recomputation differs from the published run of the model."""
    run = PUBLISHED.get(plan.model.name)
    w = plan.winner
    if run is None or w is None or w.layout.recompute == run[0]:
        return ""
    return (f"Note: the winner uses recompute={w.layout.recompute}; the published run of "
            f"{plan.model.name} used {run[0]} recompute ({run[1]}).")


def _row(e: Estimate, plan: Ranking, tokens: float, label: str) -> list[str]:
    verdict_text = verdict(e, plan) or "winner"
    fits = e.fits
    return [label, e.layout.describe(),
            f"{fmt_bytes(e.memory_total)} / {fmt_bytes(e.capacity)}",
            fmt_seconds(e.step_s) if fits else "-",
            fmt_seconds(e.comm_exposed_s) if fits else "-",
            f"{e.bubble:.1%}" if e.layout.pp > 1 and fits else "-",
            f"{e.mfu:.1%}" if fits else "-",
            fmt_seconds(e.time_to_train(tokens)) if fits else "-", verdict_text]


HEADERS = ("#", "layout", "memory / device", "step", "exposed comm", "bubble", "MFU",
           "time to train", "why not first")


def print_table(plan: Ranking, top: int, tokens: float, out: TextIO | None = None) -> None:
    """The ranked layouts, the best of the other kinds, the verdict and the time to train."""
    from rich.console import Console
    from rich.table import Table

    out = out or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 200, soft_wrap=False)
    console.print(f"[bold]model[/] {plan.model.describe()}")
    console.print(f"[bold]machine[/] {plan.hardware.describe()}")
    b = plan.batch
    console.print(f"[bold]batch[/] {b.global_batch} sequences x {plan.model.seq_len} tokens, "
                  f"{b.precision}, {b.optimizer}; model states counted as {b.convention}")
    table = Table(title=f"Fastest layouts that fit (top {top} of {len(plan.ranked)} families; "
                        f"{plan.ties} within {plan.band:.0%} of the fastest are ties, "
                        f"simplest first)")
    for h in HEADERS:
        table.add_column(h, overflow="fold")
    for i, e in enumerate(plan.ranked[:top], 1):
        table.add_row(*_row(e, plan, tokens, str(i)))
    for e in _others(plan, top):
        table.add_row(*_row(e, plan, tokens, "best " + e.layout.family_name))
    console.print(table)
    if plan.winner is not None:
        console.print("[bold]memory of the winner[/] (" + plan.winner.memory_role + "): "
                      + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.winner.memory.items()))
    console.print(plan.explanation, highlight=False)
    for line in (plan.disk_note, startup_line(plan)):
        if line:
            console.print(line, highlight=False)
    console.print(f"[bold]{train_line(plan, tokens)}[/]", highlight=False)
    if published_note(plan):
        console.print(published_note(plan), highlight=False)


def to_json(plan: Ranking, top: int, tokens: float) -> str:
    """The plan as JSON: inputs, verdict, winner, top rows and the other kinds' best."""
    w = plan.winner

    def entry(e: Estimate) -> dict:
        return {**e.to_dict(), "time_to_train_s": e.time_to_train(tokens) if e.fits else None,
                "tie": any(e is t for t in plan.ranked[:plan.ties]),
                "why_not_first": verdict(e, plan)}

    doc = {
        "model": plan.model.to_dict(), "hardware": plan.hardware.to_dict(),
        "batch": {"global_batch": plan.batch.global_batch, "precision": plan.batch.precision,
                  "optimizer": plan.batch.optimizer, "convention": plan.batch.convention,
                  "init": plan.batch.init},
        "tokens": tokens,
        "guide": {"case": plan.guide.case, "advice": plan.guide.advice,
                  "winner_matches": bool(w and plan.guide.matches(w.layout))},
        "explanation": plan.explanation,
        "disk_note": plan.disk_note or None,
        "startup": startup_line(plan) or None,
        "time_to_train_s": w.time_to_train(tokens) if w else None,
        "summary": train_line(plan, tokens),
        "tie_band": plan.band, "ties": plan.ties,
        "published_note": published_note(plan) or None,
        "winner": entry(w) if w else None,
        "ranked": [entry(e) for e in plan.ranked[:top]],
        "other_kinds": [entry(e) for e in _others(plan, top)],
    }
    return json.dumps(doc, indent=2)
