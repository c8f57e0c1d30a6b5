"""ZeRO across replica groups of different sizes (``--ft-rejoin-nproc N``, parallel/replicas.py):
the reduced gradient shards made whole for the leaders' weighted sum, and the layout-free state
a joining group of another size loads its own shards from. Functions of the strategy (stages
1-3, with tensor parallelism, a pipeline or context parallelism: the restarted group keeps
those and changes its dp size only; HSDP: the shard group's layout, which a group of another
dp size has alike when --dp-shard fixes it; offloaded shards are read and written through the
store, disk pages dropped again after each).

Why it works: a chunk's flat layout (comm/flat.FlatLayout.of) puts each parameter at the same
offset whatever the group size g; g only changes the end padding (numel rounded up to a
multiple of g) and where the shard bounds fall. The chunks themselves do not depend on g either
(stages 1-2: buckets planned by bytes; stage 3: units by module). So the unpadded prefix of a
chunk's flat is the same vector in a group of 1, 2 or 3 ranks, and a group of another size can
sum, or load, it and cut its own shards from it.

Partition: :func:`gather_grads` gives every rank of the group each chunk's whole reduced
gradient (its unpadded prefix, the group's mean), :func:`scatter_grads` copies this rank's
slice of the summed flats back into its ``grad_shard`` (the padding untouched, 0) and keeps the
squares of the whole gradient for clipping (of this rank's piece; a tp-replicated entry counted
on tp rank 0 only, as the shard path counts it, then summed over tp and pp as ever), so every
rank of every group clips by the same norm to the bit. :func:`layout_free_state` is this rank's piece of the model by name (fp32, from
the masters: under tensor parallelism its tp slice, under a pipeline its stage, whole over the
shard group only), its optimizer state by name (zero_state.canonical_optimizer_state) and the
buffers, which the same piece of a group of another size loads (the same tp and pp);
:func:`load_layout_free_state` sets this rank's masters, working shards and optimizer state
from it and gathers the whole parameters again (stages 1-2).

Collectives (over the group's shard group): per step one all-gather of each chunk's gradient
shard (meter ``ft_grad_ag``); once per join, on the source group, the all-gathers of
zero_state's full forms (``zero_state_ag``); on the joining group the parameter all-gathers of
the load (stages 1-2, ``zero_param_ag``). Memory: the whole gradient (the model's, in the
working dtype) beside the shards on every rank for the step's sum (plus the lane's fp32 flat,
parallel/replicas_sum.py); the layout-free state (12P bytes with Adam, on the CPU) on every rank
of the source and joining groups while a join is served. Traffic: (g-1)/g x the gradient's
bytes per rank and step, on top of the groups' own reduce-scatter.
"""
from __future__ import annotations

import torch

from shardwise.parallel.base import grad_sq
from shardwise.parallel.data import zero_state


@torch.no_grad()
def gather_grads(zero) -> list[torch.Tensor]:
    """Each chunk's whole reduced gradient, unpadded ((numel,) in the working dtype, the same
    on every rank of the group): one all-gather of its gradient shards."""
    out = []
    for c in zero.chunks:
        full = torch.empty(c.layout.padded, dtype=c.grad_shard.dtype, device=zero.device)
        zero._all_gather(full, c.grad_shard.to(zero.device), async_op=False,
                         name="ft_grad_ag")
        if zero.grads_offloaded:            # disk: the shard's pages read, dropped again
            zero.store.release([c.grad_shard], written=False)
        out.append(full[:c.layout.numel])
    return out


@torch.no_grad()
def scatter_grads(zero, wholes: list[torch.Tensor]) -> torch.Tensor:
    """This rank's slice of each summed whole gradient into its ``grad_shard``; returns the
    squares of the whole gradient of this rank's piece (fp32 scalar, the same on every rank of
    this piece in every group; under tensor parallelism only the entries tp rank 0 counts of a
    replicated parameter, as ``_local_grad_sq`` counts them)."""
    rank = zero.group.rank
    for c, whole in zip(zero.chunks, wholes):
        lo, hi = c.layout.shard_range(rank)
        hi = min(hi, c.layout.numel)            # the padding stays as reduced (zeros)
        if lo < hi:
            c.grad_shard[:hi - lo].copy_(whole[lo:hi])
        if zero.grads_offloaded:            # disk: written back, its pages dropped
            zero.store.release([c.grad_shard])
    if zero.plan is None:
        return grad_sq(wholes, zero.device)
    names = {p: n for n, p in zero.model.named_parameters()}
    return grad_sq([whole[offset:offset + p.numel()] for c, whole in zip(zero.chunks, wholes)
                    for p, offset in zip(c.params, c.layout.offsets)
                    if zero.plan.counts(names[p])], zero.device)


def layout_free_state(zero) -> dict:
    """This rank's piece of the training state by name (its tp slice and stage), whole over
    the shard group, for a group of any dp size (a collective over the shard group: every
    rank calls it; the result is whole on each)."""
    return {"model": zero_state.full_state_dict(zero, pieces=True),
            "optimizer": zero_state.canonical_optimizer_state(zero, pieces=True),
            "buffers": {n: b.detach().cpu().clone() for n, b in zero.model.named_buffers()}}


@torch.no_grad()
def load_layout_free_state(zero, state: dict) -> None:
    """Every rank takes its own shards of :func:`layout_free_state`: its masters (the working
    shards cast from them, as after a step), its optimizer state, the frozen parameters and
    the buffers; then the whole parameters are gathered again (stages 1-2)."""
    model = state["model"]
    names = {p: n for n, p in zero.model.named_parameters()}
    rank = zero.group.rank
    for c in zero.chunks:
        flat = c.layout.new_flat([model[names[p]] for p in c.params], torch.float32,
                                 c.master.device)
        c.master.copy_(c.layout.shard(flat, rank))
        if c.master.data_ptr() != c.shard.data_ptr():
            c.shard.copy_(c.master)
        zero.store.release([c.master, c.shard])     # disk offload: written back, dropped
    zero_state.load_canonical_optimizer_state(zero, state["optimizer"], pieces=True)
    for i in range(len(zero.chunks)):
        zero._launch_gather(i)                  # stage 3: nothing (the next forward gathers)
    zero._finish_gathers()
    params = dict(zero.model.named_parameters())
    for n, p in params.items():
        if not p.requires_grad:
            p.copy_(model[n])
    buffers = dict(zero.model.named_buffers())
    for n, b in state["buffers"].items():
        buffers[n].copy_(b)
