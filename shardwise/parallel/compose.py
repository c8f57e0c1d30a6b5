"""The composer: one function applies every part of a layout to a model, in one order.

    parallelize(model, optimizer_factory, cfg, mesh, comm, device, loss_fn) -> Strategy

Order (torchtitan's ``parallelize``; each step sees only what the earlier ones made, and the code
below follows it step by step):

 0. model techniques  LoRA adapters injected (``memory.lora_rank`` > 0: base weights frozen;
                     memory/lora.py), then ``memory.freeze``'s globs frozen (memory/freeze.py):
                     every later step keeps requires_grad, and every data-parallel stage gives
                     frozen parameters no gradient, optimizer state or traffic. Then, for a
                     model on the meta device (``--init meta``, the run's default), a
                     Materializer (models/init.py) records each tensor's unit before steps 2-3
                     restructure it; each rank later makes only what it keeps, one unit (block)
                     at a time, initialised from the seed (or, with ``--hf-weights``, read
                     from the safetensors files: only this rank's bytes, models/weights.py),
                     the same under every layout: single /
                     dp / ps and stages 0-2 fill what steps 2-3 left (the whole model, its tp
                     slice, this rank's stage) just before step 6; ZeRO-3 fills unit by unit as
                     it shards (step 6), so no rank holds the whole model, and nothing is
                     broadcast at the start
 1. model plan       which parameters tensor parallelism splits and how, which modules are
                     blocks and where stages cut (models/plans.py: shardwise's GPT, HF GPT-2
                     and Llama, registered user classes; a model without one: tp and pp are
                     refused with one line)
 2. tensor parallel  tp > 1 or pp > 1: the layers swapped for their tp slices over
                     ``mesh.tp_group``; the loss becomes the vocab-parallel cross-entropy
                     (parallel/tensor.py). A model built on the meta device (``--init meta``,
                     the run's default) stays there: each slice only records which piece of
                     which unit it is. A model handed over in memory is first moved and
                     broadcast from global rank 0 (meter ``init_broadcast``: slices and stages
                     are cut from the same weights)
 2b. sequence parallel   ``--sp`` (tp > 1): the tp-replicated parts of each block (norms,
                     residual adds, dropout) on a 1/tp slice of the sequence; the split layers'
                     all-reduces become reduce-scatters and all-gathers along the sequence
                     (parallel/sequence.py; meter ``sp_ag`` / ``sp_rs`` / ``sp_grad``)
 2c. context parallel    ``--cp`` > 1: every sequence cut over the cp ranks (2 x cp chunks,
                     causally balanced); the attention becomes ring attention or Ulysses
                     over ``mesh.cp_group``, positions and targets follow the cut
                     (parallel/context.py; meter ``cp_ring`` / ``cp_a2a``); the gradient sync
                     of step 6 then runs over dp x cp (``mesh.grad_group``); under a pipeline
                     the driver cuts each step's batch (its ``batch_view``), since stages never
                     call the model's forward
 3. pipeline split   pp > 1: this rank keeps its stage, or its v chunks when interleaved
                     (parallel/pipeline/driver.cut)
 4. activation checkpointing   each of this rank's blocks recomputed in backward (memory/)
 4b. compile         ``--compile``: the forward of each of this rank's blocks
                     ``torch.compile``d in place (memory/compile.py); after 4, so that the
                     compiled graph holds the checkpoint (Dynamo traces it as one op and the
                     partitioner plans the recompute, rather than a compiled function being
                     re-run from autograd's backward), and before 6, which hooks the same
                     parameters and blocks as without it (nothing is swapped; module hooks,
                     ZeRO-3's gathers among them, stay eager around the compiled forward); the
                     loss, the optimizer and the gradient sync's collectives stay eager
 5. mixed precision  the run's precision reaches every later step through the config: the
                     component's autocast (stage 0, and the pipeline's executor), or bf16 /
                     fp16 working copies with fp32 masters (stages 1-3); fp16 adds the
                     component's loss scaler
 6. gradient sync    the data-parallel component of parallel/data/ at ``zero_stage`` 0-3 over
                     ``mesh.grad_group`` (dp; dp x cp under --cp), on whatever steps 2-3
                     left (the whole model, its tp slice, or this rank's stage; a TensorPlan tells it how the norm sums over
                     tp and pp); under a pipeline its gradients stay whole until the step's
                     last backward (``accumulate_unsharded``)
 7. optimizer wrappers   the optimizer built by the component on what it shards (the user's
                     factory, its parameter groups kept; 8-bit Adam when the factory makes it);
                     offload of masters and states (memory/offload.py, stages 1-3)
 8. driver           pp = 1: the component runs the step itself (Strategy.train_step, the
                     plain loop); pp > 1: parallel/pipeline/driver.PipelineDriver runs the
                     schedule and hands the component its gradients

The strategy names ``ddp``, ``zero1``-``zero3``, ``tp``, ``pp`` and ``3d`` are presets of
(zero stage, tp, pp) (shardwise/parallel/presets.py), so they all come through steps 1-8. ``single``,
``dp`` (one process's replicas, torch.nn.DataParallel's scheme) and ``ps`` (parameter server)
stay layouts of their own: they run on no mesh axis (single, dp) or on roles instead of one
(ps: servers and workers), take steps 0, 4 and 4b only, and are built by the registry.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm
from shardwise.config import Config
from shardwise.memory.checkpointing import apply_activation_checkpointing
from shardwise.memory.compile import compile_blocks
from shardwise.memory.freeze import freeze
from shardwise.memory.lora import inject_lora
from shardwise.mesh import Mesh
from shardwise.models.init import Materializer, is_meta
from shardwise.models.plans import block_class_names, plan_class, plan_of
from shardwise.models.weights import source_for
from shardwise.parallel import strategy_class
from shardwise.parallel.base import LossFn, OptimizerFactory, Strategy
from shardwise.parallel.data import stage_class
from shardwise.parallel.pipeline import driver
from shardwise.parallel.context import apply_context_parallel, context_loss
from shardwise.parallel.sequence import apply_sequence_parallel
from shardwise.parallel.tensor import TensorPlan, split_from_rank0
from shardwise.parallel.presets import DATA_MODEL, zero_stage


def parallelize(model: nn.Module, optimizer_factory: OptimizerFactory, cfg: Config, mesh: Mesh,
                comm: Comm, device: torch.device, loss_fn: LossFn) -> Strategy:
    """Apply ``cfg``'s layout (resolved: shardwise/layout.resolve) to ``model`` in the order of
    the module docstring; returns the strategy that trains it."""
    p, m = cfg.parallel, cfg.memory
    # --hf-weights on the meta path: read by the model's own names, before LoRA renames them
    source = source_for(model, cfg.model) if is_meta(model) else None
    if m.lora_rank > 0:                                                   # 0
        inject_lora(model, m.lora_rank, m.lora_alpha, m.lora_targets)
    if m.freeze:
        freeze(model, m.freeze)
    mat = Materializer(model, cfg.train.seed, source=source) if is_meta(model) else None
    plan = plan_of(model)                                                 # 1
    blocks = None if plan is None else plan.blocks_of(model)
    if p.strategy not in DATA_MODEL:                          # single, dp, ps: their own layouts
        if mat is not None:                    # they keep the whole model: all of it, now
            mat.fill_module(model)
        if m.activation_checkpointing:                                    # 4
            apply_activation_checkpointing(model, blocks)
        if m.compile:                                                     # 4b
            compile_blocks(blocks)
        strategy = strategy_class(p.strategy)(cfg, mesh, comm, device, loss_fn)
        strategy.wrap(model, optimizer_factory)
        return strategy
    if (mesh.tp > 1 or mesh.pp > 1) and plan is None:
        name = type(model).__name__
        raise TypeError(f"tensor and pipeline parallelism split a model by its plan; {name} "
                        f"has none; fix: shardwise.register_plan({name}, ModelPlan(...)) "
                        "(shardwise/models/plans.py), or use --dp with --zero-stage 0-3")
    owner = plan_class(type(model))
    if mesh.pp > 1 and type(model).forward is not owner.forward:
        name = type(model).__name__
        raise TypeError(f"a pipeline runs the stages of {owner.__name__}'s plan, not "
                        f"{name}.forward, which {name} overrides (it would be ignored); fix: "
                        f"shardwise.register_plan({name}, ModelPlan(...)) with pieces that do "
                        f"what its forward does, or train {name} with pp = 1")
    specs = {}
    if mesh.tp > 1 or mesh.pp > 1:                                        # 2
        model, specs, loss_fn = split_from_rank0(model, mesh, comm, device, loss_fn, mat)
    if p.sequence_parallel:                                               # 2b
        apply_sequence_parallel(model, mesh, comm)
    cp_batch = None
    if mesh.cp > 1:                                                       # 2c
        cp_batch = apply_context_parallel(model, mesh, comm, p.cp_impl)
        loss_fn = context_loss(loss_fn, comm, mesh.cp_group)
    cut = units = None
    if mesh.pp > 1:                                                       # 3
        units = block_class_names(model)   # ZeRO-3's unit class, read off the whole model
        cut = driver.cut(model, cfg, mesh)
        model = cut.stage
    kept = {id(b) for b in model.modules()}          # this rank's blocks: its stage's
    mine = None if blocks is None else [b for b in blocks if id(b) in kept]
    if m.activation_checkpointing:                                        # 4
        apply_activation_checkpointing(model, mine)
    if m.compile:                                                         # 4b
        compile_blocks(mine)
    # 5: the precision is read from cfg.memory by the component and the executor
    grads = stage_class(zero_stage(cfg))(cfg, mesh, comm, device, loss_fn)   # 6
    grads.plan = _tensor_plan(model, specs, cut, comm, mesh)
    if cut is not None:
        grads.accumulate_unsharded = True
        if zero_stage(cfg) == 3:
            grads.unit_classes = units    # ZeRO-3's units: the whole model's block class
    if mat is not None:               # made from the seed on every rank: nothing to broadcast
        grads.deterministic_start = True
        if zero_stage(cfg) == 3:
            grads.materializer = mat  # ZeRO-3 makes one unit at a time and keeps its shard
        else:
            mat.fill_module(model)    # the rest keep what is left whole: this rank's part
    grads.wrap(model, optimizer_factory)                                  # 6, 7
    if mat is not None:
        mat.release()
    if cut is None:                                                       # 8
        return grads
    pipeline = driver.PipelineDriver(cfg, mesh, comm, device, loss_fn, cut, grads)
    pipeline.batch_view = cp_batch or pipeline.batch_view   # 2c's cut of each step's batch
    return pipeline


def _tensor_plan(model: nn.Module, specs: dict, cut, comm: Comm, mesh: Mesh) -> TensorPlan | None:
    """What the gradient-sync component must know of steps 2 and 3: the tp split of the
    parameters it holds, by its own names; under a pipeline also the pp group (each stage's
    squares summed too) and the last stage's copies of tied weights (counted on the first)."""
    if cut is None:
        return TensorPlan(specs, comm, mesh.tp_group) if mesh.tp > 1 else None
    name = model.global_name
    local = {n: specs[name(n)] for n, _ in model.named_parameters() if name(n) in specs}
    copies = frozenset(n for n, _ in model.named_parameters() if model.is_tied_copy(n))
    return TensorPlan(local, comm, mesh.tp_group, stages=mesh.pp_group, uncounted=copies)
