"""``plan``: enumerate the layouts a machine allows, estimate each, rank the ones that fit.

Valid layouts: ``dp * tp * pp = devices`` (or ``num_ps + workers = devices``); tp divides the
devices of a node and the number of heads (tp stays inside a node); pp at most the number of
layers (stages balanced to within one layer); ZeRO 1-3 over dp for pure data parallelism,
ZeRO-1 in 3D layouts (as Megatron-DeepSpeed allows); the optimizer offloaded to cpu or disk
with ZeRO 1-3, and ZeRO-3 with the parameters offloaded to the same place (``shardwise train
--offload cpu|disk --offload-params``); HSDP for pure data parallelism: every split of dp into
``dp_replicate`` x ``dp_shard`` replica groups of shard groups (both above 1) at ZeRO 1-3;
sequence parallelism on and off wherever tp > 1; context parallelism (cp = 2, 4, ... dividing
the devices, ring and Ulysses where the heads allow) from sequences of ``CP_FROM`` positions; recompute none or full; micro-batches of 1, 2,
4, ... sequences up to a replica's share of the global batch; GPipe and 1F1B; 1, 2, 4, ...
parameter servers.

``everything=True`` (what ``shardwise plan`` asks for) adds what ``shardwise train --strategy
auto`` cannot run as planned: selective recompute, ZeRO-3 with the parameters offloaded
elsewhere than the optimizer (every combination of the device, the cpu and the disk), and the
interleaved 1F1B (v = 2, 4 where the stage has the layers) and ZB-H1 schedules.

Layouts that do not fit are dropped; the rest are ranked by step time. Layouts within
``TIE_BAND`` of the fastest (the model's error band, docs/planner.md) are ties: among them the
simplest goes first (the strategy guide: fewer sharded states, no offload, no recomputation,
fewer model splits, plain schedules), then the faster, then the one with less memory.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from shardwise.planner.cost import Estimate, estimate
from shardwise.planner.errors import PlanError
from shardwise.planner.explain import Guide, axes_note, disk_only_note, explain, guide
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.model import ModelSpec


@dataclass(frozen=True)
class Ranking:
    """The planner's answer for one model, machine and batch."""

    model: ModelSpec
    """The model planned for."""
    hardware: Hardware
    """The machine planned for."""
    batch: Batch
    """The global batch, precision and optimizer."""
    ranked: tuple[Estimate, ...]
    """Layouts that fit, one per family (kind, sizes, ZeRO, offload): the ties first (simplest
    first), then fastest first."""
    ties: int
    """How many of ``ranked`` are within ``band`` of the fastest (the winner among them)."""
    band: float
    """The tie band used (``TIE_BAND`` unless given)."""
    per_kind: dict[str, Estimate]
    """The best layout of every kind (``Layout.family_name``: HSDP apart, e.g. ``zero3+hsdp``);
    one that does not fit only when none of its kind does."""
    guide: Guide
    """The strategy guide's rule for this situation."""
    guide_best: Estimate | None
    """The fastest fitting layout the guide recommends."""
    explanation: str
    """The verdict in the guide's terms, and why the winner's dp and tp axes are what they are
    (HSDP, sequence parallelism)."""
    disk_note: str = ""
    """When only disk offload fits: the flags, the state against the RAM, the disk's I/O per
    step (explain.disk_only_note); "" otherwise."""

    @property
    def winner(self) -> Estimate | None:
        """The simplest of the layouts tied with the fastest one that fits, or None."""
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


CP_FROM = 8192
"""The sequence length from which the search tries context parallelism: below it one sequence's
activations are small next to the model states on the machines the planner targets, and cp's
attention traffic per token grows while its saving shrinks (torchtitan's CP runs start at 32k)."""


def _cps(n: int, model: ModelSpec) -> list[int]:
    """Context-parallel sizes for ``n`` devices per (tp, pp) choice: 1, and every divisor whose
    2 x cp chunks divide the sequence, for a long sequence."""
    if model.seq_len < CP_FROM:
        return [1]
    return [c for c in _divisors(n) if c == 1 or model.seq_len % (2 * c) == 0]


