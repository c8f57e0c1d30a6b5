"""Memory per device, by the ledger's categories, for one layout.

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3.1), bytes per parameter, N = dp
(HSDP: N = dp_shard, the shard group; each replica group holds a whole copy of the states):

=====================  ======  =====  ======  =========  ========================
precision / optimizer  params  grads  master  optimizer  DDP total
=====================  ======  =====  ======  =========  ========================
mixed (bf16/fp16) Adam   2       2      4        8       16  (ZeRO's "2 + 2 + K", K=12)
fp32 Adam                4       4      0        8       16
mixed SGD (momentum)     2       2      4        4       12
fp32 SGD (momentum)      4       4      0        4       12
=====================  ======  =====  ======  =========  ========================

ZeRO-1 divides master and optimizer by N, ZeRO-2 the gradients too, ZeRO-3 everything: for
mixed Adam 16P, 4P + 12P/N, 2P + 14P/N, 16P/N (``convention="zero-paper"``, the default).
``convention="deepspeed"`` counts as DeepSpeed's ``estimate_zero2/3_model_states_mem_needs``
do, with the fp32 gradient partition the optimizer steps on: ZeRO-1 and ZeRO-2 ``4P + 16P/N``
(whole 16-bit gradients, DeepSpeed's stage 1 and 2 share one implementation), ZeRO-3
``18P/N`` plus 4 bytes per parameter of the largest unit (here in buffers: two gathered blocks).

Offload (any combination, ``Layout.offload`` and ``Layout.offload_params``): ``offload`` moves
master, optimizer and the fp32 gradient partition (4P/N) to cpu or disk, from ZeRO-2 on the
device keeps only gradient buckets; ``offload_params`` (ZeRO-3) moves the 16-bit parameter
partition too, e.g. ZeRO-3 with only the optimizer on the cpu keeps 2P/N on the device.

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 2 and section 4), 16-bit, no flash attention:
``s b h (10 + 24/t) + 5 a s^2 b / t`` bytes, where 24 = 8 + 4f/h for an MLP of width f; with
sequence parallelism every term is divided by t (``s b h 34/t + ...``). Full recomputation keeps
``2 s b h`` per layer (the block input) plus one block's full activations while it recomputes;
selective recomputation drops only the attention core's ``5 a s^2 b / t``.
The output layer adds ``4 s b V / t`` (fp32 logits) on the last stage. fp32 doubles everything.
Fused attention (``ModelSpec.fused_attention``: FlashAttention, torch's
``scaled_dot_product_attention``) keeps no ``s x s`` matrix for backward (only the output and a
row of softmax statistics, ``a s b`` floats): the ``5 a s^2 b / t`` term is dropped, as
selective recomputation drops it (Korthikanti et al. sec. 4 note the same of FlashAttention).
Measured (shardwise/bench/validate_planner_memory.py): shardwise's GPT at L=8, h=768, s=128,
b=2 in fp32 saves 97.6 MiB, the formula without the term reads 102 MiB (the 34 counts two
dropout masks, 2 s b h, that a model without dropout does not keep), with it 132 MiB.
Start-up (``Memory.startup``, ``Batch.init``): under ``init="meta"`` (shardwise's default) each
rank materialises only what it keeps, in fp32, one block at a time: its ``4 P_dev`` (``4 P_dev /
N`` under ZeRO-3), never the whole model. Under ``init="eager"`` every rank first builds the
whole fp32 model on the host (``4 P``), so a node's host holds ``4 P`` per rank at start-up.
A pipeline stage holds ``m`` micro-batches in flight under GPipe and ``min(m, pp - i)`` at stage
i under 1F1B; the first and the last stage are checked and the larger total is reported.

The peak instant (``Memory.peak``). Each category above is its own high-water mark, and they
are not reached at the same moment: saved activations peak at the end of forward, before any
gradient bucket is in use, and are mostly freed by the end of backward, when the buckets are
reducing and (ZeRO-2/3) the gradient shards exist. So the device's peak is the persistent
states (parameters, master weights, optimizer states, and the gradients where they persist:
DDP, ZeRO-1, pipelines, any run of several micro-batches per step; the mapped shared memory of
planner/buffers.py) plus the larger of two phases: forward's end (activations + the buffers
live in forward: ZeRO-3's gathered units) and backward's end / the step (the transient
gradients + ZeRO's staging and the backend's copies: ZeRO-2/3's shard, or a single replica's
``p.grad`` freed by ``zero_grad``). Communication buffers by kind: planner/buffers.py. Within
backward the gradients grow as the activations are freed, layer by layer, so for uniform layers
the larger phase bounds every instant in between. ``total`` adds every category and is kept as the conservative figure
(the planner's ``fits`` and its tables use it); ``peak`` is what the measured peak resident
memory is compared with. The sum over-reads the peak by at most min(activations, buckets +
transient gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.buffers import buffer_parts, forward_buffers  # noqa: F401 (re-exported)
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.model import ModelSpec

CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights", "activations",
              "buffers")
"""The memory ledger's categories, in order."""


