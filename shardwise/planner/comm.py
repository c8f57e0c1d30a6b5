"""Communication time of each collective a layout runs, alpha-beta model on ring algorithms.

For ``K`` bytes (the full tensor) over ``N`` ranks with bandwidth ``bw`` and per-step latency
``alpha`` (Patarasuk & Yuan 2009; Thakur et al. 2005):

- ring allreduce: each rank sends ``2 (N-1)/N K`` bytes in ``2 (N-1)`` steps:
  ``t = 2 (N-1)/N K / bw + 2 (N-1) alpha``;
- reduce-scatter and all-gather: half of that, ``(N-1)/N K / bw + (N-1) alpha``;
- point-to-point: ``K / bw + alpha``;
- every collective call (each bucket, unit, tp allreduce, parameter-server push or pull) adds
  ``Hardware.collective_overhead``: what a collective costs beyond that model when it follows
  compute (arrival skew, waking the backend's threads), measured by the CPU calibration.

Per layout and step (``P_dev`` parameters per device, g / w bytes per gradient / weight,
m micro-batches, b micro-batch size):

- DDP: one allreduce of ``g P_dev`` (in buckets; latency paid per bucket; inside one node at
  ``Hardware.allreduce_bw`` where a faster same-host path serves it, as it serves ZeRO's
  reduce-scatters and all-gathers); across nodes the
  faster of a flat ring and the hierarchical algorithm (intra-node reduce-scatter, inter-node
  ring on the shard, intra-node all-gather: ``dp_collective``), for ZeRO's collectives too;
- ZeRO-1: reduce-scatter of the gradients + all-gather of the updated weights, once per step;
- HSDP (``dp_replicate`` x ``dp_shard``): the ZeRO collectives over the shard group (inside a
  node when it fits one, at ``intra_bw``), and after each reduce-scatter an allreduce of its
  ``g P_dev / dp_shard`` shard over the ``dp_replicate`` groups (across nodes, at each device's
  share of the node's network): FSDP's hybrid sharding, whose only inter-node traffic that is;
- ZeRO-2: the reduce-scatter every micro-batch (gradients are not kept whole), the all-gather
  once; ZeRO-3: per micro-batch two all-gathers of the weights (forward, backward) and one
  reduce-scatter: 1.5x DDP's volume (ZeRO paper, section 7), one message per unit (block);
  across nodes at each device's adapter share and exposed (:func:`zero3_across_nodes`: what
  the published ZeRO-3 runs at 384-2240 GPUs show);
- TP (Megatron, Shoeybi et al. 2019): per block and micro-batch 2 allreduces of ``b s h``
  activations in forward and 2 in backward, 2 more in the recomputed forward (the same volume
  as all-gather + reduce-scatter with sequence parallelism); the vocabulary-parallel embedding
  and head add one ``b s h`` allreduce each (embedding forward, head input's backward) and the
  vocabulary-parallel cross-entropy two of ``b s`` values (row max; sum of exponentials with
  the target logit);
- PP: per micro-batch one activation send forward and one gradient send backward of
  ``b s h / tp`` values (Megatron's scatter-gather across the tp ranks);
- parameter server: each worker pushes ``g P`` and pulls ``w P``; the busiest server (1/num_ps
  of the parameters) receives and sends that share from every worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import layers_on_stage, state_bytes
from shardwise.planner.model import ModelSpec


def ring_allreduce_bytes(k: float, n: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``k`` bytes over ``n`` ranks: 2(n-1)/n k."""
    return 2 * (n - 1) / n * k


def allreduce_time(k: float, n: int, bw: float, alpha: float, messages: int = 1,
                   overhead: float = 0.0) -> float:
    """Ring allreduce of ``k`` bytes over ``n`` ranks, sent as ``messages`` separate buckets,
    each paying ``overhead`` (``Hardware.collective_overhead``) besides its ring steps."""
    if n <= 1:
        return 0.0
    return ring_allreduce_bytes(k, n) / bw + messages * (2 * (n - 1) * alpha + overhead)