def _cp_impls(cp: int, tp: int, model: ModelSpec) -> list[str]:
    """ring always; Ulysses where cp divides a rank's heads."""
    if cp == 1:
        return ["ring"]
    return ["ring"] + (["ulysses"] if (model.heads // tp) % cp == 0 else [])


TIE_BAND = 0.10
"""Relative step-time difference below which two layouts are a tie: the model's stated error
band on published runs (GPT-3 175B's 34 days, docs/planner.md: within 10%)."""


def _zero_options(dp: int, pure_dp: bool, everything: bool) -> list[tuple[int, str, str]]:
    """(ZeRO stage, optimizer offload, parameter offload) triples worth trying for a dp size."""
    if not pure_dp:
        return [(0, "none", "none")] + ([(1, "none", "none")] if dp > 1 else [])
    stages = [0, 1, 2, 3] if dp > 1 else [0]
    out = [(z, "none", "none") for z in stages]
    out += [(z, o, "none") for z in (1, 2, 3) for o in ("cpu", "disk")]
    pairs = [(o, p) for o in ("none", "cpu", "disk") for p in ("cpu", "disk")
             if everything or o == p]
    return out + [(3, o, p) for o, p in pairs]


def _replicas(dp: int, pure_dp: bool, zero: int) -> list[int]:
    """HSDP's replica-group counts for a dp size: 1 (shard over all of dp), and every divisor
    that leaves a shard group of at least 2, for pure data parallelism under ZeRO 1-3."""
    if not pure_dp or not zero:
        return [1]
    return [r for r in _divisors(dp) if r == 1 or r < dp]


def layouts(model: ModelSpec, hw: Hardware, batch: Batch, micro_batch: int | None = None,
            everything: bool = False) -> Iterator[Layout]:
    """Every layout the search considers for this machine (see the module docstring)."""
    world, per_node = hw.world_size, hw.devices_per_node
    for tp in _divisors(min(per_node, world)):
        if model.heads % tp or world % tp:
            continue
        for pp in (p for p in _divisors(world // tp) if p <= model.layers):
            for cp in _cps(world // (tp * pp), model):
                dp = world // (tp * pp * cp)
                pure = tp == pp == 1
                for zero, offload, params in _zero_options(dp * cp, pure, everything):
                    for replicas in _replicas(dp, pure and cp == 1, zero):
                        for impl in _cp_impls(cp, tp, model):
                            base = Layout(dp=dp, tp=tp, pp=pp, zero=zero, offload=offload,
                                          offload_params=params, dp_replicate=replicas, cp=cp,
                                          cp_impl=impl)
                            yield from _variants(base, model, batch, micro_batch, everything)
    for num_ps in _powers_of_two(world // 2):
        yield from _variants(Layout(dp=world - num_ps, num_ps=num_ps), model, batch,
                             micro_batch, everything)


def _schedules(pp: int, layers: int, everything: bool) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs for a pipeline of ``pp`` stages."""
    if pp <= 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1)]
    if everything:
        out += [("zb-h1", 1)] + [("interleaved-1f1b", v) for v in (2, 4) if layers >= pp * v]
    return out


def _variants(base: Layout, model: ModelSpec, batch: Batch, micro_batch: int | None,
              everything: bool) -> Iterator[Layout]:
    """``base`` with each micro-batch size, recomputation choice, schedule and (tp > 1)
    sequence parallelism on and off."""
    share = batch.global_batch // base.dp
    sizes = [micro_batch] if micro_batch else _powers_of_two(share)
    recomputes = [(False, False), (True, False)] + ([(False, True)] if everything else [])
    sps = (False, True) if base.tp > 1 and base.cp == 1 else (False,)
    for mb in (s for s in sizes if s <= share):
        for full, selective in recomputes:
            for schedule, v in _schedules(base.pp, model.layers, everything):
                for sp in sps:
                    yield replace(base, micro_batch=mb, act_ckpt=full, schedule=schedule,
                                  selective_recompute=selective, virtual_stages=v,
                                  sequence_parallel=sp)


def _family(lay: Layout) -> tuple:
    """Layouts differing only in micro-batch, recomputation or schedule share a family (HSDP's
    split and sequence parallelism make families of their own: ``--strategy auto`` may have
    only one of them to run)."""
    return (lay.kind, lay.dp, lay.tp, lay.pp, lay.zero, lay.offload, lay.offload_params,
            lay.num_ps, lay.dp_replicate, lay.sequence_parallel, lay.cp, lay.cp_impl)


def complexity(layout: Layout) -> int:
    """Moving parts, the strategy guide's order of preference (simplest first): sharded states,
    offload, recomputation, model splits, HSDP's second dp level, sequence parallelism,
    parameter servers, schedules beyond GPipe / 1F1B."""
    return (layout.zero + (layout.offload != "none") + (layout.offload_params != "none")
            + (layout.recompute != "none") + (layout.tp > 1) + (layout.pp > 1)
            + layout.hsdp + layout.sequence_parallel + (layout.cp > 1)
            + bool(layout.num_ps) + (layout.schedule in ("interleaved-1f1b", "zb-h1")))


def rank(fitting: list[Estimate], band: float = TIE_BAND) -> tuple[list[Estimate], int]:
    """(``fitting`` in ranking order, how many of the first are ties with the fastest):
    those within ``band`` of the fastest step time, simplest first; then the rest, fastest
    first (less memory first between equal times)."""
    if not fitting:
        return [], 0
    fastest = min(e.step_s for e in fitting)
    ties = [e for e in fitting if e.step_s <= fastest * (1 + band)]
    rest = [e for e in fitting if e.step_s > fastest * (1 + band)]
    ties.sort(key=lambda e: (complexity(e.layout), e.step_s, e.memory_total))
    rest.sort(key=lambda e: (e.step_s, e.memory_total))
    return ties + rest, len(ties)


def fits_one_device(model: ModelSpec, hw: Hardware, batch: Batch) -> bool:
    """Whether the model trains on one device (micro-batch 1, checkpointing): the guide's 'fits'."""
    one = replace(hw, nodes=1, devices_per_node=1)
    return estimate(Layout(act_ckpt=True), model, one, replace(batch, global_batch=1)).fits


def plan(model: ModelSpec, hw: Hardware, batch: Batch, micro_batch: int | None = None,
         everything: bool = False, band: float = TIE_BAND) -> Ranking:
    """Rank every valid layout of ``model`` on ``hw`` for ``batch``; explain the winner.
    ``everything``: also the techniques ``shardwise train`` does not run (module docstring);
    ``band``: the relative step-time difference under which layouts tie."""
    if not 0 <= band < 1:
        raise PlanError("tie_band", band, "is not a fraction in [0, 1)",
                        "give the error band as a fraction, e.g. 0.1")
    if batch.global_batch < hw.world_size and hw.world_size > 1:
        raise PlanError("global_batch", batch.global_batch,
                        f"is smaller than the {hw.world_size} devices",
                        "give at least one sequence per device, or fewer devices")
    estimates = [estimate(lay, model, hw, batch)
                 for lay in layouts(model, hw, batch, micro_batch, everything)]
    if not estimates:
        raise PlanError("micro_batch", micro_batch, "leaves no layout",
                        "use a micro-batch no larger than the global batch per replica")
    fitting, tied = rank([e for e in estimates if e.fits], band)
    best: dict[tuple, Estimate] = {}
    for e in fitting:
        best.setdefault(_family(e.layout), e)
    tie_ids = {id(e) for e in fitting[:tied]}
    per_kind: dict[str, Estimate] = {}
    for e in fitting + sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total):
        per_kind.setdefault(e.layout.family_name, e)
    nvlink = hw.interconnect == "nvlink" or (hw.interconnect != "pcie" and hw.intra_bw >= 100e9)
    rule = guide(hw.nodes, hw.devices_per_node, fits_one_device(model, hw, batch), nvlink,
                 hw.inter_bw)
    guide_best = next((e for e in fitting if rule.matches(e.layout)), None)
    closest = min((e for e in estimates if rule.matches(e.layout)),
                  key=lambda e: e.memory_total, default=None)
    ranked = tuple(best.values())
    winner = ranked[0] if ranked else None
    text = explain(rule, winner, guide_best, closest)
    without_sp = None
    if winner is not None and winner.layout.sequence_parallel:
        without_sp = estimate(replace(winner.layout, sequence_parallel=False), model, hw, batch)
    without_cp = None
    if winner is not None and winner.layout.cp > 1:
        lay = winner.layout
        without_cp = estimate(replace(lay, dp=lay.dp * lay.cp, cp=1, cp_impl="ring"), model,
                              hw, batch)
    note = axes_note(winner, fitting, hw, without_sp, tied, without_cp)
    text = text + ("\n" + note if note else "")
    return Ranking(model=model, hardware=hw, batch=batch, ranked=ranked,
                ties=sum(id(e) in tie_ids for e in ranked), band=band, per_kind=per_kind,
                guide=rule, guide_best=guide_best, explanation=text,
                disk_note=disk_only_note(winner, fitting, hw))
