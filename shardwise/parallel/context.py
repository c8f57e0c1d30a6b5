"""Context parallelism (``--cp N``, ``--cp-impl ring|ulysses``): every sequence of the batch is
cut over the N ranks of the cp axis, so each holds the activations of S/N positions.

Partition. The mesh is (pp, dp, cp, tp), cp between dp and tp (mesh.Mesh.build). The cp ranks of
one dp rank train on the same rows of the global batch (``data_shard`` is dp's); each keeps
positions ``comm/context.positions(S, N, cp_rank)``: chunks r and 2N-1-r of 2N (causal load
balancing). The model's parameters are whole on every cp rank (or sharded by the data-parallel
stage over dp x cp: ``mesh.grad_group``, torchtitan's dp_shard_cp).

What changes in the model, read from its plan's ``attention`` and ``positions``
(models/plans.py: shardwise's GPT, Hugging Face GPT-2 and Llama, or a person's registered plan):
  input        a forward pre-hook on the model keeps this rank's positions of the token ids and
               of every other per-position input; a padding mask stays whole (every rank's
               attention reads every key's; transformers hands it over as (B, 1, 1, S) through
               the routed mask entry); ``labels`` are refused
  positions    learned positions (``module:pos_emb``) read this rank's global positions, not
               0..L-1; a forward argument (``argument:position_ids``: GPT-2's learned table,
               Llama's rotary) is given them
  attention    every attention module's attention becomes ring attention or Ulysses
               (comm/context.py): its ``attend`` method (our GPT), or transformers' attention
               interface routed to it (models/hf.route_attention; grouped-query attention's
               key-value heads kept). The only place where positions meet, so the only collective
  the rest     embeddings, norms, MLPs, the head and the loss run on the local L = S/N
               positions unchanged
  loss         the targets are cut to the same positions (:func:`context_loss`); each rank's
               loss is the mean over its positions, and every rank holds as many, so the mean of
               the ranks' losses (the metrics average and the gradient average over dp x cp) is
               the whole batch's; with padded targets (-100, which the loss skips) each rank's
               mean is weighted by its share of the valid targets, so the mean over cp is still
               the mean over every valid target of the batch

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

Pipelines: stages never call the model's forward, so the driver cuts each step's batch with
:func:`batch_cutter` (compose sets it); the boundary activations are then (b, L, h).

Not with (refused before launch, parallel/context_checks.py): sequence parallelism, HSDP,
dropout, LeNet; a model whose plan names no attention is refused here, in one line.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm, Group
from shardwise.comm.context import gather_sequence, positions, ring_attention, ulysses_attention
from shardwise.models import hf
from shardwise.models.build import logits_of
from shardwise.models.plans import plan_of

IMPLS = {"ring": ring_attention, "ulysses": ulysses_attention}
IGNORE = -100     # the target index a loss skips (torch's cross_entropy and transformers' default)


def apply_context_parallel(model: nn.Module, mesh, comm: Comm, impl: str):
    """Make ``model`` context parallel over ``mesh.cp_group`` in place (module docstring), by
    its plan's ``attention`` and ``positions`` (models/plans.py). Parameters are unchanged.
    Returns the batch cut a pipeline applies (:func:`batch_cutter`); cp = 1: nothing, None."""
    group = mesh.cp_group
    if group.size == 1:
        return None
    plan = plan_of(model)
    if plan is None or not plan.attention or not plan.positions:
        raise TypeError(f"context parallelism needs a model plan naming the attention modules "
                        f"and where positions enter; {type(model).__name__} has none; fix: "
                        "shardwise.register_plan(cls, ModelPlan(..., attention=..., "
                        "positions=...)), or drop --cp")
    attend = functools.partial(IMPLS[impl], comm=comm, group=group)
    _swap_attention(model, plan, attend)
    n, r = group.size, group.rank
    where, name = plan.positions.split(":", 1)
    if where == "module":                                # looked up by 0..L-1: global instead
        model.get_submodule(name).register_forward_pre_hook(
            lambda mod, args: (positions(args[0].numel() * n, n, r, args[0].device)[args[0]],))
    argument = name if where == "argument" else None
    model.register_forward_pre_hook(_cutter(plan, n, r, argument), with_kwargs=True)
    return batch_cutter(plan, n, r, argument)


def _swap_attention(model: nn.Module, plan, attend) -> None:
    found = [m for path, m in model.named_modules() if plan.matches(path, (plan.attention,))]
    if not found:
        raise TypeError(f"the model plan of {type(model).__name__} names attention modules "
                        f"{plan.attention!r}, and it has none; fix: the plan's attention pattern")
    if all(hasattr(m, "attend") for m in found):
        for m in found:
            m.attend = attend
    elif all(hasattr(getattr(m, "config", None), "_attn_implementation") for m in found):
        hf.route_attention(model, found, attend)
    else:
        raise TypeError(f"context parallelism replaces attention through an `attend(q, k, v, "
                        f"scale=)` method or transformers' attention interface; "
                        f"{type(found[0]).__name__} has neither; fix: give it an `attend` "
                        "method, or drop --cp")


def _cut(plan, n: int, r: int, position_argument: str | None, ids, kwargs: dict, rows: int):
    """This rank's positions of the token ids (B, S) and of every other per-position input but
    the padding mask, which stays whole (every key's mask is read by every rank's attention;
    all ones: dropped); labels are refused (the model's own loss would shift inside each rank's
    chunks); the global positions as ``position_argument`` ((rows, L): a pipeline chunks every
    input by rows)."""
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise TypeError("context parallelism cuts a (batch, sequence) tensor of token ids; "
                        f"got {type(ids).__name__}; fix: pass the ids as the first input")
    seq = ids.shape[1]
    mine = positions(seq, n, r, ids.device)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and (mask.dim() != 2 or mask.shape[1] != seq):
        raise ValueError(f"an attention_mask of shape {tuple(mask.shape)} under context "
                         f"parallelism: it takes the 2-D (batch, {seq}) padding mask; fix: "
                         "pass that one")
    if kwargs.get("labels") is not None:
        raise ValueError("labels under context parallelism: the model's own loss would "
                         "shift the targets inside each rank's chunks; fix: drop labels "
                         "and let shardwise's loss (or yours on engine(x)) read the targets")
    for key, value in kwargs.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq:
            kwargs[key] = value[:, mine]
    if position_argument is not None and kwargs.get(position_argument) is None:
        kwargs[position_argument] = mine[None].expand(rows, -1)
    if mask is not None and not bool(mask.all()):
        kwargs["attention_mask"] = mask
    return ids[:, mine], kwargs


def _cutter(plan, n: int, r: int, position_argument: str | None):
    """The model's forward pre-hook: :func:`_cut` on its ids and keyword inputs."""
    def cut(module, args, kwargs):
        kwargs = dict(kwargs)
        if args:
            kwargs[plan.ids], args = args[0], args[1:]
        ids = kwargs.pop(plan.ids, None)
        rows = ids.shape[0] if torch.is_tensor(ids) else 1
        ids, kwargs = _cut(plan, n, r, position_argument, ids, kwargs, rows)
        kwargs[plan.ids] = ids
        return args, kwargs
    return cut