def reduce_scatter_time(k: float, n: int, bw: float, alpha: float, messages: int = 1,
                        overhead: float = 0.0) -> float:
    """Ring reduce-scatter (or all-gather) of a ``k``-byte tensor over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * k / bw + messages * ((n - 1) * alpha + overhead)


all_gather_time = reduce_scatter_time
"""An all-gather moves the same bytes in the same steps as a reduce-scatter."""


def p2p_time(k: float, bw: float, alpha: float, overhead: float = 0.0) -> float:
    """One point-to-point send of ``k`` bytes."""
    return k / bw + alpha + overhead


@dataclass(frozen=True)
class DataParallelTraffic:
    """Seconds of the dp-axis collectives of one step, split by when they can run."""

    per_microbatch_rs: float
    """Reduce-scatter (or, for DDP, nothing) run after every micro-batch's backward."""
    per_microbatch_ag: float
    """All-gathers run in every micro-batch (ZeRO-3: forward and backward together)."""
    last_backward: float
    """Run once per step, during the last micro-batch's backward (DDP allreduce, ZeRO-1's
    reduce-scatter)."""
    after_step: float
    """Run once per step after the optimizer (ZeRO-1/2 all-gather of the updated weights)."""
    across_replicas: float = 0.0
    """HSDP: the part of each reduce-scatter's time (``per_microbatch_rs`` or, under ZeRO-1,
    ``last_backward``) spent averaging the shard across replica groups."""
    exposed: bool = False
    """ZeRO-3 whose shard group spans nodes: its gathers and reduce-scatters are on the
    critical path, none hidden behind compute (:func:`zero3_across_nodes`)."""


def dp_collective(kind: str, k: float, layout: Layout, hw: Hardware, messages: int) -> float:
    """An allreduce (``kind="ar"``) or reduce-scatter / all-gather (``"rs"``) of ``k`` bytes over
    the ZeRO shard group (``dp_shard`` ranks ``tp`` apart: all of dp without HSDP); see
    :func:`group_collective`."""
    return group_collective(kind, k, layout.dp_shard, layout.tp, hw, messages)


def replica_allreduce(k: float, layout: Layout, hw: Hardware, messages: int) -> float:
    """HSDP: the allreduce that averages a reduced gradient shard (``k / dp_shard`` of the
    ``k`` gradient bytes) across the ``dp_replicate`` replica groups (ranks ``dp_shard * tp``
    apart: across nodes when a shard group fills a node, at each device's share of the node's
    network). 0 without HSDP."""
    if not layout.hsdp:
        return 0.0
    return group_collective("ar", k / layout.dp_shard, layout.dp_replicate,
                            layout.dp_shard * layout.tp, hw, messages)


def group_collective(kind: str, k: float, n: int, stride: int, hw: Hardware,
                     messages: int) -> float:
    """An allreduce (``kind="ar"``) or reduce-scatter / all-gather (``"rs"``) of ``k`` bytes over
    ``n`` ranks ``stride`` apart, the faster of a flat ring (``Hardware.link``) and the
    hierarchical algorithm (NCCL's choice across nodes): a reduce-scatter among the group's
    ``k_n`` members of each node over NVLink / PCIe, the ``1 / k_n`` shard reduced across the
    nodes at the node's network share per device (``inter_bw / devices_per_node``, every device
    of a node sends at once), then (allreduce) an all-gather inside the node again."""
    g = hw.devices_per_node
    bw, alpha = hw.link(n, stride)
    if hw.allreduce_bw and stride * n <= g:
        # the same-host shared-memory collectives (Hardware.allreduce_bw, comm/shm.py): the
        # allreduce, and ZeRO's reduce-scatter and all-gather, each half its volume
        bw = hw.allreduce_bw
    elif hw.collective_copies:
        # a backend that copies (gloo) runs reduce-scatter and all-gather as an allreduce of a
        # whole-size buffer: measured at world 2 on 16 MiB, 28 and 18 ms against 17.5 ms
        kind = "ar"
    ring = allreduce_time if kind == "ar" else reduce_scatter_time
    calls = messages * hw.collective_overhead if n > 1 else 0.0
    flat = ring(k, n, bw, alpha, messages) + calls
    local = g // stride if stride < g else 1
    if n <= 1 or stride * n <= g or local <= 1:
        return flat
    nodes = math.ceil(n / local)
    intra = reduce_scatter_time(k, local, hw.intra_bw, hw.intra_latency, messages)
    inter_bw = min(hw.intra_bw, hw.inter_bw / g)
    across = ring(k / local, nodes, inter_bw, hw.inter_latency, messages)
    return min(flat, (2 if kind == "ar" else 1) * intra + across + calls)


