"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21, section 2.2.2; Megatron-LM's virtual pipeline).

The model is cut into p x v chunks (virtual stages); rank s holds chunks s, s + p, ..., s + (v-1)p
(``Action.chunk`` c is virtual stage c·p + s), so a micro-batch goes round the ring of ranks v
times. Micro-batches travel in groups of p: the k-th forward of a rank runs micro-batch
(k // (p·v))·p + k % p on chunk (k % (p·v)) // p, the k-th backward the same micro-batch order
on the chunks in reverse. Each rank first runs (p - s - 1)·2 + (v - 1)·p warm-up forwards
(Megatron's count: enough that the first backward's gradient has come back), then alternates
one forward / one backward, then runs the remaining backwards.

Bubble: with per-chunk F and B costs 1/v of a whole stage's, the idle time per rank is still
(p-1)(t_F + t_B)/v, so the step's idle fraction is (p-1)/(v·m + p-1) ((p-1)/(v·m) of the ideal
compute time, the paper's form): v times smaller than 1F1B's, for v times as many messages.
Memory: rank 0 holds up to (p - 1)·2 + (v - 1)·p + 1 chunk activations, each 1/v of a stage's,
so about (1 + (p-1)/(p·v))·p stage micro-batches, a little above 1F1B's p.
Requirement (as in Megatron): m divisible by p, the micro-batch groups being whole.
"""
from __future__ import annotations

from shardwise.parallel.pipeline.schedule import Action, ScheduleError, _backward, _forward


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved schedule for p ranks, m micro-batches and v chunks per rank."""
    if v < 1 or m % p:
        raise ScheduleError(f"interleaved 1F1B needs v >= 1 and num_microbatches divisible by "
                            f"pp (m = {m}, p = {p}, v = {v})")
    total = m * v                                   # forwards (and backwards) per rank

    def mb(k: int) -> int:                          # micro-batch of the k-th F (or B)
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:        # chunk of the k-th F (or B: reversed)
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    out = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        fwd = lambda k: _forward(s, p, mb(k), chunk(k, True), v)        # noqa: E731
        bwd = lambda k: _backward(s, p, mb(k), chunk(k, False), v)      # noqa: E731
        actions = [a for k in range(warmup) for a in fwd(k)]            # warm-up
        for k in range(total - warmup):                                 # steady
            actions += fwd(warmup + k) + bwd(k)
        for k in range(total - warmup, total):                          # cool-down
            actions += bwd(k)
        out.append(actions)
    return out
