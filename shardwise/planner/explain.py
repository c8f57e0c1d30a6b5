"""The strategy guide as rules, and the words that explain a plan in its terms.

The guide (the closing "choosing a strategy" part of OneFlow's "Common distributed parallel
strategies", translated):

- one GPU: if the model fits, use it as is; if not, offload to the CPU;
- one node with several GPUs: if the model fits one GPU, DDP or ZeRO; if not, TP, ZeRO or PP;
  without NVLink / NVSwitch ("poor man's mode"), use PP;
- several nodes: on a fast network (10 Gb Ethernet is not), ZeRO or 3D parallelism; on a slow
  network with little memory, DP + PP + TP + ZeRO-1.

"Fits" means the model trains on one device with micro-batch 1 and activation checkpointing;
"fast" means at least a 100 Gb/s adapter per node (10 GB/s effective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardwise.planner.cost import Estimate
from shardwise.planner.layout import Layout
from shardwise.planner.units import fmt_seconds

FAST_NETWORK = 10e9
"""Effective bytes/s per node from which the guide's 'fast network' rules apply."""


@dataclass(frozen=True)
class Guide:
    """The guide's case for a machine and a model, and what it recommends there."""

    case: str
    """The guide's case, in words, e.g. 'one node, model does not fit one GPU, no NVLink'."""
    advice: str
    """What the guide recommends there, e.g. 'PP'."""
    matches: Callable[[Layout], bool]
    """Whether a layout is one the guide recommends (a combination of them counts)."""


def _is_zero(lay: Layout) -> bool:
    return lay.kind in ("zero1", "zero2", "zero3")


def guide(nodes: int, devices_per_node: int, fits_one: bool, nvlink: bool,
          inter_bw: float) -> Guide:
    """The guide's rule for this situation."""
    if nodes * devices_per_node == 1:
        if fits_one:
            return Guide("one GPU, the model fits", "use it as is",
                         lambda lay: lay.kind == "single")
        return Guide("one GPU, the model does not fit", "offload to the CPU",
                     lambda lay: lay.offloaded)
    if nodes == 1:
        if fits_one:
            return Guide("one node, the model fits one GPU", "DDP or ZeRO",
                         lambda lay: lay.kind == "ddp" or _is_zero(lay))
        if not nvlink:
            return Guide("one node without NVLink, the model does not fit one GPU", "PP",
                         lambda lay: lay.pp > 1 and lay.tp == 1)
        return Guide("one node with NVLink, the model does not fit one GPU", "TP, ZeRO or PP",
                     lambda lay: lay.kind in ("tp", "pp", "3d") or _is_zero(lay))
    if inter_bw >= FAST_NETWORK:
        return Guide("several nodes on a fast network", "ZeRO or 3D parallelism",
                     lambda lay: lay.kind == "3d" or _is_zero(lay))
    if not fits_one:
        return Guide("several nodes on a slow network, little memory", "DP + PP + TP + ZeRO-1",
                     lambda lay: min(lay.dp, lay.tp, lay.pp) > 1 and lay.zero == 1)
    return Guide("several nodes on a slow network, the model fits one GPU",
                 "no rule (the guide covers slow networks only with little memory)",
                 lambda lay: True)


def why_lost(loser: Estimate, winner: Estimate) -> str:
    """Why ``loser`` ranks below ``winner``: memory, compute, bandwidth, bubble or offload."""
    if not loser.fits:
        return loser.why_not
    deltas = {
        "compute": loser.compute_s - winner.compute_s,
        "bandwidth": loser.comm_exposed_s - winner.comm_exposed_s,
        "bubble": loser.bubble_s - winner.bubble_s,
        "offload": loser.offload_s - winner.offload_s,
        "optimizer": loser.optimizer_s - winner.optimizer_s,
    }
    reason, delta = max(deltas.items(), key=lambda kv: kv[1])
    slower = loser.step_s / winner.step_s - 1
    lead = f"{slower:.0%} slower" if slower >= 0.005 else "about as fast"
    if delta <= 0:
        return f"{lead}; uses more memory" if slower < 0.005 else lead
    return f"{lead}; {reason}: {_detail(reason, loser, winner, delta)}"


def _detail(reason: str, loser: Estimate, winner: Estimate, delta: float) -> str:
    """The words for one reason."""
    lay, plus = loser.layout, f"+{fmt_seconds(delta)} per step"
    if reason == "bandwidth":
        kind, secs = max(loser.comm.items(), key=lambda kv: kv[1])
        return f"{plus} of exposed communication (mostly {kind}: {fmt_seconds(secs)})"
    if reason == "bubble":
        return f"{plus} idle (bubble {loser.bubble:.1%}, pp={lay.pp}, m={loser.microbatches})"
    if reason == "offload":
        where = " and ".join(sorted({w for w in (lay.offload, lay.offload_params) if w != "none"}))
        return f"{plus} copying to and updating on the {where} (offload)"
    if reason == "optimizer":
        return f"{plus} in an optimizer step that is not sharded"
    if lay.recompute != "none" and lay.recompute != winner.layout.recompute:
        return f"{plus} recomputing activations ({lay.recompute} recompute)"
    if lay.num_ps:
        return f"{plus}: only the {lay.dp} workers compute, the {lay.num_ps} servers wait"
    return f"{plus} on the busiest stage"


def profile(e: Estimate) -> str:
    """Where a step's time goes: compute, exposed communication, bubble, offload."""
    parts = [("compute", e.compute_s), ("exposed communication", e.comm_exposed_s),
             ("bubble", e.bubble_s), ("offload", e.offload_s), ("optimizer", e.optimizer_s)]
    shown = [f"{name} {secs / e.step_s:.0%}" for name, secs in parts if secs / e.step_s >= 0.005]
    return f"{fmt_seconds(e.step_s)} per step: " + ", ".join(shown)


def explain(g: Guide, winner: Estimate | None, guide_best: Estimate | None,
            guide_closest: Estimate | None) -> str:
    """The verdict in the guide's terms: matches it, or beats it and why."""
    lines = [f"Strategy guide: {g.case} -> {g.advice}."]
    if winner is None:
        closest = f" (the guide's closest, {guide_closest.layout.describe()}: " \
            f"{guide_closest.why_not})" if guide_closest else ""
        lines.append(f"Planner: no layout fits this machine{closest}.")
        return "\n".join(lines)
    lines.append(f"Planner: {winner.layout.describe()} ({profile(winner)}).")
    if g.matches(winner.layout):
        lines.append("This is the guide's recommendation, made quantitative.")
    elif guide_best is not None:
        lines.append(f"Better than the guide's best ({guide_best.layout.describe()}): "
                     f"that one is {why_lost(guide_best, winner)}.")
    else:
        why = guide_closest.why_not if guide_closest else "none of them fits"
        lines.append(f"Better than the guide: its recommendation does not fit ({why}).")
    return "\n".join(lines)
