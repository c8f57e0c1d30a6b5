"""Tensor parallelism (Megatron-LM): each transformer layer's weights split across the tp group.

What is split comes from the model's plan (shardwise/models/plans.py: shardwise's GPT, Hugging
Face GPT-2 and Llama, or a plan a person registers); below, the GPT's names. GPT-2's Conv1D
layers (weight (in, out)) are split on their other dimension; Llama's q / k / v projections
are split by heads (key-value heads too, so tp must divide them), o_proj and down_proj are
row-parallel, gate_proj and up_proj column-parallel, RMSNorm and the rotary table replicated.

Partition (tp ranks r = 0..T-1, GPT of width h, H heads, vocabulary V):
  - attention: ``qkv`` is column-parallel by heads (rank r keeps the q, k and v rows of heads
    [rH/T, (r+1)H/T)), so attention runs on H/T local heads with no communication; ``proj`` is
    row-parallel (input columns of those heads), its bias replicated and added after the sum.
  - MLP: ``fc`` column-parallel (4h/T output rows), ``proj`` row-parallel (4h/T input columns).
  - vocabulary: ``tok_emb`` rows and ``head`` rows split by vocabulary (uneven splits allowed);
    the loss is the vocab-parallel cross-entropy, so no rank holds the (b, s, V) logits.
  - layer norms and the position embedding are replicated; their gradients come out identical
    on every tp rank (their inputs' gradients are already summed by f), so they need no traffic.
    ``--sp`` (parallel/sequence.py) runs the norms on a slice of the sequence instead, swapping
    each layer's f / g (``enter``, ``reduce``) for all-gathers and reduce-scatters along it.

Collectives (b*s*h elements each, fp32): per layer, forward two allreduces (g after attn.proj and
after mlp.proj: meter ``tp_fwd``); backward two allreduces (f before qkv and before fc: ``tp_bwd``).
The vocabulary pieces add, per forward, one b*s*h allreduce (embedding) and two b*s allreduces
(loss: max, then [sum-exp, target logit]); per backward one b*s*h allreduce (f before the head):
meter ``tp_vocab``. Ring traffic per step and rank: (4L + 2) * 2(T-1)/T * b*s*h*4 bytes + small.

Memory per rank: weights of the blocks, embedding and head / T (+ replicated norms, biases,
pos_emb); activations inside attention and MLP / T; the residual stream is replicated.

Reference: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (2019); picotron's tensor_parallel.py for the built-from-the-full-weight layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.comm.autograd import (all_gather_uneven, copy_to_tp, reduce_from_tp, shard_range,
                                     vocab_parallel_embedding)
from shardwise.comm.buckets import broadcast_coalesced
from shardwise.comm.collectives import Comm, Group
from shardwise.memory.lora import LoRALinear
from shardwise.models.init import Piece
from shardwise.models.plans import plan_of
from shardwise.parallel.tensor_checks import check_heads
from shardwise.parallel.tensor_lora import ColumnParallelLoRA, RowParallelLoRA
from shardwise.parallel.tensor_loss import tp_loss


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over tp: along ``dim``, in ``parts`` interleaved groups (qkv: 3)
    of size ``full`` each, rank r holding piece r of ``split_sizes(full, T)`` of every group."""
    dim: int
    full: int
    parts: int = 1


def _rows(spec: ShardSpec, rank: int, size: int, device=None) -> torch.Tensor:
    """Indices along spec.dim that tp rank ``rank`` keeps, on ``device`` (the sliced tensor's:
    CUDA's index_select refuses an index on another device)."""
    start, end = shard_range(spec.full, rank, size)
    return torch.cat([torch.arange(j * spec.full + start, j * spec.full + end, device=device)
                      for j in range(spec.parts)])


