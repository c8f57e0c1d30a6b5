"""Compute seconds of one micro-batch on the busiest pipeline stage: GEMMs, non-GEMM kernels,
fixed costs.

Per stage (the first and the last are compared; the last also runs the output head)::

    t = F / R x slowdown  +  blocks x (elementwise + block_overhead)

- ``F / R x slowdown``: the stage's training FLOPs (``ModelSpec.block_flops``: x 4/3 with full
  recomputation, + 4 s h per token with selective) at ``R = peak x efficiency``, slowed where
  the block's GEMMs are small (kernels.py: ``max(F/R, B/W) + gemm_latency`` per GEMM). For the
  catalogue's A100 ``efficiency`` is the GEMM plateau; elsewhere it is a whole-layer rate.
- ``elementwise``: the memory-bound kernels between the GEMMs (layer norms, softmax, dropout,
  GeLU, bias and residual adds) move ``Hardware.activation_passes`` times the block's
  activation bytes through device memory at ``mem_bw``. The bytes are Korthikanti et al. 2022's
  count (memory.activation_per_layer, eq. 2: ``s b h (10 + 24/t) + 5 a s^2 b / t`` in 16 bits,
  ``/ t`` throughout with sequence parallelism, no score term with fused attention or ring
  context parallelism), counted whether or not they are kept for backward: selective
  recomputation keeps fewer of them but does the same work, and recomputes the attention core's
  (one third more of its bytes, its forward); full recomputation repeats the forward (x 4/3, as
  for the FLOPs). This is what makes a wide layer run nearer the GEMM rate than a narrow one:
  the GEMMs grow as ``h^2 / t`` per token, these kernels as ``h`` (``a s`` for the scores).
  ``activation_passes = 0`` where a calibration timed whole blocks (its rate has them already).
- ``block_overhead``: fixed seconds per block (launches), x 4/3 when the forward runs twice.
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.planner import kernels
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import activation_per_layer, layers_on_stage
from shardwise.planner.model import ModelSpec


def elementwise_seconds(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> float:
    """Seconds of one block's non-GEMM kernels for one micro-batch on one device (module
    docstring): ``activation_passes`` x the block's activation bytes / ``mem_bw``."""
    if not hw.activation_passes:
        return 0.0
    worked = replace(layout, selective_recompute=False)      # the work, not what is kept
    touched = activation_per_layer(model, worked, batch, full=True)
    if layout.act_ckpt:
        touched *= 4 / 3
    elif layout.selective_recompute:                         # the attention core's forward again
        touched += (touched - activation_per_layer(model, layout, batch, full=True)) / 3
    return hw.activation_passes * touched / hw.mem_bw


def microbatch_seconds(layout: Layout, model: ModelSpec, hw: Hardware, batch: Batch) -> float:
    """Compute seconds of one micro-batch on the busiest stage's device (module docstring)."""
    block = model.block_flops(layout.recompute)
    rate = hw.flops(batch.precision)
    gemms = kernels.block_gemms(model.hidden, model.heads, model.ffn,
                                max(1, model.seq_len // layout.cp), layout.micro_batch, layout.tp)
    slow = kernels.slowdown(gemms, rate, hw.mem_bw, hw.gemm_latency, 2 if batch.mixed else 4)
    tokens = layout.micro_batch * model.seq_len / layout.tp / layout.cp
    fixed = (elementwise_seconds(layout, model, hw, batch)
             + hw.block_overhead * (4 / 3 if layout.act_ckpt else 1))

    def stage(index: int, head: bool) -> float:
        blocks = layers_on_stage(model, layout.pp, index)
        flops = (blocks * block + (model.head_flops if head else 0.0)) * tokens
        return flops / rate * slow + blocks * fixed

    if layout.pp == 1:
        return stage(0, head=True)
    return max(stage(0, head=False), stage(layout.pp - 1, head=True))
