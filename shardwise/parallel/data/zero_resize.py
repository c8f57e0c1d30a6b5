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

Partition: :func:`gather_grads` gives the leader (rank 0 of the gradient group, and of its
shard group) each chunk's whole reduced gradient (its unpadded prefix, the group's mean), which
the other ranks of its shard group send it; nobody else holds more than its shards.
:func:`scatter_grads` sends every rank its slice of the summed flats, into its ``grad_shard``
(the padding untouched, 0; under HSDP replica 0's shards are broadcast to the other replicas),
and every rank keeps the squares of the whole gradient for clipping, which the leader computes
and broadcasts (of this rank's piece; a tp-replicated entry counted on tp rank 0 only, as the
shard path counts it, then summed over tp and pp as ever), so every rank of every group clips
by the same norm to the bit. :func:`layout_free_state` is this rank's piece of the model by name (fp32, from
the masters: under tensor parallelism its tp slice, under a pipeline its stage, whole over the
shard group only), its optimizer state by name (zero_state.canonical_optimizer_state) and the
buffers, which the same piece of a group of another size loads (the same tp and pp);
:func:`load_layout_free_state` sets this rank's masters, working shards and optimizer state
from it and gathers the whole parameters again (stages 1-2).

Collectives: per step, over the leader's shard group, a send of each chunk's gradient shard to
the leader (meter ``ft_grad_gather``) and one back (``ft_grad_scatter``; under HSDP then a
broadcast of each shard over the replica group), and a broadcast of the squares (4 bytes) over
the gradient group (``ft_grad_norm``); once per join, on the source group, the all-gathers of
zero_state's full forms (``zero_state_ag``); on the joining group the parameter all-gathers of
the load (stages 1-2, ``zero_param_ag``). Memory: on the leader only, the whole gradient of its
piece (in the working dtype) beside its shards for the step's sum (plus the lane's fp32 flat,
parallel/replicas_sum.py); every other rank its shards, as without groups. The layout-free
state (12P bytes with Adam, on the CPU) on every rank of the source and joining groups while a
join is served. Traffic: each rank sends (and receives back) its 1/g of the gradient per step;
the leader receives and sends (g-1)/g of it, on top of the groups' own reduce-scatter.
"""
from __future__ import annotations

import torch

from shardwise.parallel.base import grad_sq
from shardwise.parallel.data import zero_state


def _fans(zero) -> bool:
    """Whether this rank's shard group is the leader's (the gradient group's rank 0): every
    shard group but, under HSDP, those of the other replicas, which hold the same shards."""
    return zero.mesh.coord("dp_replicate") == 0


@torch.no_grad()
def gather_grads(zero) -> list[torch.Tensor] | None:
    """On the leader (rank 0 of the shard group, and of the gradient group), each chunk's
    whole reduced gradient, unpadded ((numel,) in the working dtype): the other ranks of its
    shard group send it their shards (meter ``ft_grad_gather``); None on every other rank,
    which holds no more than its shards."""
    if not _fans(zero):
        return None
    g, out = zero.group, []
    for c in zero.chunks:
        n = c.layout.shard_numel
        if g.rank != 0:
            zero.comm.send(c.grad_shard.to(zero.device).contiguous(), 0, g,
                           name="ft_grad_gather")
        else:
            full = torch.empty(c.layout.padded, dtype=c.grad_shard.dtype, device=zero.device)
            full[:n].copy_(c.grad_shard)
            for r in range(1, g.size):
                zero.comm.recv(full[r * n:(r + 1) * n], r, g, name="ft_grad_gather")
            out.append(full[:c.layout.numel])
        if zero.grads_offloaded:            # disk: the shard's pages read, dropped again
            zero.store.release([c.grad_shard], written=False)
    return out if g.rank == 0 else None


@torch.no_grad()
def scatter_grads(zero, wholes: list[torch.Tensor] | None) -> torch.Tensor:
    """Each rank's slice of the summed whole gradients (``wholes``, on the leader only) into
    its ``grad_shard``: the leader sends each rank of its shard group its slice (meter
    ``ft_grad_scatter``; the padding stays as reduced, zeros), and under HSDP the shards go on
    over the replica group. Returns the squares of the whole gradient of this rank's piece,
    computed by the leader and broadcast over the gradient group (fp32 scalar, the same bits
    on every rank of this piece in every group: each leader sums the same whole in the same
    order; under tensor parallelism only the entries tp rank 0 counts of a replicated
    parameter, as ``_local_grad_sq`` counts them)."""
    g = zero.group
    if _fans(zero):
        for i, c in enumerate(zero.chunks):
            numel = c.layout.numel
            if g.rank == 0:
                for r in range(g.size):
                    lo, hi = c.layout.shard_range(r)
                    hi = min(hi, numel)
                    if lo >= hi:
                        continue
                    if r == 0:
                        c.grad_shard[:hi - lo].copy_(wholes[i][lo:hi])
                    else:
                        zero.comm.send(wholes[i][lo:hi].contiguous(), r, g,
                                       name="ft_grad_scatter")
            else:
                lo, hi = c.layout.shard_range(g.rank)
                hi = min(hi, numel)
                if lo < hi:
                    piece = torch.empty(hi - lo, dtype=c.grad_shard.dtype, device=zero.device)
                    zero.comm.recv(piece, 0, g, name="ft_grad_scatter")
                    c.grad_shard[:hi - lo].copy_(piece)
            if zero.grads_offloaded:        # disk: written back, its pages dropped
                zero.store.release([c.grad_shard])
    replicas = zero.mesh.group("dp_replicate")
    if replicas.size > 1:                   # HSDP: replica 0's shards to the other replicas
        for c in zero.chunks:
            shard = c.grad_shard.to(zero.device)
            zero.comm.broadcast(shard, 0, replicas, name="ft_grad_scatter")
            if shard.data_ptr() != c.grad_shard.data_ptr():
                c.grad_shard.copy_(shard)
            if zero.grads_offloaded:
                zero.store.release([c.grad_shard])
    sq = torch.zeros(1, dtype=torch.float32, device=zero.device)
    if wholes is not None:
        sq[0] = _whole_sq(zero, wholes)
    zero.comm.broadcast(sq, 0, zero.mesh.grad_group, name="ft_grad_norm")
    return sq[0]


def _whole_sq(zero, wholes: list[torch.Tensor]) -> torch.Tensor:
    if zero.plan is None:
        return grad_sq(wholes, zero.device)
    names = {p: n for n, p in zero.model.named_parameters()}
    return grad_sq([whole[offset:offset + p.numel()] for c, whole in zip(zero.chunks, wholes)
                    for p, offset in zip(c.params, c.layout.offsets)
                    if zero.plan.counts(names[p])], zero.device)


def layout_free_state(zero, keep: bool = True) -> dict:
    """This rank's piece of the training state by name (its tp slice and stage), whole over
    the shard group, for a group of any dp size (a collective over the shard group: every
    rank calls it; the result is whole on each that ``keep``s it: the leader, who sends it;
    the others take part in the gathers and hold one chunk at a time)."""
    return {"model": zero_state.full_state_dict(zero, pieces=True, keep=keep),
            "optimizer": zero_state.canonical_optimizer_state(zero, pieces=True, keep=keep),
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