def spans_nodes(layout: Layout, hw: Hardware) -> bool:
    """Whether the ZeRO shard group (``dp_shard`` ranks ``tp`` apart) leaves one node."""
    return layout.dp_shard * layout.tp > hw.devices_per_node


def zero3_across_nodes(k: float, layout: Layout, hw: Hardware, messages: int) -> float:
    """A ZeRO-3 all-gather or reduce-scatter of ``k`` bytes over a shard group spanning nodes:
    a flat ring at each device's own share of its node's network (``inter_bw / G``), every
    unit a message, exposed (``DataParallelTraffic.exposed``).

    Why, from the published runs (Narayanan et al. 2021, Table 2: ZeRO-3 without model
    parallelism, 175B on 384-1536 and 530B on 640-2240 A100s, DGX nodes with 8 x 200 Gb/s):
    doubling the GPUs at a fixed batch leaves the step time unchanged (175B 768 -> 1536, 530B
    1120 -> 2240), so the step is bound by bandwidth, not latency (a ring moves (N-1)/N of the
    bytes per rank whatever N); the rate this implies is about one 200 Gb/s adapter per GPU
    (16-23 GB/s for ZeRO's 3 x 2P bytes, against the 22.5 effective here), not the node's eight
    that staging through NVLink could use (:func:`group_collective`'s hierarchical path); and at
    the smallest counts (384, 640), where that traffic is shorter than the compute, the step is
    still longer than the compute by about the traffic: it was not hidden. Charging it so puts
    all six rows within 20% (docs/planner.md, "Published runs"); the ideal (staged, prefetched)
    collectives put the throughput 1.2-4x too high. A runtime that does better across nodes
    (rings staged per node, one unit of prefetch: FSDP) is then estimated conservatively."""
    bw = min(hw.intra_bw, hw.inter_bw / hw.devices_per_node)
    calls = messages * hw.collective_overhead
    return reduce_scatter_time(k, layout.dp_shard, bw, hw.inter_latency, messages) + calls


def dp_traffic(layout: Layout, p_dev: float, hw: Hardware, batch: Batch,
               units: int = 1) -> DataParallelTraffic:
    """Seconds each dp collective of ``layout`` takes, for ``p_dev`` parameters per device.
    ZeRO-3 gathers and reduces per unit (a block): ``units`` messages of ``1 / units`` each,
    each paying the ring's latency (ZeRO-3's per-unit gather latency). HSDP: the collectives
    run over the shard group, and each reduce-scatter is followed by the replica allreduce of
    its shard (shardwise's ``hsdp_grad_ar``), counted with it and in ``across_replicas``."""
    n = layout.dp * layout.cp                  # the gradient group: dp x cp
    per = state_bytes(batch)
    grads, weights = per["gradients"] * p_dev, per["parameters"] * p_dev
    buckets = max(1, math.ceil(grads / layout.bucket_bytes))
    if n <= 1 or layout.num_ps:
        return DataParallelTraffic(0.0, 0.0, 0.0, 0.0)
    messages = max(units, 1) if layout.zero >= 3 else buckets
    across = replica_allreduce(grads, layout, hw, messages)
    rs = dp_collective("rs", grads, layout, hw, messages) + across
    ag = dp_collective("rs", weights, layout, hw, messages)
    if layout.zero == 0:
        return DataParallelTraffic(0.0, 0.0, dp_collective("ar", grads, layout, hw, buckets), 0.0)
    if layout.zero == 1:
        return DataParallelTraffic(0.0, 0.0, rs, ag, across)
    if layout.zero == 2:
        return DataParallelTraffic(rs, 0.0, 0.0, ag, across)
    if spans_nodes(layout, hw):
        rs = zero3_across_nodes(grads, layout, hw, messages) + across
        ag = zero3_across_nodes(weights, layout, hw, messages)
        return DataParallelTraffic(rs, 2 * ag, 0.0, 0.0, across, exposed=True)
    return DataParallelTraffic(rs, 2 * ag, 0.0, 0.0, across)