def batch_cutter(plan, n: int, r: int, position_argument: str | None):
    """For a pipeline, whose stages never call the model's forward: the step's batch (token
    ids, or a dict of the model's inputs) cut to this rank's positions before it is split into
    micro-batches (a tensor of ids becomes a dict when positions enter as an argument)."""
    def cut(batch):
        if torch.is_tensor(batch):
            ids, rest = _cut(plan, n, r, position_argument, batch, {}, batch.shape[0])
            return ids if not rest else {plan.ids: ids, **rest}
        if not isinstance(batch, dict) or plan.ids not in batch:
            raise ValueError(f"context parallelism under a pipeline cuts a batch of token ids "
                             f"or a dict holding {plan.ids!r}; fix: pass one of those")
        rest = {k: v for k, v in batch.items() if k != plan.ids}
        ids, rest = _cut(plan, n, r, position_argument, batch[plan.ids], rest,
                         batch[plan.ids].shape[0])
        return {plan.ids: ids, **rest}
    return cut


def context_loss(loss_fn, comm: Comm, group: Group):
    """``loss_fn`` on this rank's positions: the targets (B, S) cut like the input. Carries
    ``whole_output`` (the output with its logits gathered over cp, after any gather of the
    inner loss: tp's vocabulary) and ``on_whole`` for the Engine's ``engine(x)`` view."""
    if group.size == 1:
        return loss_fn
    n, r = group.size, group.rank

    def loss(out, y):
        if not torch.is_tensor(y) or y.dim() < 2:
            return loss_fn(out, y)
        whole = y
        y = y[:, positions(y.shape[1], n, r, y.device)]
        if bool((whole != IGNORE).all()):
            return loss_fn(out, y)
        # padded targets: this rank's mean over its valid targets, weighted so that the mean
        # over the cp ranks is the whole batch's mean over all of them (every rank has the whole
        # targets: no collective)
        mine, total = int((y != IGNORE).sum()), int((whole != IGNORE).sum())
        if mine == 0:
            return logits_of(out).sum() * 0.0
        return loss_fn(out, y) * (mine * n / total)
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
