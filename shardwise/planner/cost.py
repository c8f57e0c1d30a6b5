"""``estimate``: memory, compute, communication, bubble and step time of one layout.

A step is ``m`` micro-batches per replica. Each micro-batch costs one slot on every stage:

    slot = compute + tensor-parallel allreduces + pipeline sends + un-overlapped ZeRO-2/3 traffic
    step = (m + pp - 1) * slot + dp sync left exposed + optimizer + offload + parameter server

Compute (compute.py) is the busiest stage's share of ``6 P + 12 L s h`` FLOPs per token (block
terms x 4/3 with full recomputation, + 4 s h with selective; ``ModelSpec.block_flops``) at
``peak x efficiency``, slowed where the block's GEMMs are small (kernels.py: ``max(F/R, B/W) +
gemm_latency`` per GEMM), plus the memory-bound kernels between the GEMMs
(``activation_passes`` over the block's activation bytes) and a fixed ``block_overhead`` per
block and micro-batch. The
pipeline bubble is ``(pp - 1) / (m + pp - 1)`` of the pipeline time (GPipe and 1F1B alike;
interleaved 1F1B and ZB-H1 idle (pp-1)/v and (pp-1)/3 slots instead: ``layout.bubble_slots``).
Where ranks share cores (``Hardware.compute_lanes``, CPU) the bubble's idle slots are partly
absorbed: ``_pipeline_seconds``.

What overlaps with what (the only judgement calls): DDP's allreduce and ZeRO-1's
reduce-scatter run during the last micro-batch's backward; ZeRO-2's reduce-scatter during each
micro-batch's backward; ZeRO-3's gathers unit by unit, each behind the previous unit's
compute (one unit of prefetch; the first is exposed), except across nodes, where none is
hidden (comm.zero3_across_nodes: what the published runs at 384-2,240 GPUs show); a forward is
1/3 of a micro-batch's compute (1/4 with full recomputation). With a pipeline the dp sync
runs after the flush, exposed (Megatron-LM 2021). Tensor-parallel allreduces, pipeline sends,
offload copies and parameter-server traffic are never overlapped. ``Hardware.comm_overlap``
scales what compute can hide (1 on accelerators; a CPU calibration sets 0, since there the
collectives need the cores that backward is using).
The optimizer step is memory-bound: bytes touched per parameter (``optimizer_bytes``) over the
rate the optimizer reaches (``Hardware.optimizer_bw``, measured by a CPU calibration; the device's
memory bandwidth where unknown), or the host's when offloaded.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.names import Axis, Strategy
from shardwise.planner import comm, offload
from shardwise.planner.compute import microbatch_seconds
from shardwise.planner.errors import PlanError
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout, bubble_slots
from shardwise.planner.memory import layers_on_stage, memory, stage_params, state_bytes
from shardwise.planner.model import ModelSpec
from shardwise.planner.units import fmt_bytes


@dataclass(frozen=True)
class Estimate:
    """What one layout costs on one machine for one batch."""

    layout: Layout
    """The layout estimated."""
    memory: dict[str, float]
    """Bytes per ledger category on the fullest device."""
    memory_role: str
    """Which device is the fullest (rank, stage 0, last stage, worker, server)."""
    capacity: float
    """Bytes a device can give to tensors (memory less the reserved part)."""
    host_per_node: float
    """Bytes offloaded into each node's host memory."""
    disk_per_node: float
    """Bytes offloaded onto each node's disk."""
    fits: bool
    """Whether device, host and disk memory all suffice."""
    why_not: str
    """Why it does not fit ("" when it does)."""
    microbatches: int
    """Micro-batches per replica per step."""
    compute_s: float
    """Seconds of computation per step on the busiest device (recomputation included)."""
    comm_s: float
    """Seconds of communication per step, overlapped or not."""
    comm_exposed_s: float
    """The part of ``comm_s`` on the critical path."""
    comm: dict[str, float]
    """``comm_s`` by kind: tp, p2p, dp (the ZeRO / DDP group), replicas (HSDP's allreduce
    across replica groups), ps."""
    bubble: float
    """Pipeline bubble, the idle fraction of the pipeline time: (pp-1)/(m+pp-1) (GPipe, 1F1B;
    layout.bubble_slots for the others)."""
    bubble_s: float
    """Idle seconds per step in the pipeline."""
    optimizer_s: float
    """Seconds of the optimizer step on the device (0 when offloaded)."""
    offload_s: float
    """Seconds per step of host copies and the host / disk optimizer step."""
    step_s: float
    """Seconds per optimizer step."""
    tokens_per_step: int
    """Global batch in tokens."""
    mfu: float
    """Model FLOP utilisation: (6P + 12Lsh) x tokens / (step x devices x peak)."""
    startup: float = 0.0
    """Bytes one rank builds at start-up (memory.startup_bytes: its own fp32 parameters under
    meta init, the whole fp32 model under eager)."""
    startup_host_per_node: float = 0.0
    """Bytes of a node's host memory the start-up takes (eager init only)."""
    disk_io_per_node: float = 0.0
    """Bytes each node's disk reads and writes per step (offload.py; 0 without disk offload)."""

    @property
    def memory_total(self) -> float:
        """Bytes on the fullest device, all categories."""
        return sum(self.memory.values())

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the whole machine."""
        return self.tokens_per_step / self.step_s

    def time_to_train(self, tokens: float) -> float:
        """Seconds to train on ``tokens`` tokens."""
        return tokens / self.tokens_per_s

    def to_dict(self) -> dict:
        """Plain numbers for ``--format json``."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "layout"}
        return {"layout": self.layout.to_dict(), "memory_total": self.memory_total,
                "tokens_per_s": self.tokens_per_s, **out}


