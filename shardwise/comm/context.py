"""Context parallelism's collectives inside autograd: ring attention, Ulysses' all-to-alls, and
the sequence gather behind ``engine(x)`` (parallel/context.py applies them).

Layout. A sequence of S positions is cut into 2N chunks of c = S / (2N); cp rank r holds chunks
r and 2N-1-r (causal load balancing, as Megatron's and torchtitan's context parallelism do), as
a local sequence of L = 2c positions [chunk r | chunk 2N-1-r] (:func:`positions`). Under a
causal mask every rank then has the same work: an early chunk sees little, its late partner
much. Attention tensors here are (B, h, L, d), h this rank's heads (tp-local under tp).

Ring (Liu et al., 2023, "Ring Attention"; picotron's and torchtitan's in our words). Each rank
keeps its queries; the keys and values (one (2, B, h, L, d) tensor) travel round the cp ring,
N - 1 hops, each launched before the block it replaces is computed (p2p, meter ``cp_ring``).
Rank r meets the keys of rank s:
    s == r   its own: causal inside the local sequence (by global position)
    s <  r   both query chunks see s's first chunk whole and its second not at all
    s >  r   r's second chunk sees both of s's chunks whole; r's first sees nothing
so every block but the diagonal is a plain, unmasked attention of c or 2c rows: half the work
of the full L x L block. Blocks merge with the online softmax (running max as log-sum-exp).
Backward recomputes each block's probabilities from the saved log-sum-exp (FlashAttention's
backward); the key and value gradients travel with the keys and values and take one more hop
home. Traffic per layer and step, per rank: forward N-1 sends of 2 B h L d elements (every
other rank's keys and values: (N-1)/N of the whole sequence's); backward the same N-1 sends
and N sends of their gradients (fp32).

Ulysses (Jacobs et al., 2023, DeepSpeed-Ulysses). One all-to-all turns q, k and v (stacked)
from sequence-split, all heads, to head-split (h/N heads), whole sequence; attention runs
whole (causal, in natural order); one all-to-all turns the output back (meter ``cp_a2a``).
Traffic per layer: (N-1)/N of 3 B h L d elements forward and of B h L d back, the same again in
backward. Needs h divisible by N.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.comm.collectives import Comm, Group


def positions(seq_len: int, n: int, rank: int, device=None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``n`` holds of a sequence of ``seq_len``: chunks
    ``rank`` and ``2n-1-rank`` of 2n (module docstring)."""
    if seq_len % (2 * n):
        raise ValueError(f"context parallelism cuts a sequence into 2 x cp = {2 * n} chunks, "
                         f"and a length of {seq_len} does not divide; fix: a sequence length "
                         f"divisible by {2 * n} (--block-size), or a smaller --cp")
    c = seq_len // (2 * n)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c, device=device)
    return torch.cat([head, tail])


def _rank_major(seq_len: int, n: int, device=None) -> torch.Tensor:
    """Global positions in the order the ranks' local sequences follow one another."""
    return torch.cat([positions(seq_len, n, r, device) for r in range(n)])


# -- ring attention -------------------------------------------------------------------------------
def _blocks(r: int, s: int, c: int):
    """(query rows, key columns, causal) of rank r's queries against rank s's keys."""
    if s == r:
        return slice(None), slice(None), True
    if s < r:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _pass(comm: Comm, group: Group, t: torch.Tensor):
    """Send ``t`` to the next rank of the ring and receive the previous rank's (async)."""
    n, r = group.size, group.rank
    buf = torch.empty_like(t)
    works = [comm.isend(t, (r + 1) % n, group, name="cp_ring"),
             comm.irecv(buf, (r - 1) % n, group, name="cp_ring")]
    return works, buf


def _done(pending) -> torch.Tensor:
    works, buf = pending
    for w in works:
        w.wait()
    return buf