@dataclass(frozen=True)
class Memory:
    """Memory of the fullest device of a layout."""

    device: dict[str, float]
    """Bytes per category (see ``CATEGORIES``) on that device."""
    role: str
    """Which device that is: ``rank`` (all alike), ``stage 0``, ``last stage``, ``worker``,
    ``server``."""
    host_per_node: float
    """Bytes offloaded to each node's host memory (``offload=cpu``)."""
    disk_per_node: float
    """Bytes offloaded to each node's disk (``offload=disk``)."""
    peak: float = 0.0
    """Bytes on that device at the peak instant of a step (module docstring): persistent states
    plus the larger of forward's end and backward's end; at most ``total``."""
    startup: float = 0.0
    """Bytes one rank builds at start-up (module docstring): its own fp32 parameters under
    meta init, the whole fp32 model under eager init."""
    startup_host_per_node: float = 0.0
    """Bytes of each node's host memory the start-up takes: the whole fp32 model per rank
    under eager init (it is built on the host), 0 under meta init."""

    @property
    def total(self) -> float:
        """All categories together."""
        return sum(self.device.values())


def state_bytes(batch: Batch) -> dict[str, int]:
    """Bytes per parameter of each model state, for a precision and an optimizer (table above)."""
    mixed = batch.mixed
    return {"parameters": 2 if mixed else 4, "gradients": 2 if mixed else 4,
            "master_weights": 4 if mixed else 0,
            "optimizer_states": 8 if batch.optimizer == "adam" else 4}


def layers_on_stage(model: ModelSpec, pp: int, stage: int) -> int:
    """Blocks on pipeline stage ``stage``: balanced, the first ``L % pp`` stages get one more."""
    return model.layers // pp + (1 if stage < model.layers % pp else 0)


def stage_params(model: ModelSpec, pp: int, stage: int) -> int:
    """Parameters on a stage: its blocks, the embeddings on the first stage, the final norm and
    output head on the last (a tied head is a second copy there when pp > 1, as in Megatron)."""
    params = layers_on_stage(model, pp, stage) * model.layer_params
    if stage == 0:
        params += model.embedding_params
    if stage == pp - 1:
        params += model.head_params
        if model.tied_embeddings and pp > 1:
            params += model.vocab * model.hidden
    return params


def model_states(p_dev: float, layout: Layout, batch: Batch) -> tuple[dict[str, float],
                                                                  dict[str, float]]:
    """(device bytes per state, bytes moved to ``{"cpu": .., "disk": ..}``) for ``p_dev``
    parameters, in ``batch.convention`` (module docstring)."""
    per = state_bytes(batch)
    n = layout.dp_shard
    shard = {"parameters": n if layout.zero >= 3 else 1, "gradients": n if layout.zero >= 2 else 1,
             "master_weights": n if layout.zero >= 1 else 1,
             "optimizer_states": n if layout.zero >= 1 else 1}
    states = {k: per[k] * p_dev / shard[k] for k in per}
    fp32_grads = 4 * p_dev / n       # the fp32 gradient partition the (host) optimizer steps on
    if batch.convention == "deepspeed" and batch.mixed and layout.zero >= 1:
        # DeepSpeed's stage 1/2 keep the whole 16-bit gradient plus the fp32 partition (4 + 16/N);
        # stage 3 counts the fp32 partition only (18/N), the unit's 16-bit grads in buffers.
        states["gradients"] = (2 * p_dev if layout.zero < 3 else 0.0) + fp32_grads
    moved = {"cpu": 0.0, "disk": 0.0}
    if layout.offload != "none":
        # master, optimizer and the fp32 gradient partition move; from ZeRO-2 on the device keeps
        # only gradient buckets (counted in buffers), under ZeRO-1 its whole 16-bit gradients.
        moved[layout.offload] += states["master_weights"] + states["optimizer_states"] + fp32_grads
        states["master_weights"] = states["optimizer_states"] = 0.0
        if layout.zero >= 2:
            states["gradients"] = 0.0
        elif batch.convention == "deepspeed" and batch.mixed:
            states["gradients"] -= fp32_grads
    if layout.offload_params != "none":
        moved[layout.offload_params] += states["parameters"]
        states["parameters"] = 0.0
    return states, moved


