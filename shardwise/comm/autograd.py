"""Collectives inside autograd: Megatron-LM's conjugate f / g operators and the vocab-parallel pieces.

Tensor parallelism (Shoeybi et al., 2019, "Megatron-LM", section 3) splits a pair of linears so
that one allreduce per direction joins them. The two operators that carry those allreduces are:

    f  (copy_to_tp)       forward: identity            backward: allreduce over tp
    g  (reduce_from_tp)   forward: allreduce over tp   backward: identity

f sits where a replicated activation enters a column-parallel linear (each rank's gradient for
that activation is a partial sum); g sits where a row-parallel linear's partial outputs must be
summed. The vocab-parallel cross-entropy computes the loss from logits split on the vocabulary
dimension: two allreduces of b*s elements (the max, then [sum of exp, target logit] together),
so no rank ever holds the full (b, s, vocab) logits. A loss of a user's own needs them all:
gather_from_tp all-gathers them (b*s*vocab elements per rank) and hands each rank's columns of
the gradient back.

Every operator takes the Comm, the Group and a meter name, so the traffic of each use shows up in
the communication meter under its own name (tp_fwd / tp_bwd for the per-layer pairs).

Sequence parallelism (Korthikanti et al., 2022; parallel/sequence.py) replaces f and g where the
residual stream is cut along the sequence (dimension 1 of a (B, S, ...) activation):

    scatter_to_sequence        forward: this rank's slice (no traffic)   backward: all-gather
    gather_from_sequence       forward: all-gather                       backward: reduce-scatter
    reduce_scatter_to_sequence forward: reduce-scatter                   backward: all-gather
    sum_grad_over_tp           forward: identity (a parameter)           backward: all-reduce

metered ``sp_ag`` (all-gathers), ``sp_rs`` (reduce-scatters) and ``sp_grad``.
``gather_for_region`` / ``linear_on_gathered`` let the column-parallel layers that read a
gathered input save its slice only and gather it again in backward (Regather: once per region).
"""
from __future__ import annotations

import torch

