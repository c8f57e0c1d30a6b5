"""Tensor parallelism (Megatron-LM): each transformer layer's weights split across the tp group.

Partition (tp ranks r = 0..T-1, GPT of width h, H heads, vocabulary V):
  - attention: ``qkv`` is column-parallel by heads (rank r keeps the q, k and v rows of heads
    [rH/T, (r+1)H/T)), so attention runs on H/T local heads with no communication; ``proj`` is
    row-parallel (input columns of those heads), its bias replicated and added after the sum.
  - MLP: ``fc`` column-parallel (4h/T output rows), ``proj`` row-parallel (4h/T input columns).
  - vocabulary: ``tok_emb`` rows and ``head`` rows split by vocabulary (uneven splits allowed);
    the loss is the vocab-parallel cross-entropy, so no rank holds the (b, s, V) logits.
  - layer norms and the position embedding are replicated; their gradients come out identical
    on every tp rank (their inputs' gradients are already summed by f), so they need no traffic.

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

from shardwise.comm.autograd import (copy_to_tp, reduce_from_tp, shard_range, split_sizes,
                                     vocab_parallel_cross_entropy, vocab_parallel_embedding)
from shardwise.comm.collectives import Comm, Group
from shardwise.memory.lora import LoRALinear
from shardwise.parallel.tensor_lora import ColumnParallelLoRA, RowParallelLoRA


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over tp: along ``dim``, in ``parts`` interleaved groups (qkv: 3)
    of size ``full`` each, rank r holding piece r of ``split_sizes(full, T)`` of every group."""
    dim: int
    full: int
    parts: int = 1


