"""The composer: one function applies every part of a layout to a model, in one order.

    parallelize(model, optimizer_factory, cfg, mesh, comm, device, loss_fn) -> Strategy

Order (torchtitan's ``parallelize``; each step sees only what the earlier ones made):

 0. model techniques  LoRA adapters injected (``memory.lora_rank`` > 0: base weights frozen;
                     memory/lora.py), then ``memory.freeze``'s globs frozen (memory/freeze.py):
                     every later step keeps requires_grad, and every data-parallel stage gives
                     frozen parameters no gradient, optimizer state or traffic
 1. model plan       which parameters tensor parallelism splits and how, which modules are
                     blocks and where stages cut (models/plans.py: shardwise's GPT, HF GPT-2
                     and Llama, registered user classes; a model without one: tp and pp are
                     refused with one line)
 2. tensor parallel  global rank 0's weights broadcast over the world (meter
                     ``init_broadcast``), then the GPT's layers swapped for their tp slices over
                     ``mesh.tp_group``; the loss becomes the vocab-parallel cross-entropy
 3. pipeline split   ``pp`` > 1: this rank keeps its stage (parallel/pipeline/), driven by the
                     schedule; done by parallel/hybrid.py together with steps 2 and 6
 4. activation checkpointing   each block's forward recomputed in backward (memory/)
 5. mixed precision  inside the data-parallel step: autocast around forward (stage 0), or bf16 /
                     fp16 working copies with fp32 masters (stages 1-3)
 6. data parallel    the component of parallel/data/ at ``zero_stage`` 0-3 over ``mesh.dp_group``
                     (pp > 1: hybrid.py hands each stage to DDP at stage 0, or runs its
                     flat ZeRO-1 at stage 1)
 7. optimizer wrappers   the optimizer built on what the stage shards; offload of masters and
                     states (memory/offload.py, stages 1-3)

The strategy names are presets of (zero stage, tp, pp) (shardwise/layout.py), so ``ddp``,
``zero1``-``zero3``, ``tp``, ``pp`` and ``3d`` all come through here; ``single``, ``dp``
(one-process replicas) and ``ps`` (parameter server) are layouts of their own and skip steps 1-3.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm
from shardwise.config import Config
from shardwise.presets import DATA_MODEL, zero_stage
from shardwise.memory.checkpointing import apply_activation_checkpointing
from shardwise.memory.freeze import freeze
from shardwise.memory.lora import inject_lora
from shardwise.mesh import Mesh
from shardwise.models.plans import plan_of
from shardwise.parallel import strategy_class
from shardwise.parallel.base import LossFn, OptimizerFactory, Strategy
from shardwise.parallel.data import stage_class
from shardwise.parallel.tensor import TensorPlan, split_from_rank0


def parallelize(model: nn.Module, optimizer_factory: OptimizerFactory, cfg: Config, mesh: Mesh,
                comm: Comm, device: torch.device, loss_fn: LossFn) -> Strategy:
    """Apply ``cfg``'s layout (resolved: shardwise/layout.resolve) to ``model`` in the order of
    the module docstring; returns the strategy that trains it."""
    p, m = cfg.parallel, cfg.memory
    if m.lora_rank > 0:                                           # 0
        inject_lora(model, m.lora_rank, m.lora_alpha, m.lora_targets)
    if m.freeze:
        freeze(model, m.freeze)
    if m.activation_checkpointing:                                # 4 (before any hooks)
        plan = plan_of(model)
        apply_activation_checkpointing(model, None if plan is None else plan.blocks_of(model))
    if p.strategy not in DATA_MODEL:                              # single, dp, ps
        strategy = strategy_class(p.strategy)(cfg, mesh, comm, device, loss_fn)
        strategy.wrap(model, optimizer_factory)
        return strategy
    if (mesh.tp > 1 or mesh.pp > 1) and plan_of(model) is None:   # 1
        name = type(model).__name__
        raise TypeError(f"tensor and pipeline parallelism split a model by its plan; {name} "
                        f"has none; fix: shardwise.register_plan({name}, ModelPlan(...)) "
                        "(shardwise/models/plans.py), or use --dp with --zero-stage 0-3")
    if mesh.pp > 1:                                               # 2, 3, 6 in hybrid.py
        strategy = strategy_class("3d")(cfg, mesh, comm, device, loss_fn)
        strategy.wrap(model, optimizer_factory)
        return strategy
    plan = None
    if mesh.tp > 1:                                               # 2
        model, specs, loss_fn = split_from_rank0(model, mesh, comm, device, loss_fn)
        plan = TensorPlan(specs, comm, mesh.tp_group)
    strategy = stage_class(zero_stage(cfg))(cfg, mesh, comm, device, loss_fn)   # 5, 6, 7
    strategy.plan = plan
    strategy.wrap(model, optimizer_factory)
    return strategy