def _check(layout: Layout, model: ModelSpec, hw: Hardware) -> None:
    """Reject layouts the machine or the model cannot take at all."""
    if layout.world > hw.world_size:
        raise PlanError("layout", layout.describe(), f"needs {layout.world} devices",
                        f"fit it in the {hw.world_size} devices of the machine")
    if model.heads % layout.tp or model.hidden % layout.tp:
        raise PlanError(Axis.TP, layout.tp, f"does not divide {model.heads} heads",
                        "pick a tp that divides the number of heads")
    if layout.pp > model.layers:
        raise PlanError(Axis.PP, layout.pp, f"exceeds the model's {model.layers} layers",
                        "use at most one stage per layer")
    if model.seq_len % (2 * layout.cp) and layout.cp > 1:
        raise PlanError(Axis.CP, layout.cp, f"cuts each sequence into 2 x cp chunks, which do not "
                        f"divide seq_len {model.seq_len}", "pick a cp with 2 x cp dividing it")
    if layout.cp_impl == "ulysses" and layout.cp > 1 and (model.heads // layout.tp) % layout.cp:
        raise PlanError(Axis.CP, layout.cp, f"Ulysses splits a rank's {model.heads // layout.tp} "
                        "heads over cp, which does not divide them", "ring, or another cp")


def optimizer_bytes(batch: Batch) -> float:
    """Bytes the optimizer step reads and writes per parameter: the weights (master copy under
    mixed precision) and the optimizer states read and written, the gradient read, and the
    16-bit copy written under mixed precision."""
    per = state_bytes(batch)
    weights = per["master_weights"] or per["parameters"]
    touched = 2 * weights + 2 * per["optimizer_states"] + per["gradients"]
    return touched + (per["parameters"] if batch.mixed else 0)


def _optimizer_and_offload(layout, model, hw, batch, p_dev, m,
                           disk_bw: float) -> tuple[float, float]:
    """(device optimizer seconds, offload seconds) per step.

    Offloaded optimizer (cpu or disk): the node's CPU steps every rank's partition at host
    memory bandwidth; gradients go down (every micro-batch from ZeRO-2 on, once under ZeRO-1)
    and the updated 16-bit parameters come back; disk reads and writes master and moments.
    Offloaded parameters (ZeRO-3): every unit is fetched for the forward and the backward of
    every micro-batch (through the host from disk), and written back after the step. The disk's
    bytes are offload.py's (what shardwise's store moves), for every rank of the node, at
    ``disk_bw`` (offload.disk_rate: the disk, or the page cache when the state is small)."""
    per = state_bytes(batch)
    touched = optimizer_bytes(batch)
    step_bw = hw.optimizer_bw or hw.mem_bw
    if layout.num_ps:
        share = model.params / layout.num_ps
        return share * (2 * 4 + 2 * per["optimizer_states"] + 4) / step_bw, 0.0
    owned = p_dev / (layout.dp_shard if layout.zero else 1)
    if not layout.offloaded:
        return owned * touched / step_bw, 0.0
    on_node = min(hw.devices_per_node, layout.world)
    device_s = off = 0.0
    params = per["parameters"] * owned
    if layout.offload == "none":
        device_s = owned * touched / step_bw
    else:
        grads = (m if layout.zero >= 2 else 1) * per["gradients"] * owned
        off += on_node * owned * touched / hw.host_mem_bw + (grads + params) / hw.host_bw
    if layout.offload_params != "none":
        fetch = 2 * m * params
        back = params if layout.offload == "none" else 0.0   # else counted with the optimizer
        off += (fetch + back) / hw.host_bw
    off += on_node * offload.disk_bytes_per_step(layout, batch, owned, m) / disk_bw
    return device_s, off


def estimate(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> Estimate:
    """Memory, communication, compute, bubble, step time and MFU of ``layout``."""
    _check(layout, model, hw)
    mem = memory(layout, model, hw, batch)
    m = layout.microbatches(batch.global_batch)
    p_dev = max(stage_params(model, layout.pp, s) for s in {0, layout.pp - 1}) / layout.tp
    t_mb = microbatch_seconds(layout, model, hw, batch)
    fwd = t_mb / (4 if layout.act_ckpt else 3)
    bwd = t_mb - fwd
    units = layers_on_stage(model, layout.pp, 0)
    dp = comm.dp_traffic(layout, p_dev, hw, batch, units=units)
    tp = comm.tp_time(layout, model, hw, batch, layers_on_stage(model, layout.pp, 0))
    cp = comm.cp_time(layout, model, hw, batch, layers_on_stage(model, layout.pp, 0))
    # interleaved: a micro-batch crosses v times as many stage boundaries per rank
    p2p = comm.p2p_stage_time(layout, model, hw, batch) * layout.virtual_stages
    # what compute can hide: all of it on accelerators, none where collectives need the cores
    hide_fwd, hide_bwd = fwd * hw.comm_overlap, bwd * hw.comm_overlap
    per_mb = _exposed_per_microbatch(dp, hide_fwd, hide_bwd, units)
    slot = t_mb + tp + cp + p2p + per_mb
    once = dp.after_step + (dp.last_backward if layout.pp > 1 else
                            max(0.0, dp.last_backward - hide_bwd))
    optimizer_s, offload_s = _optimizer_and_offload(
        layout, model, hw, batch, p_dev, m,
        offload.disk_rate(hw, mem.disk_per_node, mem.host_per_node))
    ps = comm.ps_time(layout, model, hw, batch)
    idle = bubble_slots(layout.schedule, layout.pp, layout.virtual_stages)
    pipe = _pipeline_seconds(layout, hw, m, idle, slot, t_mb)
    bubble_s = pipe - m * slot
    step = pipe + once + optimizer_s + offload_s + ps
    across = dp.across_replicas * (1 if layout.zero == 1 else m)
    traffic = {Axis.TP: m * tp, Axis.CP: m * cp, "p2p": m * p2p, Strategy.PS: ps,
               Axis.DP: m * (dp.per_microbatch_rs + dp.per_microbatch_ag) + dp.last_backward
               + dp.after_step - across, "replicas": across}
    tokens = batch.global_batch * model.seq_len
    why = _why_not(mem, hw)
    return Estimate(
        layout=layout, memory=mem.device, memory_role=mem.role, capacity=hw.usable_memory,
        host_per_node=mem.host_per_node, disk_per_node=mem.disk_per_node, fits=not why,
        why_not=why, microbatches=m, compute_s=m * t_mb, comm_s=sum(traffic.values()),
        comm_exposed_s=m * (tp + cp + p2p + per_mb) + once + ps, comm=traffic,
        bubble=idle / (m + idle), bubble_s=bubble_s,
        optimizer_s=optimizer_s, offload_s=offload_s, step_s=step, tokens_per_step=tokens,
        startup=mem.startup, startup_host_per_node=mem.startup_host_per_node,
        disk_io_per_node=_disk_io(layout, batch, p_dev, m, hw),
        mfu=model.flops_per_token() * tokens / (step * layout.world * hw.peak(batch.precision)))


def _pipeline_seconds(layout: Layout, hw: Hardware, m: int, idle: float, slot: float,
                      t_mb: float) -> float:
    """Seconds of the ``m + idle`` slots of a step on the busiest stage.

    When a node runs more ranks than can compute at once (``Hardware.compute_lanes``: CPU
    processes sharing cores), ``t_mb`` is the rate with every rank computing; while some idle
    in the bubble the others run up to ``ranks / lanes`` faster. The step is then the longer
    of the pipeline's critical path at that faster rate and this rank's own work at the
    contended rate (the cores cannot do more in total): ``max((m + idle) * slot_free,
    m * slot)``. With a device per rank, ``(m + idle) * slot``."""
    ranks = min(hw.devices_per_node, layout.world)
    lanes = hw.compute_lanes
    if not idle or not lanes or ranks <= lanes:
        return (m + idle) * slot
    free = slot - t_mb + t_mb * lanes / ranks
    return max((m + idle) * free, m * slot)


def _exposed_per_microbatch(dp: comm.DataParallelTraffic, fwd: float, bwd: float,
                            units: int = 1) -> float:
    """ZeRO-2/3 traffic of one micro-batch not hidden by its compute.

    ZeRO-3 gathers unit by unit with one unit of prefetch: unit i+1's gather runs while unit i
    computes, so a pass exposes the first unit's gather in full and, for every other unit,
    whatever of its gather its predecessor's compute does not cover; the backward does the same
    with gather + reduce-scatter per unit, and the last unit's reduce-scatter is exposed.
    ZeRO-2's reduce-scatter (no gathers) hides behind the backward as a whole. ZeRO-3 whose
    shard group spans nodes hides nothing (``DataParallelTraffic.exposed``)."""
    if dp.per_microbatch_ag == 0:
        return max(0.0, dp.per_microbatch_rs - bwd)
    if dp.exposed:                          # ZeRO-3 across nodes (comm.zero3_across_nodes)
        return dp.per_microbatch_ag + dp.per_microbatch_rs
    n = max(1, units)
    gather, rs = dp.per_microbatch_ag / 2 / n, dp.per_microbatch_rs / n
    forward = gather + (n - 1) * max(0.0, gather - fwd / n)
    backward = gather + (n - 1) * max(0.0, gather + rs - bwd / n) + rs
    return forward + backward


def _disk_io(layout: Layout, batch: Batch, p_dev: float, m: int, hw: Hardware) -> float:
    """Bytes a node's disk moves per step (offload.py), every rank of the node together."""
    owned = p_dev / (layout.dp_shard if layout.zero else 1)
    on_node = min(hw.devices_per_node, layout.world)
    return on_node * offload.disk_bytes_per_step(layout, batch, owned, m)


def _why_not(mem, hw: Hardware) -> str:
    """Empty when device, host and disk memory suffice (and, under eager init, the host holds
    the whole model per rank at start-up), else which one runs out, by how much."""
    if mem.total > hw.usable_memory:
        left = (f" (the {1 - hw.headroom:.0%} a plan may fill: --headroom)"
                if hw.headroom else "")
        return (f"memory: needs {fmt_bytes(mem.total)} per device ({mem.role}), "
                f"has {fmt_bytes(hw.usable_memory)}{left}")
    if mem.host_per_node > hw.host_memory_bytes:
        return (f"host memory: offload needs {fmt_bytes(mem.host_per_node)} per node, "
                f"has {fmt_bytes(hw.host_memory_bytes)}")
    if mem.disk_per_node > hw.disk_bytes:
        return (f"disk: offload needs {fmt_bytes(mem.disk_per_node)} per node, "
                f"has {fmt_bytes(hw.disk_bytes)}")
    if mem.startup_host_per_node > hw.host_memory_bytes:
        return (f"start-up: --init eager builds the whole fp32 model on every rank, "
                f"{fmt_bytes(mem.startup_host_per_node)} per node, has "
                f"{fmt_bytes(hw.host_memory_bytes)} (--init meta builds only each rank's part)")
    return ""
