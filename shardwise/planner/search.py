"""``plan``: enumerate the layouts a machine allows, estimate each, rank the ones that fit.

Valid layouts: ``dp * tp * pp = devices`` (or ``num_ps + workers = devices``); tp divides the
devices of a node and the number of heads (tp stays inside a node); pp at most the number of
layers (stages balanced to within one layer); ZeRO 1-3 over dp for pure data parallelism,
ZeRO-1 in 3D layouts (as Megatron-DeepSpeed allows); offload to cpu with ZeRO-2/3 and to disk
with ZeRO-3; activation checkpointing on or off; micro-batches of 1, 2, 4, ... sequences up to a
replica's share of the global batch; GPipe and 1F1B; 1, 2, 4, ... parameter servers. Layouts
that do not fit are dropped; the rest are ranked by step time (ties: less memory first).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace
from typing import Iterator

from shardwise.planner.cost import Estimate, estimate
from shardwise.planner.errors import PlanError
from shardwise.planner.explain import Guide, explain, guide
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.model import ModelSpec


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one model, machine and batch."""

    model: ModelSpec
    """The model planned for."""
    hardware: Hardware
    """The machine planned for."""
    batch: Batch
    """The global batch, precision and optimizer."""
    ranked: tuple[Estimate, ...]
    """Layouts that fit, fastest first, one per family (kind, sizes, ZeRO, offload)."""
    per_kind: dict[str, Estimate]
    """The best layout of every kind; one that does not fit only when none of its kind does."""
    guide: Guide
    """Seed 000's rule for this situation."""
    guide_best: Estimate | None
    """The fastest fitting layout the guide recommends."""
    explanation: str
    """The verdict in the guide's terms."""

    @property
    def winner(self) -> Estimate | None:
        """The fastest layout that fits, or None."""
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def _zero_options(dp: int, pure_dp: bool) -> list[tuple[int, str]]:
    """(ZeRO stage, offload) pairs worth trying for a dp size."""
    offloads = [(2, "cpu"), (3, "cpu"), (3, "disk")] if pure_dp else []
    if dp == 1:
        return [(0, "none")] + offloads
    stages = [0, 1, 2, 3] if pure_dp else [0, 1]
    return [(z, "none") for z in stages] + offloads


def layouts(model: ModelSpec, hw: Hardware, batch: Batch,
            micro_batch: int | None = None) -> Iterator[Layout]:
    """Every layout the search considers for this machine (see the module docstring)."""
    world, per_node = hw.world_size, hw.devices_per_node
    for tp in _divisors(min(per_node, world)):
        if model.heads % tp or world % tp:
            continue
        for pp in (p for p in _divisors(world // tp) if p <= model.layers):
            dp = world // (tp * pp)
            for zero, offload in _zero_options(dp, tp == pp == 1):
                base = Layout(dp=dp, tp=tp, pp=pp, zero=zero, offload=offload)
                yield from _variants(base, batch, micro_batch)
    for num_ps in _powers_of_two(world // 2):
        yield from _variants(Layout(dp=world - num_ps, num_ps=num_ps), batch, micro_batch)


def _variants(base: Layout, batch: Batch, micro_batch: int | None) -> Iterator[Layout]:
    """``base`` with each micro-batch size, checkpointing choice and schedule."""
    share = batch.global_batch // base.dp
    sizes = [micro_batch] if micro_batch else _powers_of_two(share)
    for mb in (s for s in sizes if s <= share):
        for ckpt in (False, True):
            for schedule in ("1f1b", "gpipe") if base.pp > 1 else ("1f1b",):
                yield replace(base, micro_batch=mb, act_ckpt=ckpt, schedule=schedule)


def _family(lay: Layout) -> tuple:
    """Layouts differing only in micro-batch, checkpointing or schedule share a family."""
    return (lay.kind, lay.dp, lay.tp, lay.pp, lay.zero, lay.offload, lay.num_ps)


def _order(e: Estimate) -> tuple:
    """Fastest first; layouts within 1% of each other's step time (the model's resolution) go
    simplest first (fewer sharded states, no offload, no recomputation, fewer model splits),
    then smallest memory: between equals, the one with fewer moving parts wins."""
    return (round(math.log(max(e.step_s, 1e-12)) / math.log(1.01)), _complexity(e.layout),
            e.memory_total)


def _complexity(layout: Layout) -> int:
    return (layout.zero + (layout.offload != "none") + bool(layout.act_ckpt) + (layout.tp > 1)
            + (layout.pp > 1) + bool(layout.num_ps))


def fits_one_device(model: ModelSpec, hw: Hardware, batch: Batch) -> bool:
    """Whether the model trains on one device (micro-batch 1, checkpointing): the guide's 'fits'."""
    one = replace(hw, nodes=1, devices_per_node=1)
    return estimate(Layout(act_ckpt=True), model, one, replace(batch, global_batch=1)).fits


def plan(model: ModelSpec, hw: Hardware, batch: Batch, micro_batch: int | None = None) -> Plan:
    """Rank every valid layout of ``model`` on ``hw`` for ``batch``; explain the winner."""
    if batch.global_batch < hw.world_size and hw.world_size > 1:
        raise PlanError("global_batch", batch.global_batch,
                        f"is smaller than the {hw.world_size} devices",
                        "give at least one sequence per device, or fewer devices")
    estimates = [estimate(lay, model, hw, batch) for lay in layouts(model, hw, batch, micro_batch)]
    if not estimates:
        raise PlanError("micro_batch", micro_batch, "leaves no layout",
                        "use a micro-batch no larger than the global batch per replica")
    fitting = sorted((e for e in estimates if e.fits), key=_order)
    best: dict[tuple, Estimate] = {}
    for e in fitting:
        best.setdefault(_family(e.layout), e)
    per_kind: dict[str, Estimate] = {}
    for e in fitting + sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total):
        per_kind.setdefault(e.layout.kind, e)
    nvlink = hw.interconnect == "nvlink" or (hw.interconnect != "pcie" and hw.intra_bw >= 100e9)
    rule = guide(hw.nodes, hw.devices_per_node, fits_one_device(model, hw, batch), nvlink,
                 hw.inter_bw)
    guide_best = next((e for e in fitting if rule.matches(e.layout)), None)
    closest = min((e for e in estimates if rule.matches(e.layout)),
                  key=lambda e: e.memory_total, default=None)
    ranked = tuple(best.values())
    text = explain(rule, ranked[0] if ranked else None, guide_best, closest)
    return Plan(model=model, hardware=hw, batch=batch, ranked=ranked, per_kind=per_kind,
                guide=rule, guide_best=guide_best, explanation=text)
