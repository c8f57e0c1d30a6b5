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

Beyond the guide, :func:`axes_note` says why the winner's dp and tp axes are what they are:
HSDP against sharding over every dp rank (and, on several nodes, the other way round), and
sequence parallelism against the same layout without it; :func:`disk_only_note` says when
only disk offload makes the model fit, and what the disk then moves per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardwise.config.names import ZERO_STRATEGIES, Axis, Strategy
from shardwise.planner.cost import Estimate
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Layout
from shardwise.planner.offload import runtime_flags
from shardwise.planner.units import fmt_bytes, fmt_seconds

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
    return lay.kind in ZERO_STRATEGIES


def guide(nodes: int, devices_per_node: int, fits_one: bool, nvlink: bool,
          inter_bw: float) -> Guide:
    """The guide's rule for this situation."""
    if nodes * devices_per_node == 1:
        if fits_one:
            return Guide("one GPU, the model fits", "use it as is",
                         lambda lay: lay.kind == Strategy.SINGLE)
        return Guide("one GPU, the model does not fit", "offload to the CPU",
                     lambda lay: lay.offloaded)
    if nodes == 1:
        if fits_one:
            return Guide("one node, the model fits one GPU", "DDP or ZeRO",
                         lambda lay: lay.kind == Strategy.DDP or _is_zero(lay))
        if not nvlink:
            return Guide("one node without NVLink, the model does not fit one GPU", "PP",
                         lambda lay: lay.pp > 1 and lay.tp == 1)
        return Guide("one node with NVLink, the model does not fit one GPU", "TP, ZeRO or PP",
                     lambda lay: lay.kind in (Strategy.TP, Strategy.PP, Strategy.THREE_D)
                     or _is_zero(lay))
    if inter_bw >= FAST_NETWORK:
        return Guide("several nodes on a fast network", "ZeRO or 3D parallelism",
                     lambda lay: lay.kind == Strategy.THREE_D or _is_zero(lay))
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


def _full_shard_twin(e: Estimate, fitting: list[Estimate]) -> Estimate | None:
    """The fastest fitting layout at ``e``'s ZeRO stage that shards over all of dp (no HSDP)."""
    lay = e.layout
    return next((f for f in fitting if f.layout.zero == lay.zero and not f.layout.hsdp
                 and (f.layout.tp, f.layout.pp, f.layout.dp) == (lay.tp, lay.pp, lay.dp)), None)


def _hsdp_words(e: Estimate, hw: Hardware) -> str:
    """Where an HSDP layout's traffic goes: the shard group's link, the replicas' allreduce."""
    lay = e.layout
    s, r = lay.dp_shard, lay.dp_replicate
    inside = s * lay.tp <= hw.devices_per_node
    where = (f", in one node ({hw.interconnect}, {hw.intra_bw / 1e9:.0f} GB/s per device)"
             if inside else " across nodes")
    net = f"the {hw.network} network" if hw.nodes > 1 else "the node's links"
    return (f"its all-gathers and reduce-scatters stay inside each {s}-rank shard group"
            f"{where}; only the allreduce of 1/{s} of the gradients across the {r} replica "
            f"groups crosses {net} ({fmt_seconds(e.comm.get('replicas', 0.0))} per step)")


def axes_note(winner: Estimate | None, fitting: list[Estimate], hw: Hardware,
              without_sp: Estimate | None = None, ties: int = 0,
              without_cp: Estimate | None = None) -> str:
    """Why the winner is (or is not) HSDP, and why it uses sequence or context parallelism; ""
    when no such question arises. ``fitting``: every fitting estimate, in ranking order, the
    first ``ties`` tied with the fastest; ``without_sp``: the winner without sequence
    parallelism; ``without_cp``: the winner with its cp ranks as data-parallel ranks."""
    if winner is None:
        return ""
    lay, lines = winner.layout, []
    if lay.hsdp:
        twin = _full_shard_twin(winner, fitting)
        lost = (f"sharding over all {lay.dp} ranks ({twin.layout.describe()}) is "
                f"{why_lost(twin, winner)}" if twin else
                f"sharding over all {lay.dp} ranks does not fit")
        lines.append(f"Why HSDP ({lay.dp_replicate} replica groups x {lay.dp_shard}-rank "
                     f"shard groups): {_hsdp_words(winner, hw)}; {lost}.")
    elif hw.nodes > 1:
        best = next((f for f in fitting if f.layout.hsdp), None)
        if best is not None and any(best is t for t in fitting[:ties]):
            extra = best.memory_total - winner.memory_total
            lines.append(
                f"Why not HSDP: its best ({best.layout.describe()}) ties "
                f"({best.step_s / winner.step_s - 1:+.1%} step time) with more moving parts "
                f"and {fmt_bytes(abs(extra))} {'more' if extra >= 0 else 'less'} per device: "
                f"{hw.network} hides the winner's traffic as well (exposed communication "
                f"{fmt_seconds(winner.comm_exposed_s)}, HSDP's "
                f"{fmt_seconds(best.comm_exposed_s)}).")
        elif best is not None:
            lines.append(f"Why not HSDP: its best ({best.layout.describe()}) is "
                         f"{why_lost(best, winner)}.")
    if lay.sequence_parallel and without_sp is not None:
        why = (f"does not fit ({without_sp.why_not})" if not without_sp.fits else
               f"is {why_lost(without_sp, winner)}; it keeps "
               f"{fmt_bytes(without_sp.memory_total - winner.memory_total)} more per device")
        lines.append(f"Why sequence parallelism: it splits the norm, dropout and residual "
                     f"activations by tp={lay.tp} at the same traffic; without it the layout "
                     f"{why}.")
    if lay.cp > 1 and without_cp is not None:
        why = (f"does not fit ({without_cp.why_not})" if not without_cp.fits else
               f"is {why_lost(without_cp, winner)}")
        lines.append(f"Why context parallelism (cp={lay.cp}, {lay.cp_impl}): each rank keeps "
                     f"the activations of 1/{lay.cp} of every sequence "
                     f"({fmt_bytes(winner.memory.get('activations', 0.0))} per device) for "
                     f"{fmt_seconds(winner.comm.get(Axis.CP, 0.0))} of attention traffic per step; "
                     f"with those ranks as data-parallel replicas "
                     f"({without_cp.layout.describe()}) the layout {why}.")
    return "\n".join(lines)


def _on_disk(lay: Layout) -> bool:
    return "disk" in (lay.offload, lay.offload_params)


def disk_only_note(winner: Estimate | None, fitting: list[Estimate], hw: Hardware) -> str:
    """One line when every fitting layout offloads to disk (the state is larger than the host
    memory): the flags, the state it moves off the device (what cpu offload would have to put
    in RAM) against the RAM, and the disk's I/O per step at its bandwidth; "" otherwise."""
    if winner is None or not _on_disk(winner.layout) or not all(_on_disk(f.layout)
                                                                for f in fitting):
        return ""
    state = winner.disk_per_node + winner.host_per_node
    io = winner.disk_io_per_node
    return (f"Fits only with {runtime_flags(winner.layout)}: {fmt_bytes(state)} of offloaded "
            f"state per node vs {fmt_bytes(hw.host_memory_bytes)} RAM; disk I/O per step "
            f"{fmt_bytes(io)} at {hw.disk_bw / 1e9:.3g} GB/s ~ {fmt_seconds(io / hw.disk_bw)}.")
