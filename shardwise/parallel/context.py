"""Context parallelism (``--cp N``, ``--cp-impl ring|ulysses``): every sequence of the batch is
cut over the N ranks of the cp axis, so each holds the activations of S/N positions.

Partition. The mesh is (pp, dp, cp, tp), cp between dp and tp (mesh.Mesh.build). The cp ranks of
one dp rank train on the same rows of the global batch (``data_shard`` is dp's); each keeps
positions ``comm/context.positions(S, N, cp_rank)``: chunks r and 2N-1-r of 2N (causal load
balancing). The model's parameters are whole on every cp rank (or sharded by the data-parallel
stage over dp x cp: ``mesh.grad_group``, torchtitan's dp_shard_cp).

What changes in the model (shardwise's GPT; refused in one line for a model without its hooks):
  input        a forward pre-hook on the model keeps this rank's positions of ``idx`` (B, S)
  positions    the position embedding reads this rank's global positions, not 0..L-1
  attention    every attention module's ``attend`` becomes ring attention or Ulysses
               (comm/context.py): the only place where positions meet, so the only collective
  the rest     embeddings, norms, MLPs, the head and the loss run on the local L = S/N
               positions unchanged
  loss         the targets are cut to the same positions (:func:`context_loss`); each rank's
               loss is the mean over its positions, and every rank holds as many, so the mean of
               the ranks' losses (the metrics average and the gradient average over dp x cp) is
               the whole batch's

A user's loop: ``engine(x)`` returns the whole (B, S, V) logits, gathered over cp in order
(comm/context.gather_sequence; its backward scales this rank's part by N, because every cp rank
then computes the same whole loss and the gradients are averaged over cp as well);
``engine.loss_fn`` is the user's loss on them.

Collectives per step (N = cp, per layer, B x L x h_local x d elements per rank's q, k or v):
  ring     cp_ring: forward N-1 sends of the keys and values (2 B h L d); backward the same and
           N sends of their gradients (fp32); each send overlapped with a block's attention
  ulysses  cp_a2a: forward one all-to-all of q, k, v (3 B h L d, (N-1)/N of it leaves the rank)
           and one of the output (B h L d); backward the same two
  both     the gradient sync over dp x cp (the data-parallel stage's own traffic, on a group N
           times dp's), and the metrics average over it

Memory per rank: activations / N (every saved tensor has L = S/N positions; attention's block
scores are (L x L) at most per ring step, (S x S) / N per head group under Ulysses); model
states as the data-parallel stage keeps them over dp x cp.

Not with (refused before launch, parallel/context_checks.py): pipelines, sequence parallelism,
HSDP, dropout, models other than shardwise's GPT (Hugging Face models: not yet).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm, Group
from shardwise.comm.context import gather_sequence, positions, ring_attention, ulysses_attention
from shardwise.models.build import logits_of

IMPLS = {"ring": ring_attention, "ulysses": ulysses_attention}


def apply_context_parallel(model: nn.Module, mesh, comm: Comm, impl: str) -> None:
    """Make ``model`` context parallel over ``mesh.cp_group`` in place (module docstring).
    Parameters are unchanged. cp = 1: nothing."""
    group = mesh.cp_group
    if group.size == 1:
        return
    attention = [m for m in model.modules() if hasattr(m, "attend")]
    pos_emb = getattr(model, "pos_emb", None)
    if not attention or not isinstance(pos_emb, nn.Embedding):
        raise TypeError(f"context parallelism runs shardwise's GPT (its attention's `attend` "
                        f"and its learned positions); {type(model).__name__} has neither; fix: "
                        "--model gpt, or drop --cp")
    for mod in attention:
        mod.attend = functools.partial(IMPLS[impl], comm=comm, group=group)
    n, r = group.size, group.rank
    pos_emb.register_forward_pre_hook(
        lambda mod, args: (positions(args[0].numel() * n, n, r, args[0].device)[args[0]],))

    def cut(module, args, kwargs):
        idx = args[0] if args else kwargs.get("idx")
        if not torch.is_tensor(idx) or idx.dim() != 2:
            raise TypeError("context parallelism cuts a (batch, sequence) tensor of token ids; "
                            f"got {type(idx).__name__}; fix: pass the ids as the first input")
        mine = idx[:, positions(idx.shape[1], n, r, idx.device)]
        return ((mine, *args[1:]), kwargs) if args else (args, {**kwargs, "idx": mine})
    model.register_forward_pre_hook(cut, with_kwargs=True)


def context_loss(loss_fn, comm: Comm, group: Group):
    """``loss_fn`` on this rank's positions: the targets (B, S) cut like the input. Carries
    ``whole_output`` (the output with its logits gathered over cp, after any gather of the
    inner loss: tp's vocabulary) and ``on_whole`` for the Engine's ``engine(x)`` view."""
    if group.size == 1:
        return loss_fn
    n, r = group.size, group.rank

    def loss(out, y):
        if torch.is_tensor(y) and y.dim() >= 2:
            y = y[:, positions(y.shape[1], n, r, y.device)]
        return loss_fn(out, y)
    inner = getattr(loss_fn, "whole_output", None)

    def whole(out):
        out = inner(out) if inner is not None else out
        logits = gather_sequence(logits_of(out), comm, group)
        if torch.is_tensor(out):
            return logits
        if isinstance(out, (tuple, list)):
            return type(out)((logits, *out[1:]))
        out["logits"] = logits
        return out
    loss.whole_output = whole
    loss.on_whole = getattr(loss_fn, "on_whole", loss_fn)
    loss.cross_entropy = getattr(loss_fn, "cross_entropy", False)
    return loss