def tp_time(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch, layers: int) -> float:
    """Tensor-parallel allreduces of one micro-batch through ``layers`` blocks."""
    if layout.tp <= 1:
        return 0.0
    bw, alpha = hw.link(layout.tp, 1)
    act = 2 if batch.mixed else 4
    rows = layout.micro_batch * model.seq_len
    k = rows * model.hidden * act
    count = (6 if layout.act_ckpt else 4) * layers   # selective recompute stays inside a region
    # the vocabulary pieces: embedding (first stage) and head (last); a pipeline's busiest
    # stage holds one of them, its head with the loss's two small allreduces
    count += 1 if layout.pp > 1 else 2
    small = allreduce_time(rows * 4, layout.tp, bw, alpha, 1, hw.collective_overhead) \
        + allreduce_time(2 * rows * 4, layout.tp, bw, alpha, 1, hw.collective_overhead)
    return count * allreduce_time(k, layout.tp, bw, alpha, 1, hw.collective_overhead) + small


def cp_time(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch, layers: int) -> float:
    """Context parallelism's attention traffic of one micro-batch through ``layers`` blocks, per
    rank, as shardwise/comm/context.py moves it (keys and values as wide as the queries: the
    planner's model has no grouped-query heads, so this is the upper bound). A block is
    ``E = micro_batch x seq_len / cp x hidden / tp`` values:
      ring     forward cp - 1 sends of keys and values (2E each); backward cp - 1 again and cp
               sends of their fp32 gradients, one hop more to reach home; p2p over the cp
               ranks (``tp`` apart)
      ulysses  forward one all-to-all of q, k, v (3E) and one of the output (E), (cp-1)/cp of
               each leaving the rank; backward the same two
    Full recomputation runs the forward's sends again. Counted as exposed: the ring launches
    each send before the block it replaces, so on accelerators part of it hides (an upper
    bound there)."""
    n = layout.cp
    if n <= 1:
        return 0.0
    bw, alpha = hw.link(n, layout.tp)
    act = 2 if batch.mixed else 4
    e = layout.micro_batch * model.seq_len / n * model.hidden / layout.tp
    if layout.cp_impl == "ring":
        forward = (n - 1) * (2 * e * act / bw + alpha)
        backward = (n - 1) * (2 * e * act / bw + alpha) + n * (2 * e * 4 / bw + alpha)
    else:
        forward = (n - 1) / n * 4 * e * act / bw + 2 * (alpha + hw.collective_overhead)
        backward = forward
    return layers * ((2 if layout.act_ckpt else 1) * forward + backward)


def p2p_stage_time(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> float:
    """One micro-batch's sends across one stage boundary: activation forward, gradient back."""
    if layout.pp <= 1:
        return 0.0
    bw, alpha = hw.intra_bw, hw.intra_latency
    if layout.tp * layout.cp * layout.dp * layout.pp > hw.devices_per_node:
        # Some stage boundary crosses nodes; there all of a stage's devices on the node
        # (tp * cp * dp of them, at most a node) send through the node's adapters at once.
        senders = min(hw.devices_per_node, layout.tp * layout.cp * layout.dp)
        bw, alpha = min(hw.intra_bw, hw.inter_bw / senders), hw.inter_latency
    act = 2 if batch.mixed else 4
    k = layout.micro_batch * model.seq_len * model.hidden * act / layout.tp / layout.cp
    # no collective_overhead: a one-way transfer's sender does not wait for its receiver
    # (measured here: a 1 MiB send after 8 ms of compute costs 0.2-1.8 ms, an allreduce 3-4 ms)
    return 2 * p2p_time(k, bw, alpha)


def ps_time(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> float:
    """Push gradients and pull weights through the busiest of ``num_ps`` servers."""
    if not layout.num_ps:
        return 0.0
    per = state_bytes(batch)
    volume = (per["gradients"] + per["parameters"]) * model.params
    bw, alpha = hw.intra_bw, hw.intra_latency
    if layout.world > hw.devices_per_node:
        # Across nodes every device of a node pushes and pulls at once: a node's share each.
        bw, alpha = min(hw.intra_bw, hw.inter_bw / hw.devices_per_node), hw.inter_latency
    worker = volume / bw
    server = layout.dp * volume / layout.num_ps / bw
    return max(worker, server) + 2 * (alpha + hw.collective_overhead) * layout.dp


def stage_layers(model: ModelSpec, layout: Layout) -> int:
    """Blocks on the fullest pipeline stage (the first, when L % pp != 0)."""
    return layers_on_stage(model, layout.pp, 0)