def activation_per_layer(model: ModelSpec, layout: Layout, batch: Batch, full: bool) -> float:
    """Bytes one block keeps for one micro-batch; ``full=False`` gives the checkpointed input.
    Context parallelism: each rank keeps ``s / cp`` positions; ring attention keeps no scores
    (each block is recomputed from its log-sum-exp), Ulysses keeps the scores of ``a / cp``
    heads over the whole sequence unless the attention is fused."""
    s, b, h, t, cp = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.cp
    scale = 1 if batch.mixed else 2
    sp = t if layout.sequence_parallel else 1
    if not full:
        return scale * 2 * s * b * h / sp / cp
    unsplit = 10 / sp
    split = (8 + (8 if model.gated_mlp else 4) * model.ffn / h) / t   # SwiGLU keeps 4 f-wide
    dropped = layout.selective_recompute or model.fused_attention \
        or (cp > 1 and layout.cp_impl == "ring")                         # no s x s kept
    attention = 0.0 if dropped else 5 * model.heads * s * s * b / t / cp
    s = s / cp
    return scale * (s * b * h * (unsplit + split) + attention)


def stage_activations(model: ModelSpec, layout: Layout, batch: Batch, stage: int,
                      microbatches: int) -> float:
    """Activation bytes held by one device of ``stage`` at the peak of a step."""
    pp = layout.pp
    if pp == 1:
        in_flight = 1
    elif layout.schedule == "gpipe":
        in_flight = microbatches
    elif layout.schedule == "zb-h1":          # W of stage s deferred by s: p on every stage
        in_flight = min(microbatches, pp)
    elif layout.schedule == "interleaved-1f1b":   # chunks of 1/v stage (pipeline/interleaved.py)
        v = layout.virtual_stages
        in_flight = min(microbatches * v, (pp - stage - 1) * 2 + (v - 1) * pp + 1) / v
    else:
        in_flight = min(microbatches, pp - stage)
    layers = layers_on_stage(model, pp, stage)
    full = activation_per_layer(model, layout, batch, full=True)
    if layout.act_ckpt:
        held = in_flight * layers * activation_per_layer(model, layout, batch, full=False) + full
    else:
        held = in_flight * layers * full
    if stage == pp - 1:
        held += 4 * model.seq_len * layout.micro_batch * model.vocab / layout.tp / layout.cp
    return held


def peak_instant(device: dict[str, float], parts: dict[str, float], layout: Layout,
                 microbatches: int, forward_buffers: float = 0.0) -> float:
    """Bytes at the step's peak instant (module docstring): persistent states (and the mapped
    shared memory, planner/buffers.py) plus the larger of forward's end (activations + the
    buffers live in forward: ZeRO-3's units, ``forward_buffers``) and backward's end (the
    transient gradients + ZeRO's transient buffers at their peak). Gradients are transient when
    one micro-batch makes the step (accumulation keeps them through the next forward) and
    nothing holds them between steps: ZeRO-2/3 free their shard after the step, a single
    device's ``p.grad`` go at ``zero_grad(set_to_none=True)`` (torch's default). Every other
    layout keeps its whole gradients in a flat buffer that persists: DDP's and ZeRO-1's
    buckets, the contiguous gradient buffer of tensor and pipeline parallelism (Megatron's;
    shardwise's DDP buckets under a pipeline), a parameter-server worker's."""
    alone = layout.dp == layout.cp == layout.tp == layout.pp == 1 and not layout.num_ps
    transient = microbatches == 1 and (layout.zero >= 2 or alone)
    grads = device["gradients"] if transient else 0.0
    persistent = sum(device[k] for k in ("parameters", "master_weights", "optimizer_states"))
    persistent += device["gradients"] - grads + parts.get("shared", 0.0)
    forward = device["activations"] + forward_buffers
    backward = grads + sum(v for k, v in parts.items() if k != "shared")
    return persistent + max(forward, backward)


