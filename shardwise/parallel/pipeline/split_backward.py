"""A stage's backward split in two, as zero-bubble schedules need (ZB-H1's B and W): B computes
only the gradient of the stage input (what the previous stage waits for), W later only the
weight gradients, and neither repeats the other's work.

The autograd graph of a micro-batch's forward has two kinds of paths from the stage output
down: the input path (through every op whose input derives from the stage input: the residual
stream, each block's activations) and, hanging off it, each weight's short branch (a linear's
``mm`` has its activation on the input path and its weight on a branch). B runs
``torch.autograd.grad`` from the output to the stage input with the graph kept
(``retain_graph``). Before it does, a pre-hook goes on every *junction*: a node of the input
path that a weight's branch leads into (the linear's ``mm`` backward, a layer norm's backward).
Each captures the gradient flowing into its node, which is exactly what the unsplit backward
would give that node. W then starts from those junctions with those captured gradients
(``torch.autograd.GradientEdge``) and runs ``torch.autograd.backward`` restricted to the weights
(``inputs``): autograd executes only the weight branches (a ``mm`` backward computes its weight
gradient, not its input gradient again), and each weight's gradient is accumulated through its
AccumulateGrad node, so gradient hooks (data parallelism's buckets) see the same calls as in an
unsplit backward. A weight whose branch reaches the output without meeting the input path (the
whole first stage, whose input is token ids) is done in W from the output itself; B then has
nothing to compute.

When one group of weights meets the input path at several junctions and one junction lies
below another, a backward from both would add the upper one's contribution to the lower one's
captured (already complete) gradient again; a pre-hook during W pins each junction's incoming
gradient to the captured value. Memory: the graph stays alive from B to W (ZB-H1's p
micro-batches of activations per stage), plus the captured junction gradients.

The same idea is torch.distributed.pipelining's stage_backward_input / stage_backward_weight;
written here for shardwise's executor (parallel/pipeline/executor.py).
"""
from __future__ import annotations

import collections

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node producing ``t`` (its AccumulateGrad for a leaf that requires grad)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _upward_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that consume its output (the graph's edges reversed), from ``roots``."""
    up: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            up[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return up


def _upward(starts: list[Node], up: dict, stop: set) -> tuple[set, set]:
    """Nodes reached going up from ``starts`` (towards the output), not passing ``stop``
    nodes; and the ``stop`` nodes met."""
    reached, met, queue = set(starts), set(), collections.deque(starts)
    while queue:
        for parent in up.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


class SplitBackward:
    """One micro-batch's split backward on one stage: :meth:`input_grad` (B), then
    :meth:`weight_grad` (W), both on the graph of ``output`` (the stage's output, or the scaled
    loss on the last stage)."""

    def __init__(self, output: torch.Tensor, grad_output: torch.Tensor | None,
                 stage_input: torch.Tensor | None, params: list[torch.nn.Parameter]):
        self.output, self.grad_output = output, grad_output
        self.input = stage_input if stage_input is not None and stage_input.requires_grad \
            else None
        self.params = [q for q in params if q.requires_grad]
        self.groups: list[dict] = []           # {"params", "junctions", "grads"}
        self.from_output: list[torch.nn.Parameter] = []

    def _plan(self) -> None:
        """Group the weights by the junctions where their branches meet the input path."""
        root = _node(self.output)
        up = _upward_edges([root])
        on_path = _upward([_node(self.input)], up, set())[0] if self.input is not None else set()
        by_junction: dict[Node, dict] = {}
        for q in self.params:
            acc = _node(q)
            if acc not in up:                  # not in this graph (unused by this stage)
                continue
            reached, met = _upward([acc], up, on_path)
            if not met:                        # its branch reaches the output on its own
                self.from_output.append(q)
                continue
            group = {"params": [q], "junctions": set(met)}
            for j in met:                      # merge with groups sharing a junction
                other = by_junction.get(j)
                if other is not None and other is not group:
                    held = {id(p) for p in other["params"]}
                    other["params"] += [p for p in group["params"] if id(p) not in held]
                    other["junctions"] |= group["junctions"]
                    for k in group["junctions"]:
                        by_junction[k] = other
                    group = other
                by_junction[j] = group
        unique = {id(g): g for g in by_junction.values()}
        self.groups = list(unique.values())
        for g in self.groups:
            g["junctions"] = list(g["junctions"])
            g["grads"] = [None] * len(g["junctions"])

    def input_grad(self) -> torch.Tensor | None:
        """B: the stage input's gradient (None on the first stage), junction gradients kept."""
        self._plan()
        if self.input is None:
            return None
        handles = []
        for g in self.groups:
            for i, node in enumerate(g["junctions"]):
                def keep(grad_outputs, g=g, i=i):
                    g["grads"][i] = grad_outputs
                handles.append(node.register_prehook(keep))
        try:
            (grad,) = torch.autograd.grad(self.output, [self.input], self.grad_output,
                                          retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return grad

    def weight_grad(self) -> None:
        """W: every weight's gradient, accumulated into ``.grad`` (hooks fire as usual)."""
        for g in self.groups:
            edges, grads = [], []
            for node, captured in zip(g["junctions"], g["grads"]):
                for k, grad in enumerate(captured or ()):
                    if grad is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(grad)
            if not edges:
                continue
            pins = [node.register_prehook(lambda _, saved=captured: saved)
                    for node, captured in zip(g["junctions"], g["grads"])] \
                if len(g["junctions"]) > 1 else []
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=g["params"])
            finally:
                for h in pins:
                    h.remove()
        if self.from_output:
            torch.autograd.backward(self.output, self.grad_output, retain_graph=True,
                                    inputs=self.from_output)
        self.groups, self.output = [], None