from shardwise.comm.collectives import Comm, Group


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal contiguous pieces of ``n`` (the first n % parts get one more)."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def shard_range(n: int, rank: int, parts: int) -> tuple[int, int]:
    """[start, end) of piece ``rank`` of ``split_sizes(n, parts)``."""
    sizes = split_sizes(n, parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def all_gather_uneven(t: torch.Tensor, dim: int, full: int, comm: Comm, group: Group, name: str,
                      parts: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's piece of dimension ``dim``, split as ``split_sizes(full,
    group.size)`` (pieces may differ by one): each piece padded to the largest, one
    ``all_gather``, the padding cut off. ``parts`` > 1: each rank's piece is ``parts`` groups
    (a fused q | k | v), reassembled group by group (all ranks' q, then k, then v). No autograd."""
    sizes = split_sizes(full, group.size)
    local = t.movedim(dim, 0).contiguous()                       # (parts * size_r, ...)
    rest, width = local.shape[1:], parts * max(sizes)
    padded = torch.zeros((width, *rest), dtype=t.dtype, device=t.device)
    padded[: local.shape[0]] = local
    out = torch.empty((group.size * width, *rest), dtype=t.dtype, device=t.device)
    comm.all_gather(out, padded, group, name=name)
    pieces = [out[r * width + j * n: r * width + (j + 1) * n]
              for j in range(parts) for r, n in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, allreduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group, name: str):
        ctx.comm, ctx.group, ctx.name = comm, group, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()          # the incoming buffer may be shared
        ctx.comm.all_reduce(grad, ctx.group, name=ctx.name)
        return grad, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: allreduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group, name: str):
        out = x.contiguous().clone()
        comm.all_reduce(out, group, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def copy_to_tp(x: torch.Tensor, comm: Comm, group: Group, name: str = "tp_bwd") -> torch.Tensor:
    """Megatron's f. World size 1: plain identity (the Comm short-circuits)."""
    if group.size == 1:
        return x
    return _CopyToTP.apply(x, comm, group, name)


def reduce_from_tp(x: torch.Tensor, comm: Comm, group: Group, name: str = "tp_fwd") -> torch.Tensor:
    """Megatron's g. World size 1: plain identity."""
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, comm, group, name)


class _GatherFromTP(torch.autograd.Function):
    """Logits split on the last dimension -> the whole logits on every tp rank; backward: this
    rank's columns of the gradient (every rank computes the same loss from the same whole
    logits, so its own columns' gradient is already the full one: no sum)."""

    @staticmethod
    def forward(ctx, x, full: int, comm: Comm, group: Group, name: str):
        ctx.start, ctx.size = shard_range(full, group.rank, group.size)[0], x.shape[-1]
        return all_gather_uneven(x, -1, full, comm, group, name)       # (..., V)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.start: ctx.start + ctx.size].contiguous(), None, None, None, None


def gather_from_tp(x: torch.Tensor, full: int, comm: Comm, group: Group,
                   name: str = "tp_gather_logits") -> torch.Tensor:
    """The whole last dimension (``full`` wide, split as :func:`split_sizes`) of a tensor split on
    it over tp, inside autograd: for a loss that needs every logit (a user's own)."""
    if group.size == 1:
        return x
    return _GatherFromTP.apply(x, full, comm, group, name)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy from logits split on the vocabulary; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, target, start: int, comm: Comm, group: Group, name: str):
        # logits: (N, V_local) this rank's vocabulary columns [start, start + V_local)
        n, v_local = logits.shape
        row_max = logits.max(dim=-1).values                       # (N,)
        comm.all_reduce(row_max, group, op="max", name=name)
        shifted = logits - row_max[:, None]                       # (N, V_local)
        exp = shifted.exp()
        outside = (target < start) | (target >= start + v_local)  # (N,) target on another rank
        local_t = (target - start).clamp(0, v_local - 1)
        picked = shifted.gather(1, local_t[:, None]).squeeze(1).masked_fill(outside, 0.0)
        both = torch.stack([exp.sum(dim=-1), picked])             # (2, N): one allreduce for both
        comm.all_reduce(both, group, name=name)
        sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax.clone()                                       # d loss_i / d logit = p - onehot
        g.scatter_add_(1, local_t[:, None], -(~outside).to(g.dtype)[:, None])
        g.mul_(grad / softmax.shape[0])
        return g, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 comm: Comm, group: Group, name: str = "tp_vocab") -> torch.Tensor:
    """Mean cross-entropy over every position; ``logits`` (..., V_local) hold this rank's vocab
    columns starting at ``vocab_start``. Equals F.cross_entropy on the gathered logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, target.reshape(-1), vocab_start, comm, group, name)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                             comm: Comm, group: Group, name: str = "tp_vocab") -> torch.Tensor:
    """Embedding whose table rows [vocab_start, vocab_start + V_local) live on this rank: look up
    the ids this rank owns, zeros elsewhere, then g (allreduce forward) sums the ranks' parts.
    Exact: every position gets one non-zero contribution."""
    v_local = weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + v_local)          # (B, T)
    local = (ids - vocab_start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight)                      # (B, T, C)
    out = out.masked_fill(outside[..., None], 0.0)
    return reduce_from_tp(out, comm, group, name=name)


# -- sequence parallelism (Korthikanti et al., 2022): the residual stream split on the sequence --
# The activations are batch-first, (B, S, ...): the sequence is dimension 1. A collective's
# pieces are contiguous runs of dimension 0, so each op makes one copy: the gather receives the
# ranks' (B, S/N, ...) slices as (N, B, S/N, ...) and permutes once into (B, S, ...); the
# reduce-scatter permutes (B, S, ...) once into (N, B, S/N, ...) and receives its slice in place.
def _check_sequence(s: int, group: Group) -> None:
    if s % group.size:
        raise ValueError(f"sequence parallelism splits the sequence over the {group.size} tp "
                         f"ranks, and a length of {s} does not divide; fix: a sequence length "
                         f"divisible by {group.size} (--block-size), or drop --sp")


def _gather_sequence(x: torch.Tensor, comm: Comm, group: Group, name: str) -> torch.Tensor:
    """(B, S/N, ...) slices of every rank -> (B, S, ...) in rank order (no autograd)."""
    x = x.contiguous()
    b, n = x.shape[0], x.shape[1]
    out = torch.empty((group.size * b, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group, name=name)                       # (N*B, S/N, ...)
    out = out.view(group.size, *x.shape)                            # (N, B, S/N, ...)
    return out.transpose(0, 1).reshape(b, group.size * n, *x.shape[2:])   # the one copy


def _reduce_scatter_sequence(x: torch.Tensor, comm: Comm, group: Group, name: str) -> torch.Tensor:
    """(B, S, ...) partial sums of every rank -> this rank's (B, S/N, ...) slice of their sum."""
    _check_sequence(x.shape[1], group)
    b, n = x.shape[0], x.shape[1] // group.size
    front = x.reshape(b, group.size, n, *x.shape[2:]).transpose(0, 1)          # (N, B, S/N, ...)
    front = front.reshape(group.size * b, n, *x.shape[2:])         # the one copy
    out = torch.empty((b, n, *x.shape[2:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, front, group, name=name)               # this rank's (B, S/N, ...)
    return out


def _my_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    _check_sequence(x.shape[1], group)
    n = x.shape[1] // group.size
    return x[:, group.rank * n: (group.rank + 1) * n].contiguous()


class _ScatterToSequence(torch.autograd.Function):
    """Replicated (B, S, ...) -> this rank's (B, S/N, ...) slice (no communication); backward:
    all-gather of the slices' gradients (each rank's slice gradient is complete)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.comm, ctx.group, "sp_ag"), None, None


class _GatherFromSequence(torch.autograd.Function):
    """Megatron's SP f: all-gather the slices forward; backward, the whole-sequence gradients
    (partial sums: each rank's heads, or vocabulary columns) reduce-scattered to slices."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return _gather_sequence(x, comm, group, "sp_ag")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.comm, ctx.group, "sp_rs"), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Megatron's SP g: partial sums reduce-scattered to slices forward; backward, the slices'
    gradients all-gathered (the gradient of a partial sum is the sum's)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return _reduce_scatter_sequence(x, comm, group, "sp_rs")

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad.contiguous(), ctx.comm, ctx.group, "sp_ag"), None, None


class _SumGradOverTP(torch.autograd.Function):
    """A replicated parameter used on a sequence slice: identity forward; backward, its
    gradient (this slice's part) summed over tp, so every rank holds the whole sequence's."""

    @staticmethod
    def forward(ctx, p, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group, name="sp_grad")
        return grad, None, None


def scatter_to_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """Enter the sequence-parallel region: this rank's slice of a replicated (B, S, ...)."""
    return x if group.size == 1 else _ScatterToSequence.apply(x, comm, group)


def gather_from_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """Leave it: the whole sequence (meter ``sp_ag``; backward ``sp_rs``)."""
    return x if group.size == 1 else _GatherFromSequence.apply(x, comm, group)


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, group: Group,
                               name: str = "sp_rs") -> torch.Tensor:
    """A row-parallel layer's partial sums -> this rank's slice of the sum (meter ``sp_rs``;
    backward ``sp_ag``). Takes a meter name (ignored) to stand in for :func:`reduce_from_tp`."""
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, comm, group)


def sum_grad_over_tp(p: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """``p`` as used on a sequence slice: its gradient summed over tp (meter ``sp_grad``)."""
    return p if group.size == 1 else _SumGradOverTP.apply(p, comm, group)


class Regather:
    """The whole input of a sequence-parallel region (all-gathered from this rank's slice), as
    its column-parallel layers' backward needs it: gathered again from the slice once, by the
    first of them, and dropped after the last (Megatron's trick: the region keeps its slice,
    not the whole sequence, for backward). ``users``: layers whose backward still needs it.
    ``start`` launches the gather without waiting, so the first layer's input-gradient matmul
    runs while it travels (Megatron overlaps the same gather with the same matmul)."""

    def __init__(self, comm: Comm, group: Group):
        self.comm, self.group, self.users, self.whole, self.pending = comm, group, 0, None, None

    def start(self, s: torch.Tensor) -> None:
        if self.whole is None and self.pending is None:
            s = s.contiguous()
            buf = torch.empty((self.group.size * s.shape[0], *s.shape[1:]), dtype=s.dtype,
                              device=s.device)
            work = self.comm.all_gather(buf, s, self.group, async_op=True, name="sp_ag")
            self.pending = (work, buf.view(self.group.size, *s.shape))

    def take(self, s: torch.Tensor) -> torch.Tensor:
        self.start(s)
        if self.pending is not None:
            (work, buf), self.pending = self.pending, None
            work.wait()                                                    # (N, B, S/N, in)
            self.whole = buf.transpose(0, 1).reshape(buf.shape[1], -1, *buf.shape[3:])
        whole, self.users = self.whole, self.users - 1
        if self.users <= 0:
            self.whole = None
        return whole


class _LinearOnGathered(torch.autograd.Function):
    """y = x W^T + b on a gathered whole input x whose slice s is saved instead of x; the
    weight's gradient re-gathers x from s (Regather, launched before x's gradient is computed,
    so that the matmul hides it); x's gradient flows to the gather."""

    @staticmethod
    def forward(ctx, x, s, w, b, regather: Regather):
        ctx.regather, ctx.has_bias = regather, b is not None
        if w.requires_grad:
            regather.users += 1
        ctx.save_for_backward(s, w)
        return torch.nn.functional.linear(x, w, b)                         # (B, S, out)

    @staticmethod
    def backward(ctx, grad):
        s, w = ctx.saved_tensors
        if ctx.needs_input_grad[2]:
            ctx.regather.start(s)
        grad_x = grad.matmul(w.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        flat = grad.reshape(-1, grad.shape[-1])                            # (B*S, out)
        if ctx.needs_input_grad[2]:
            x = ctx.regather.take(s).to(grad.dtype)
            grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1]))           # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat.sum(0)
        return grad_x, None, grad_w, grad_b, None


def gather_for_region(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """:func:`gather_from_sequence` whose output remembers the slice it came from, so that the
    column-parallel layers reading it (:func:`linear_on_gathered`) save that slice only."""
    if group.size == 1:
        return x
    whole = _GatherFromSequence.apply(x, comm, group)
    whole.sp_source = (x, Regather(comm, group))
    return whole


def linear_on_gathered(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear, saving for backward the slice ``x`` was gathered from (gather_for_region)
    instead of ``x`` itself; a plain F.linear on any other input."""
    source = getattr(x, "sp_source", None)
    if source is None or not torch.is_grad_enabled():
        return torch.nn.functional.linear(x, w, b)
    return _LinearOnGathered.apply(x, source[0], w, b, source[1])


def passthrough(x: torch.Tensor, comm: Comm, group: Group, name: str = "") -> torch.Tensor:
    """Stands in for :func:`copy_to_tp` where the input was gathered by
    :func:`gather_from_sequence`, whose backward already sums the ranks' gradients."""
    return x
