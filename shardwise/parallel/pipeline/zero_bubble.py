"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B with each
backward split into B, the input gradient (sent upstream at once: the next stage up waits for
it), and W, the weight gradient (nobody waits for it, so it can move).

Stage s runs 1F1B's min(p-s-1, m) warm-up forwards and its steady one-forward-one-backward,
but holds back the W of its first s backwards: after each later B it runs the W of the oldest
pending micro-batch, and the s held-back Ws fill the cool-down, where 1F1B's stage s idles
waiting for gradients. Every stage then holds at most p micro-batches of activations (F done,
W not yet), the peak of 1F1B's first stage.

Bubble (the paper's): (p-1)(T_F + T_B - T_W) per stage against m(T_F + T_B + T_W) of work, so
(p-1)/(3m + p-1) of the step with equal F, B and W costs, a third of 1F1B's (p-1)·3 units.
The split itself is the executor's (executor.py): B = autograd.grad of the stage output with
respect to the stage input and every block boundary (graph kept), W = each block's weights from
its own output gradient; together they equal the unsplit backward.
"""
from __future__ import annotations

from collections import deque

from shardwise.parallel.pipeline.schedule import Action, _backward, _forward


def zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 for p stages and m micro-batches: 1F1B's order, W of stage s deferred by s."""
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [a for i in range(warmup) for a in _forward(s, p, i)]        # warm-up
        pending: deque[int] = deque()                 # micro-batches whose W is still to run

        def backward(j: int) -> list[Action]:
            pending.append(j)
            w = [Action("W", pending.popleft())] if len(pending) > s else []
            return _backward(s, p, j) + w

        for j in range(m - warmup):                                            # steady
            actions += _forward(s, p, warmup + j) + backward(j)
        for j in range(m - warmup, m):                                         # cool-down
            actions += backward(j)
        actions += [Action("W", j) for j in pending]                           # held-back Ws
        out.append(actions)
    return out
