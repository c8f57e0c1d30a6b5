"""Sequence parallelism (``--sp``, with ``--tp`` > 1): the part of each transformer layer that
tensor parallelism replicates runs on a 1/T slice of the sequence instead.

Tensor parallelism (parallel/tensor.py) splits attention and the MLP over the T tp ranks but
keeps the residual stream, the layer norms, the residual adds and the dropout whole on every
rank: the same (B, S, h) work and memory T times. Sequence parallelism cuts those regions along
the sequence: rank r holds positions [rS/T, (r+1)S/T). Megatron's f and g change to match
(comm/autograd.py):

    f  identity fwd / all-reduce bwd   ->  all-gather along the sequence fwd / reduce-scatter bwd
    g  all-reduce fwd / identity bwd   ->  reduce-scatter along the sequence fwd / all-gather bwd

An all-reduce is a reduce-scatter followed by an all-gather, so each layer moves what it moved
under tp, and nothing in between is computed twice.

Partition (plan fields ``regions`` and ``norm``, shardwise/models/plans.py: our GPT, HF GPT-2,
HF Llama). The embedding (vocab-parallel, its all-reduce unchanged) and the position embedding
run whole; the first block's input is cut to this rank's slice (no communication). Inside every
block, each region (attention, MLP) gathers its input to the whole sequence on entry (its own
reshapes read the sequence length off that input), its column-parallel layers lose their f (the
gather's backward already sums the ranks' gradients), and its row-parallel output is
reduce-scattered to the slice instead of all-reduced. Norms, residual adds and dropout between
regions see only the slice. The final norm runs on the slice; its output is gathered (backward:
reduce-scattered) before the vocab-parallel head, so the head's output, the vocab-parallel
cross-entropy (parallel/tensor_loss.py) and a user's loss on ``engine(x)`` see the same logits as
under tp alone. The sequence length must divide by T (refused before launch, and by the ops).

Replicated parameters used on a slice (every norm's weight and bias in the blocks and the final
norm, the row-parallel biases added after the reduce-scatter) get only their slice's part of the
gradient. Each is summed over tp by an autograd op on its use (comm/autograd.sum_grad_over_tp,
meter ``sp_grad``): the module's forward reads the parameter through that op, so the backward
hands autograd the whole sequence's gradient before it is accumulated into ``.grad``. Every
data-parallel stage reads gradients at or after accumulation (DDP's bucket views, ZeRO's
post-accumulate hooks, micro-batches accumulating in turn), so each sees the tp sum already,
whatever it does over dp; the op sits in the graph, so activation checkpointing recomputes it
with the rest. (A hook on the parameter tensor instead would rely on every stage keeping each
parameter object, hooks included, through its storage swaps: ZeRO-3 swaps meta parameters.) Those gradients are then identical on every tp
rank, so clipping counts them once (TensorPlan.counts: replicated -> tp rank 0), as before.

Collectives, per training step (K = B*S*h elements of the residual stream, fp32, L layers;
each all-gather or reduce-scatter of K is metered at (T-1)/T * 4K bytes per rank, its ring
volume; "a unit" below):
    sp_ag   forward: the two region entries per layer and the final norm's gather; backward:
            the two row outputs per layer, the first block's cut, and the re-gathers of the
            regions' inputs (one per region, shared by its column layers: q, k and v re-gather
            once) and of the head's input when the head reads the final gather directly (our
            GPT; GPT-2 and Llama reshape or index it first, so their head keeps its input
            whole): 6L + 3 calls for our GPT, 6L + 2 for GPT-2 and Llama
    sp_rs   4L + 1 calls: the two row outputs forward and the two region entries backward per
            layer; the final gather's backward
    sp_grad one all-reduce per slice-used parameter and backward (norm weights and biases, row
            biases): 2(T-1)/T * 4 * its size bytes (6L + 2 vectors of h for our GPT)
    tp_vocab  the embedding's all-reduce of K and the loss's two small ones, as under tp; the
            head's f (an all-reduce of K in backward) is gone: the final gather's backward sums
Against tp's 8L + 2 units (4L + 1 all-reduces: the layers' f and g, the head's f; the
embedding's all-reduce is common to both), sp moves 10L + 4 for our GPT: the forward and the
gradient path move exactly tp's volume, plus 2L + 1 backward re-gathers (Megatron's price for
keeping only slices, section 4.2.2 of the paper; as there, each is launched before the
input-gradient matmul, which hides it: comm/autograd.Regather) and the first
block's backward gather (the embedding keeps its all-reduce: a reduce-scatter there would leave
the position embedding and the models' mask and position code, which read the embedding's
length, on a slice).

Memory per rank: every saved activation between regions (norm inputs, and the regions' inputs,
which their column layers save as the slice and re-gather in backward) is / T, so the residual
stream's share of a layer's saved activations (Korthikanti et al.'s 10 sbh of 34 sbh + 5as^2b
per layer at T = 1) is divided by T too; inside attention and the MLP, tp already divides them.
A region's whole input lives only from its entry to its last column layer, and again in
backward from the first re-gather to the last. Weights: as tp.

Dropout. Inside the blocks every random draw falls on this rank's own part: the slice between
regions (the blocks' residual dropout) and this rank's heads inside attention. Each block's
forward therefore draws from a stream of this tp rank's own (Megatron's model-parallel RNG
tracker, in our words): on entry it takes one number from the process's shared generator (the
same on every tp rank, and saved and restored with a checkpoint), seeds a fork of the generator
with it and the tp rank, runs the block and restores the shared generator on exit. So the
ranks' slices get independent masks (with one shared stream, slice 0 and slice 1 would be
dropped at the same offsets), the whole-sequence dropout before the first block (replicated,
then cut) still draws the same mask on every rank, activation checkpointing's recompute
replays the block's masks (it restores the shared generator before the block), and a resumed
run draws what an uninterrupted one does. Models without dropout skip the fork.

Not with: pipeline parallelism (stages would pass slices), LoRA adapters: each refused in one line.

Reference: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4.2.2; Megatron-LM's ``sequence_parallel``.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from shardwise.comm.autograd import (gather_for_region, linear_on_gathered, passthrough,
                                     reduce_scatter_to_sequence, scatter_to_sequence,
                                     sum_grad_over_tp)
from shardwise.comm.collectives import Comm, Group
from shardwise.models.plans import ModelPlan, plan_of


def apply_sequence_parallel(model: nn.Module, mesh, comm: Comm) -> list[str]:
    """Turn ``model``, already split by apply_tensor_parallel over ``mesh.tp_group``, sequence
    parallel in place (module docstring). Parameter names and values are unchanged. Returns
    the names of the parameters whose gradients are summed over tp. tp = 1: nothing."""
    group = mesh.tp_group
    if group.size == 1:
        return []
    plan = _plan(model)
    modules = dict(model.named_modules())
    regions = [p for p in modules if plan.matches(p, plan.regions)]
    _refuse(model, plan, modules, regions)
    blocks = plan.blocks_of(model)
    blocks[0].register_forward_pre_hook(
        _on_input(lambda x: scatter_to_sequence(x, comm, group)), with_kwargs=True)
    if _has_dropout(model):
        for block in blocks:
            _own_random_stream(block, group.rank)
    summed = []
    for path, mod in modules.items():
        split = plan.split_of(path)
        if split is not None and split.style in ("colwise", "vocab_head"):
            mod.enter = passthrough             # the region's (or the final) gather sums
            mod.matmul = linear_on_gathered     # and saves the slice, not the whole input
        elif split is not None and split.style == "rowwise":
            mod.reduce = reduce_scatter_to_sequence
            summed += _sum_grads(mod, path, ["bias"], comm, group)
        elif path in regions:
            mod.register_forward_pre_hook(
                _on_input(lambda x: gather_for_region(x, comm, group)), with_kwargs=True)
        elif _between_regions(path, plan, regions) or path == plan.norm:
            summed += _sum_grads(mod, path, list(mod._parameters), comm, group)
    modules[plan.norm].register_forward_hook(
        lambda m, args, out: gather_for_region(out, comm, group))
    return summed


def _plan(model: nn.Module) -> ModelPlan:
    plan = plan_of(model)
    if plan is None or not plan.regions or not plan.norm:
        name = type(model).__name__
        raise TypeError(f"sequence parallelism needs the model plan's regions (attention, "
                        f"MLP) and final norm; {name}'s plan has none; fix: ModelPlan("
                        "regions=(...), norm=...) in shardwise.register_plan, or drop --sp")
    return plan


def _refuse(model: nn.Module, plan: ModelPlan, modules: dict, regions: list[str]) -> None:
    """What sequence parallelism cannot run, in one line each (ValueError)."""
    if any(hasattr(m, "lora_A") for m in model.modules()):
        raise ValueError("sequence parallelism does not split LoRA adapters; fix: drop --sp "
                         "or --lora-rank")
    for path, mod in modules.items():
        split = plan.split_of(path)
        if split and split.style in ("colwise", "rowwise") and not _inside(path, regions):
            raise ValueError(f"sequence parallelism: the split layer {path} lies outside the "
                             "plan's regions; fix: name its module in ModelPlan.regions")


DROPOUT_ATTRS = ("dropout", "attention_dropout", "attn_pdrop", "resid_pdrop")


def _has_dropout(model: nn.Module) -> bool:
    """Whether any module drops out: an ``nn.Dropout`` with p > 0, or a float rate passed to a
    functional call (our attention's ``dropout``, Llama's ``attention_dropout``)."""
    for mod in model.modules():
        if isinstance(mod, nn.Dropout) and mod.p > 0:
            return True
        if any(isinstance(getattr(mod, a, None), float) and getattr(mod, a) > 0
               for a in DROPOUT_ATTRS):
            return True
    return False


def _own_random_stream(block: nn.Module, tp_rank: int) -> None:
    """Run ``block``'s training forward on a random stream of this tp rank's own (module
    docstring, "Dropout"): seeded by one draw of the shared generator and the rank."""
    inner = block.forward

    def forward(*args, **kwargs):
        if not block.training:
            return inner(*args, **kwargs)
        shared = int(torch.randint(0, 2**62, (1,)))
        device = next(block.parameters()).device
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed((shared + 1_000_003 * (tp_rank + 1)) % (2**63 - 1))
            return inner(*args, **kwargs)
    block.forward = forward


def _inside(path: str, regions: list[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in regions)


def _between_regions(path: str, plan: ModelPlan, regions: list[str]) -> bool:
    """A module of a block outside its regions: it runs on the slice."""
    return path.startswith(plan.blocks + ".") and not _inside(path, regions)


def _on_input(op):
    """A forward pre-hook applying ``op`` to a module's first argument (the hidden states),
    passed by position or by its name (Llama's ``self_attn(hidden_states=...)``)."""
    def hook(module, args, kwargs):
        if args:
            return (op(args[0]), *args[1:]), kwargs
        name = list(inspect.signature(type(module).forward).parameters)[1]   # after self
        return args, {**kwargs, name: op(kwargs[name])}
    return hook


def _sum_grads(mod: nn.Module, path: str, names: list[str], comm: Comm, group: Group) -> list:
    """Make ``mod``'s forward read its parameters ``names`` through sum_grad_over_tp (module
    docstring): for the call, each entry of ``_parameters`` is the op's output, then restored.
    Returns the full names of the parameters it covers."""
    names = [n for n in names if mod._parameters.get(n) is not None]
    if not names:
        return []
    inner = mod.forward

    def forward(*args, **kwargs):
        own = {n: mod._parameters[n] for n in names}
        for n, p in own.items():
            mod._parameters[n] = sum_grad_over_tp(p, comm, group) if p.requires_grad else p
        try:
            return inner(*args, **kwargs)
        finally:
            mod._parameters.update(own)
    mod.forward = forward
    return [f"{path}.{n}" for n in names]