def _rows(spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Indices along spec.dim that tp rank ``rank`` keeps."""
    start, end = shard_range(spec.full, rank, size)
    return torch.cat([torch.arange(j * spec.full + start, j * spec.full + end)
                      for j in range(spec.parts)])


def shard_tensor(t: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor (a copy)."""
    return t.detach().index_select(spec.dim, _rows(spec, rank, size)).clone()


def _like(t: torch.Tensor, original: nn.Parameter) -> nn.Parameter:
    """A slice as a Parameter that keeps the original's requires_grad (frozen stays frozen)."""
    return nn.Parameter(t, requires_grad=original.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y_local = f(x) @ W_r^T + b_r: output features split; input replicated (f: allreduce
    backward). Built from the full nn.Linear, so it equals it for the same seed."""

    def __init__(self, linear: nn.Linear, comm: Comm, group: Group, parts: int = 1,
                 name: str = "tp_bwd"):
        super().__init__()
        self.comm, self.group, self.name = comm, group, name
        self.spec = ShardSpec(0, linear.out_features // parts, parts)
        self.weight = _like(shard_tensor(linear.weight, self.spec, group.rank, group.size),
                            linear.weight)
        self.bias = None if linear.bias is None else _like(
            shard_tensor(linear.bias, self.spec, group.rank, group.size), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.comm, self.group, self.name)          # (B, T, in) replicated
        return F.linear(x, self.weight, self.bias)                   # (B, T, out_local)


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W_r^T) + b: input features split, partial outputs summed (g: allreduce
    forward); the bias is replicated and added once, after the sum."""

    def __init__(self, linear: nn.Linear, comm: Comm, group: Group, name: str = "tp_fwd"):
        super().__init__()
        self.comm, self.group, self.name = comm, group, name
        self.spec = ShardSpec(1, linear.in_features)
        self.weight = _like(shard_tensor(linear.weight, self.spec, group.rank, group.size),
                            linear.weight)
        self.bias = None if linear.bias is None else _like(linear.bias.detach().clone(),
                                                           linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.comm, self.group, self.name)  # (B, T, out)
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


def apply_tensor_parallel(model: nn.Module, mesh, comm: Comm) -> dict[str, ShardSpec]:
    """Swap shardwise's GPT layers for their tp-parallel versions over ``mesh.tp_group``, in place.

    Parameter names are unchanged (``blocks.0.attn.qkv.weight`` ...); returns {name: ShardSpec}
    of every split parameter (the rest are replicated). tp = 1 leaves the model as it is.
    """
    group = mesh.tp_group
    if group.size == 1:
        return {}
    if not all(hasattr(model, a) for a in ("tok_emb", "blocks", "head")):
        raise TypeError(f"tensor parallelism knows shardwise's GPT; got {type(model).__name__}")
    if model.cfg.n_head % group.size:
        raise ValueError(f"tp = {group.size} does not divide n_head = {model.cfg.n_head}")
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = _column(attn.qkv, comm, group, parts=3)
        attn.proj = _row(attn.proj, comm, group)
        attn.n_head = model.cfg.n_head // group.size                 # local heads
        mlp.fc = _column(mlp.fc, comm, group)
        mlp.proj = _row(mlp.proj, comm, group)
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, comm, group)
    model.head = _column(model.head, comm, group, name="tp_vocab")
    specs = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            specs[f"{mod_name}.weight"] = mod.spec
            if getattr(mod, "bias", None) is not None:
                specs[f"{mod_name}.bias"] = mod.spec
        elif isinstance(mod, RowParallelLinear):
            specs[f"{mod_name}.weight"] = mod.spec
        elif isinstance(mod, ColumnParallelLoRA):      # B split like the base's rows
            specs[f"{mod_name}.lora_B"] = mod.spec
        elif isinstance(mod, RowParallelLoRA):         # A split like the base's columns
            specs[f"{mod_name}.lora_A"] = mod.a_spec
    return specs


def _column(mod: nn.Module, comm: Comm, group: Group, parts: int = 1, name: str = "tp_bwd"):
    """The column-parallel version of a Linear, or of a LoRA layer (parallel/tensor_lora.py)."""
    if isinstance(mod, LoRALinear):
        return ColumnParallelLoRA(mod, comm, group, ColumnParallelLinear, shard_tensor,
                                  parts=parts, name=name)
    return ColumnParallelLinear(mod, comm, group, parts=parts, name=name)


def _row(mod: nn.Module, comm: Comm, group: Group):
    if isinstance(mod, LoRALinear):
        return RowParallelLoRA(mod, comm, group, RowParallelLinear, shard_tensor, ShardSpec)
    return RowParallelLinear(mod, comm, group)


@torch.no_grad()
def split_from_rank0(model: nn.Module, mesh, comm: Comm, device, loss_fn):
    """Steps 2 of compose.py, shared with the pipeline: move the whole model to ``device``, take
    global rank 0's parameters and buffers (meter ``init_broadcast``: slices are cut from the
    full weights, so ranks that initialised differently would otherwise train different
    models), then split it over tp. Returns (model, {name: ShardSpec}, the loss to use)."""
    model = model.to(device)                      # NCCL broadcasts device tensors only
    for t in [*model.parameters(), *model.buffers()]:
        comm.broadcast(t.data, 0, mesh.world, name="init_broadcast")
    specs = apply_tensor_parallel(model, mesh, comm)
    if mesh.tp > 1:
        loss_fn = tp_loss(model.cfg.vocab_size, comm, mesh.tp_group)
    return model, specs, loss_fn


def tp_loss(vocab_size: int, comm: Comm, group: Group):
    """The loss of a tp GPT: vocab-parallel cross-entropy on this rank's logit columns."""
    start = shard_range(vocab_size, group.rank, group.size)[0]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, start, comm, group)
    return loss_fn


def gather_tp(t: torch.Tensor, spec: ShardSpec, comm: Comm, group: Group) -> torch.Tensor:
    """The full tensor from every tp rank's piece (all ranks get it; metered 'gather_state')."""
    sizes = split_sizes(spec.full, group.size)
    local = t.detach().movedim(spec.dim, 0).contiguous()              # (parts*size_r, ...)
    rest = local.shape[1:]
    width = spec.parts * max(sizes)
    padded = torch.zeros((width, *rest), dtype=t.dtype, device=t.device)
    padded[: local.shape[0]] = local
    out = torch.empty((group.size * width, *rest), dtype=t.dtype, device=t.device)
    comm.all_gather(out, padded, group, name="gather_state")
    pieces = []
    for j in range(spec.parts):          # group j (q, k or v) of every rank, in rank order
        for r, n in enumerate(sizes):
            pieces.append(out[r * width + j * n: r * width + (j + 1) * n])
    return torch.cat(pieces).movedim(0, spec.dim).contiguous()


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

    def counts(self, name: str) -> bool:
        return name in self.specs or self.group.rank == 0

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