# One block: (out, lse) of queries against keys, and its gradients given the whole attention's
# out and lse (FlashAttention's backward: P = exp(S - lse), D = rowsum(dout * out)). On CPU
# torch's flash kernel does both without materialising the (rows x cols) scores; elsewhere, or
# with a key mask (padding), the scores are computed explicitly. The diagonal block is plain
# causal on the local order: the local positions [chunk r | chunk 2N-1-r] increase, so "key at
# or before query" by global position is "key index <= query index" locally. ``keep``: (B, cols)
# booleans, False for a padding key; a row that sees no key gets out 0 and lse -inf, as torch's
# sdpa gives a fully masked row 0 (the last padding position's output meets a target: the first
# token's).
def _block_forward(q, k, v, causal: bool, scale: float, keep=None):
    if q.device.type == "cpu" and keep is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    scores = _masked(q.float() @ k.float().transpose(-1, -2) * scale, causal, keep)
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - _finite(lse)[..., None]) @ v.float(), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None):
    if q.device.type == "cpu" and keep is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, dout = q.float(), k.float(), v.float(), dout.float()
    scores = _masked(qf @ kf.transpose(-1, -2) * scale, causal, keep)
    p = torch.exp(scores - _finite(lse)[..., None])
    ds = p * (dout @ vf.transpose(-1, -2) - (dout * out).sum(-1)[..., None])
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, p.transpose(-1, -2) @ dout


def _masked(scores: torch.Tensor, causal: bool, keep) -> torch.Tensor:
    if causal:
        rows, cols = scores.shape[-2:]
        upper = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key yet) as 0, so exp(x - lse) is 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """Grouped-query attention: (B, h_kv, n, d) -> (B, h_kv * rep, n, d), query head j reading
    key-value head j // rep (Hugging Face's repeat_kv)."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _fold(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: the rep query heads of one key-value head summed."""
    if rep == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // rep, rep, n, d).sum(2)