def _device(model, layout, batch, stage, microbatches, hw: Hardware) -> tuple[dict[str, float],
                                                                               dict, float]:
    """(categories, bytes moved to cpu / disk, bytes at the peak instant) for one device of
    ``stage``; the backend's copies and the same-host shared memory from ``hw``
    (planner/buffers.py)."""
    p_dev = stage_params(model, layout.pp, stage) / layout.tp
    states, offloaded = model_states(p_dev, layout, batch)
    states["activations"] = stage_activations(model, layout, batch, stage, microbatches)
    copies, shared = hw.collective_copies, hw.allreduce_bw > 0
    if shared and layout.zero and layout.dp_shard * layout.tp <= hw.devices_per_node:
        copies = 0.0          # ZeRO's collectives through shared memory: no backend copies
    parts = buffer_parts(model, layout, batch, p_dev, copies, stage, shared)
    fwd = forward_buffers(model, layout, batch, p_dev, copies, stage)
    states["buffers"] = sum(parts.values())
    device = {k: states[k] for k in CATEGORIES}
    return device, offloaded, peak_instant(device, parts, layout, microbatches, fwd)


def _server(model: ModelSpec, layout: Layout, batch: Batch) -> dict[str, float]:
    """A parameter server: its 1/num_ps of the fp32 weights, fp32 gradient sums, optimizer, and
    its message buffers: a receive posted for every worker's push (they land as they come, in
    any order), a reply in flight to every worker, and one it stages the update in, 2W + 1
    fp32 messages of its share (shardwise/parallel/ps.py; Li et al. 2014's servers likewise
    buffer one message per worker connection)."""
    share = model.params / layout.num_ps
    per = state_bytes(batch)
    return {"parameters": 4 * share, "gradients": 4 * share, "optimizer_states":
            per["optimizer_states"] * share, "master_weights": 0.0, "activations": 0.0,
            "buffers": 4 * share * (2 * layout.dp + 1)}


def memory(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> Memory:
    """The fullest device's memory, and what offload puts on each node's host or disk."""
    m = layout.microbatches(batch.global_batch)
    first, offloaded, first_peak = _device(model, layout, batch, 0, m, hw)
    candidates = [("stage 0" if layout.pp > 1 else "rank", first, first_peak)]
    if layout.pp > 1:
        last, _, last_peak = _device(model, layout, batch, layout.pp - 1, m, hw)
        candidates.append(("last stage", last, last_peak))
    if layout.num_ps:
        # a worker keeps no optimizer, and a push and a pull message of the whole fp32 model
        # (parallel/ps.py); both hold every category through the step
        worker = dict(first, master_weights=0.0, optimizer_states=0.0,
                      buffers=2 * 4.0 * model.params)
        server = _server(model, layout, batch)
        candidates = [("worker", worker, sum(worker.values())),
                      ("server", server, sum(server.values()))]
    role, device, peak = max(candidates, key=lambda c: sum(c[1].values()))
    on_node = min(hw.devices_per_node, layout.world)
    host, disk = offloaded["cpu"] * on_node, offloaded["disk"] * on_node
    startup, startup_host = startup_bytes(model, layout, batch), 0.0
    if batch.init == "eager":
        startup_host = startup * on_node
    return Memory(device=device, role=role, host_per_node=host, disk_per_node=disk, peak=peak,
                  startup=startup, startup_host_per_node=startup_host)


def startup_bytes(model: ModelSpec, layout: Layout, batch: Batch) -> float:
    """Bytes one rank builds at start-up (module docstring): meta, its own fp32 parameters (the
    fuller of the first and last stage, its tp slice, its ZeRO-3 shard); eager, the whole fp32
    model."""
    if batch.init == "eager" or layout.num_ps:
        return 4.0 * model.params
    p_dev = max(stage_params(model, layout.pp, s) for s in {0, layout.pp - 1}) / layout.tp
    return 4.0 * p_dev / (layout.dp_shard if layout.zero >= 3 else 1)