def shard_tensor(t: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor (a copy, on the tensor's own device)."""
    return t.detach().index_select(spec.dim, _rows(spec, rank, size, t.device)).clone()


def _like(t: torch.Tensor, original: nn.Parameter) -> nn.Parameter:
    """A slice as a Parameter that keeps the original's requires_grad (frozen stays frozen)."""
    return nn.Parameter(t, requires_grad=original.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y_local = f(x) @ W_r^T + b_r: output features split; input replicated (f: allreduce
    backward). Built from the full nn.Linear, so it equals it for the same seed. ``transposed``:
    built from Hugging Face's Conv1D, whose weight is (in, out) and stays so (split on dim 1)."""

    def __init__(self, linear: nn.Module, comm: Comm, group: Group, parts: int = 1,
                 name: str = "tp_bwd", transposed: bool = False):
        super().__init__()
        self.comm, self.group, self.name, self.transposed = comm, group, name, transposed
        out = linear.weight.shape[1 if transposed else 0]
        self.spec = ShardSpec(1 if transposed else 0, out // parts, parts)
        self.bias_spec = ShardSpec(0, out // parts, parts)
        self.weight = _like(shard_tensor(linear.weight, self.spec, group.rank, group.size),
                            linear.weight)
        self.bias = None if linear.bias is None else _like(
            shard_tensor(linear.bias, self.bias_spec, group.rank, group.size), linear.bias)
        self.enter = copy_to_tp         # f; parallel/sequence.py swaps both for its own
        self.matmul = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x, self.comm, self.group, self.name)          # (B, T, in) replicated
        w = self.weight.t() if self.transposed else self.weight      # (out_local, in)
        return self.matmul(x, w, self.bias)                          # (B, T, out_local)


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W_r^T) + b: input features split, partial outputs summed (g: allreduce
    forward); the bias is replicated and added once, after the sum. ``transposed``: from a
    Conv1D (weight (in, out), split on dim 0)."""

    def __init__(self, linear: nn.Module, comm: Comm, group: Group, name: str = "tp_fwd",
                 transposed: bool = False):
        super().__init__()
        self.comm, self.group, self.name, self.transposed = comm, group, name, transposed
        self.spec = ShardSpec(0 if transposed else 1, linear.weight.shape[0 if transposed else 1])
        self.weight = _like(shard_tensor(linear.weight, self.spec, group.rank, group.size),
                            linear.weight)
        self.bias = None if linear.bias is None else _like(linear.bias.detach().clone(),
                                                           linear.bias)
        self.reduce = reduce_from_tp    # g (parallel/sequence.py: a reduce-scatter instead)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight      # (out, in_local)
        y = self.reduce(F.linear(x, w), self.comm, self.group, self.name)      # (B, T, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary); lookups summed over tp (exact)."""

    def __init__(self, emb: nn.Embedding, comm: Comm, group: Group):
        super().__init__()
        self.comm, self.group = comm, group
        self.spec = ShardSpec(0, emb.num_embeddings)
        self.vocab_start = shard_range(emb.num_embeddings, group.rank, group.size)[0]
        self.weight = _like(shard_tensor(emb.weight, self.spec, group.rank, group.size), emb.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, self.comm, self.group)


def apply_tensor_parallel(model: nn.Module, mesh, comm: Comm, mat=None) -> dict[str, ShardSpec]:
    """Swap the modules ``model``'s plan (shardwise/models/plans.py) splits for their tp-parallel
    versions over ``mesh.tp_group``, in place, and divide its attention modules' head counts.

    Parameter names are unchanged (``blocks.0.attn.qkv.weight`` ...); a weight tied to another
    split one (GPT-2's lm_head and wte: the same rows) stays tied. Returns {name: ShardSpec} of
    every split parameter (the rest are replicated). tp = 1 leaves the model as it is.
    ``mat``: the model is on the meta device; each slice (itself meta) is recorded with the
    Materializer (models/init.py) as the piece of the full weight it is, made later.
    """
    group = mesh.tp_group
    if group.size == 1:
        return {}
    plan = _plan(model)
    check_heads(plan.sizes(model) if plan.sizes else {}, group.size)
    modules = list(model.named_modules())
    ties = _ties(modules, plan)
    for path, mod in modules:
        split = plan.split_of(path)
        if split is not None:
            parent, _, leaf = path.rpartition(".")
            new = _parallel(mod, split, comm, group)
            if mat is not None:
                for piece, full, spec in _sources(new, mod):
                    mat.derive(piece, full, _slicer(spec, group))
            setattr(model.get_submodule(parent), leaf, new)
        for attr in plan.head_attrs(path):                          # local heads / widths
            setattr(mod, attr, getattr(mod, attr) // group.size)
    for path, same_as in ties:
        mod, other = model.get_submodule(path), model.get_submodule(same_as)
        if mod.spec != other.spec:
            raise ValueError(f"{path}.weight is tied to {same_as}.weight, but the plan splits "
                             "them differently; give both the vocabulary split")
        mod.weight = other.weight
    return _specs(model)


def _plan(model: nn.Module):
    plan = plan_of(model)
    if plan is None:
        name = type(model).__name__
        raise TypeError(f"tensor parallelism needs a model plan; {name} has none; fix: "
                        f"shardwise.register_plan({name}, ModelPlan(...)) (shardwise/models/"
                        "plans.py), or use --dp with --zero-stage 0-3")
    return plan


def _ties(modules, plan) -> list[tuple[str, str]]:
    """(path, path of the earlier split module whose weight it shares) for tied splits."""
    first, ties = {}, []
    for path, mod in modules:
        if plan.split_of(path) is None or not isinstance(getattr(mod, "weight", None), nn.Parameter):
            continue
        key = id(mod.weight)
        if key in first:
            ties.append((path, first[key]))
        else:
            first[key] = path
    return ties


def _parallel(mod: nn.Module, split, comm: Comm, group: Group) -> nn.Module:
    if split.style == "vocab":
        return VocabParallelEmbedding(mod, comm, group)
    if split.style == "rowwise":
        return _row(mod, comm, group, split.transposed)
    name = "tp_vocab" if split.style == "vocab_head" else "tp_bwd"
    return _column(mod, comm, group, parts=split.parts, name=name, transposed=split.transposed)


def _sources(new: nn.Module, old: nn.Module) -> list[tuple]:
    """(tensor of ``new``, the tensor of ``old`` it was cut from, its ShardSpec or None when
    copied whole) for a parallel layer built from ``old``."""
    if isinstance(new, (ColumnParallelLoRA, RowParallelLoRA)):
        column = isinstance(new, ColumnParallelLoRA)
        return [*_sources(new.base, old.base),
                (new.lora_A, old.lora_A, None if column else new.a_spec),
                (new.lora_B, old.lora_B, new.spec if column else None)]
    out = [(new.weight, old.weight, new.spec)]
    if getattr(new, "bias", None) is not None:
        out.append((new.bias, old.bias, getattr(new, "bias_spec", None)))
    return out


def _slicer(spec: ShardSpec | None, group: Group):
    """full -> this tp rank's piece of it (None: the whole tensor)."""
    if spec is None:
        return None
    start, end = shard_range(spec.full, group.rank, group.size)   # as _rows, as ranges: a
    return Piece(spec.dim, tuple((j * spec.full + start, j * spec.full + end)   # checkpoint
                                 for j in range(spec.parts)))     # source reads only these


def _specs(model: nn.Module) -> dict[str, ShardSpec]:
    specs = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            specs[f"{mod_name}.weight"] = mod.spec
            if getattr(mod, "bias", None) is not None:
                specs[f"{mod_name}.bias"] = mod.bias_spec
        elif isinstance(mod, RowParallelLinear):
            specs[f"{mod_name}.weight"] = mod.spec
        elif isinstance(mod, ColumnParallelLoRA):      # B split like the base's rows
            specs[f"{mod_name}.lora_B"] = mod.spec
        elif isinstance(mod, RowParallelLoRA):         # A split like the base's columns
            specs[f"{mod_name}.lora_A"] = mod.a_spec
    return specs


def _column(mod: nn.Module, comm: Comm, group: Group, parts: int = 1, name: str = "tp_bwd",
            transposed: bool = False):
    """The column-parallel version of a Linear (or Conv1D), or of a LoRA layer
    (parallel/tensor_lora.py)."""
    if isinstance(mod, LoRALinear):
        return ColumnParallelLoRA(mod, comm, group, ColumnParallelLinear, shard_tensor,
                                  parts=parts, name=name)
    return ColumnParallelLinear(mod, comm, group, parts=parts, name=name, transposed=transposed)


def _row(mod: nn.Module, comm: Comm, group: Group, transposed: bool = False):
    if isinstance(mod, LoRALinear):
        return RowParallelLoRA(mod, comm, group, RowParallelLinear, shard_tensor, ShardSpec)
    return RowParallelLinear(mod, comm, group, transposed=transposed)


@torch.no_grad()
def split_from_rank0(model: nn.Module, mesh, comm: Comm, device, loss_fn, mat=None):
    """Steps 2 of compose.py, shared with the pipeline: split the model over tp. Returns
    (model, {name: ShardSpec}, the loss to use).

    A model on the meta device (``mat``, its Materializer) stays there: its slices are made
    later, a unit at a time, from the seed (the same on every rank, so nothing is broadcast).
    A model in memory is moved to ``device`` whole and takes global rank 0's parameters and
    buffers first (meter ``init_broadcast``: slices are cut from the full weights, so ranks
    that initialised differently would otherwise train different models)."""
    if mat is None:
        model = model.to(device)                  # NCCL broadcasts device tensors only
        broadcast_coalesced(comm, [*model.parameters(), *model.buffers()], 0, mesh.world,
                            name="init_broadcast")
    specs = apply_tensor_parallel(model, mesh, comm, mat)
    plan = plan_of(model)
    if mesh.tp > 1 and any(s.style == "vocab_head" for s in plan.tp.values()):
        loss_fn = tp_loss(plan.sizes(model)["vocab_size"], comm, mesh.tp_group, loss_fn)
    return model, specs, loss_fn


def gather_tp(t: torch.Tensor, spec: ShardSpec, comm: Comm, group: Group) -> torch.Tensor:
    """The full tensor from every tp rank's piece (all ranks get it; metered 'gather_state')."""
    return all_gather_uneven(t.detach(), spec.dim, spec.full, comm, group, "gather_state",
                             parts=spec.parts)


@dataclass
class TensorPlan:
    """What a data-parallel stage must know of the tensor-parallel split it runs on.

    ``specs``: the split parameters by name (the rest are replicated over tp, with identical
    gradients on every tp rank). Clipping counts a split parameter on every tp rank and a
    replicated one on tp rank 0 only, then sums over tp (meter ``grad_norm_tp``); the full state
    dict gathers each split parameter from the tp group. ``stages``: the pipeline group, whose
    stages' squares are summed as well."""
    specs: dict
    comm: Comm
    group: Group
    stages: Group | None = None   # pipeline: each stage holds its own layers, summed over pp too
    uncounted: frozenset = frozenset()   # pipeline: the last stage's copies of tied weights

    def counts(self, name: str) -> bool:
        return name not in self.uncounted and (name in self.specs or self.group.rank == 0)

    def sum_sq(self, sq: torch.Tensor) -> torch.Tensor:
        t = sq.reshape(1).clone()
        self.comm.all_reduce(t, self.group, name="grad_norm_tp")
        if self.stages is not None:
            self.comm.all_reduce(t, self.stages, name="grad_norm_pp")
        return t[0]

    def piece(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This tp rank's piece of the whole tensor ``name`` (itself when not split)."""
        if name not in self.specs:
            return whole
        return shard_tensor(whole, self.specs[name], self.group.rank, self.group.size)

    def gather(self, state: dict, device: torch.device) -> dict:
        """Each split tensor of a by-name CPU state whole (gathered on ``device``)."""
        return {n: (gather_tp(t.to(device), self.specs[n], self.comm, self.group).cpu()
                    if n in self.specs else t) for n, t in state.items()}