def _keeps(keep, n: int):
    """Each rank's (B, L) key mask out of the whole sequence's (B, S) one, or Nones."""
    if keep is None:
        return [None] * n
    return [keep[:, positions(keep.shape[1], n, s, keep.device)] for s in range(n)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, group: Group, scale: float, keep):
        n, r = group.size, group.rank
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        keeps = _keeps(keep, n)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()                 # (2, B, h, L, d)
        for i in range(n):
            s = (r - i) % n
            pending = _pass(comm, group, kv) if i < n - 1 else None
            rows, cols, causal = _blocks(r, s, c)
            block_keep = None if keeps[s] is None else keeps[s][:, cols]
            block_out, block_lse = _block_forward(q[:, :, rows], _expand(kv[0][:, :, cols], rep),
                                                  _expand(kv[1][:, :, cols], rep), causal, scale,
                                                  block_keep)
            new = _finite(torch.logaddexp(lse[:, :, rows], block_lse))
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new)[..., None]
                               + block_out * torch.exp(block_lse - new)[..., None])
            lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], block_lse)
            if pending is not None:
                kv = _done(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.group, ctx.scale, ctx.keeps = comm, group, scale, keeps
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, group, scale, keeps = ctx.comm, ctx.group, ctx.scale, ctx.keeps
        n, r = group.size, group.rank
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for i in range(n):
            s = (r - i) % n
            pending = _pass(comm, group, kv) if i < n - 1 else None
            rows, cols, causal = _blocks(r, s, c)
            block_keep = None if keeps[s] is None else keeps[s][:, cols]
            dqb, dkb, dvb = _block_backward(dout[:, :, rows], q[:, :, rows],
                                            _expand(kv[0][:, :, cols], rep),
                                            _expand(kv[1][:, :, cols], rep), out[:, :, rows],
                                            lse[:, :, rows], causal, scale, block_keep)
            dq[:, :, rows] += dqb
            dkv[0][:, :, cols] += _fold(dkb, rep)
            dkv[1][:, :, cols] += _fold(dvb, rep)
            dkv = _done(_pass(comm, group, dkv))               # with its keys, one hop on
            if pending is not None:
                kv = _done(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q, k, v, comm: Comm, group: Group, scale: float | None = None, keep=None):
    """Causal attention of this rank's queries over the whole sequence's keys and values, the
    keys and values passed round the cp ring (module docstring). q: (B, h, L, d); k, v:
    (B, h_kv, L, d), h_kv dividing h (grouped-query attention: the ring carries the h_kv heads,
    each block expands them). ``keep``: None, or the whole sequence's (B, S) booleans in natural
    order, False for a padding key (every cp rank has the batch's mask: nothing travels)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_groups(q, k)
    if group.size == 1:
        return _one_rank(q, k, v, scale, keep)
    return _RingAttention.apply(q, k, v, comm, group, scale, keep)


def _one_rank(q, k, v, scale: float, keep):
    """cp = 1: the whole sequence here, padding keys masked (a row that sees no key gets 0, as
    torch's sdpa gives it and the ring does)."""
    rep = q.shape[1] // k.shape[1]
    k, v = _expand(k, rep), _expand(v, rep)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_natural_mask(keep), scale=scale)


def _natural_mask(keep: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S): causal, padding keys masked."""
    s = keep.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
    return causal & keep[:, None, None, :]


def _check_groups(q, k):
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"grouped-query attention needs the {q.shape[1]} query heads to divide "
                         f"by the {k.shape[1]} key-value heads")


# -- Ulysses --------------------------------------------------------------------------------------
def _to_heads(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """(T, B, h, L, d) sequence-split -> (T, B, h/N, N*L, d) head-split, rank-major order."""
    n = group.size
    t, b, h, l, d = x.shape
    send = x.reshape(t, b, n, h // n, l, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    recv = torch.empty_like(send)                            # (N, T, B, h/N, L, d)
    comm.all_to_all(recv, send, group, name="cp_a2a")
    return recv.permute(1, 2, 3, 0, 4, 5).reshape(t, b, h // n, n * l, d)


def _to_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """The inverse of :func:`_to_heads`."""
    n = group.size
    t, b, hn, nl, d = x.shape
    send = x.reshape(t, b, hn, n, nl // n, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)                            # (N, T, B, h/N, L, d)
    comm.all_to_all(recv, send, group, name="cp_a2a")
    return recv.permute(1, 2, 0, 3, 4, 5).reshape(t, b, n * hn, nl // n, d)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return _to_heads(x, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad.contiguous(), ctx.comm, ctx.group), None, None


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return _to_sequence(x, comm, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad.contiguous(), ctx.comm, ctx.group), None, None


def ulysses_attention(q, k, v, comm: Comm, group: Group, scale: float | None = None,
                      keep=None):
    """Causal attention by DeepSpeed-Ulysses (module docstring): one all-to-all to h/N heads of
    the whole sequence, attention in natural order, one all-to-all back. q: (B, h, L, d); k, v:
    (B, h_kv, L, d). With h_kv = h, q, k and v travel as one tensor; with grouped-query
    attention the keys and values travel as their own h_kv heads when N divides h_kv, else
    they are first expanded to the h query heads (more traffic: the price of N > h_kv).
    ``keep`` as for :func:`ring_attention`: with it the attention runs on a (B, 1, S, S) mask."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_groups(q, k)
    n, rep = group.size, q.shape[1] // k.shape[1]
    if n == 1:
        return _one_rank(q, k, v, scale, keep)
    if q.shape[1] % n:
        raise ValueError(f"Ulysses splits the {q.shape[1]} heads over cp = {n} ranks, which do "
                         f"not divide them; fix: --cp-impl ring, or a --cp that divides them")
    seq = n * q.shape[2]
    order = _rank_major(seq, n, q.device)                      # rank-major -> global position
    natural = torch.argsort(order)                              # global position -> rank-major
    if k.shape[1] % n:                                          # fewer kv heads than ranks
        k, v, rep = _expand(k, rep), _expand(v, rep), 1
    if rep == 1:
        qkv = _ToHeads.apply(torch.stack([q, k, v]), comm, group)[:, :, :, natural]
        q, k, v = qkv[0], qkv[1], qkv[2]                        # (B, h/N, S, d)
    else:
        q = _ToHeads.apply(q[None], comm, group)[0][:, :, natural]
        kv = _ToHeads.apply(torch.stack([k, v]), comm, group)[:, :, :, natural]
        k, v = _expand(kv[0], rep), _expand(kv[1], rep)
    if keep is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=_natural_mask(keep), scale=scale)
    y = y[:, :, order]                                          # back to rank-major
    return _ToSequence.apply(y[None], comm, group)[0]


# -- the whole sequence, for engine(x) ---------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """(B, L, ...) of every cp rank -> (B, S, ...) in natural order. Backward: this rank's
    positions of the gradient, times N: every cp rank computes the same loss on the whole
    output, and the gradient sync averages over dp x cp (parallel/context.py)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        n = group.size
        ctx.group = group
        x = x.contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x, group, name="cp_gather")
        out = out.view(n, *x.shape).transpose(0, 1).reshape(x.shape[0], n * x.shape[1],
                                                            *x.shape[2:])
        natural = torch.argsort(_rank_major(out.shape[1], n, x.device))
        return out[:, natural]

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        mine = positions(grad.shape[1], group.size, group.rank, grad.device)
        return grad[:, mine] * group.size, None, None


def gather_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """This rank's (B, L, ...) positions -> the whole (B, S, ...), in order (inside autograd)."""
    return x if group.size == 1 else _GatherSequence.apply(x, comm, group)
