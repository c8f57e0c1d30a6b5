"""Cutting a model into p pipeline stages, by its plan (shardwise/models/plans.py: shardwise's
GPT, Hugging Face GPT-2 and Llama, registered user classes).

Stage s keeps a contiguous run of blocks; the first stage also keeps the embeddings (GPT:
tok_emb, pos_emb), the last the final norm and the head, every stage the plan's shared modules.
A weight tied between the first and the last stage (GPT-2's wte / lm_head) is kept on both
(:func:`tied_across_stages`). Boundaries are balanced by parameter count
(min over cuts of the largest stage, by dynamic programming) or given as ``stage_layers``
('1,3' = one block on stage 0, three on stage 1). Parameters keep their single-model names
through :meth:`PipelineStage.global_name` (``blocks.0`` of stage 1 may be ``blocks.2``).

Interleaved schedules cut p·v virtual stages the same way and give rank r the chunks r, r + p,
..., r + (v-1)p (:class:`VirtualStages`, :func:`stage_of`).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from shardwise.models.plans import plan_of
from shardwise.parallel.pipeline import checks


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def balanced_bounds(costs: list[int], first_extra: int, last_extra: int, p: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges for p stages minimising the largest stage's cost
    (stage 0 also pays ``first_extra``, stage p-1 ``last_extra``); every stage gets >= 1 block."""
    n = len(costs)
    if not 1 <= p <= n:
        raise ValueError(f"cannot cut {n} blocks into {p} non-empty stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost placing blocks [0, i) on stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0
    for s in range(1, p + 1):
        for i in range(s, n - (p - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if s == 1 else 0) \
                    + (last_extra if s == p else 0)
                value = max(best[s - 1][j], load)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(p, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def parse_stage_layers(text: str, n_layer: int, p: int) -> list[tuple[int, int]]:
    """'1,3' -> [(0, 1), (1, 4)] (the text is checked by pipeline/checks.py)."""
    bounds, start = [], 0
    for c in checks.parse_stage_layers(text, n_layer, p):
        bounds.append((start, start + c))
        start += c
    return bounds


def _plan(model: nn.Module):
    plan = plan_of(model)
    if plan is None:
        name = type(model).__name__
        raise TypeError(f"pipeline parallelism cuts a model by its plan; {name} has none; fix: "
                        f"shardwise.register_plan({name}, ModelPlan(...)) (shardwise/models/"
                        "plans.py), or use --dp with --zero-stage 0-3")
    return plan


def stage_bounds(model: nn.Module, p: int, stage_layers: str = "") -> list[tuple[int, int]]:
    """Block ranges of the p stages of a (full, unsplit) model with a plan."""
    plan = _plan(model)
    blocks = plan.blocks_of(model)
    if stage_layers:
        return parse_stage_layers(stage_layers, len(blocks), p)
    costs = [_numel(b) for b in blocks]
    first = sum(_numel(model.get_submodule(n)) for n in plan.first)
    last = sum(_numel(model.get_submodule(n)) for n in plan.last)
    return balanced_bounds(costs, first, last, p)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root`` (empty containers in between), so
    that the stage's parameter names are the model's own."""
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            setattr(root, part, nn.Module())
        root = getattr(root, part)
    setattr(root, leaf, module)


def tied_across_stages(model: nn.Module, plan) -> dict[str, str]:
    """Weights the first and the last stage both use (GPT-2's lm_head.weight is
    transformer.wte.weight): {the last stage's name: the first stage's name}. Each of the two
    stages keeps its own copy; the pipeline all-reduces their gradients between the two stages
    (parallel/pipeline/driver.py), so the copies stay equal, and both answer to the first one's name."""
    firsts = {id(q): f"{n}.{k}" for n in plan.first
              for k, q in model.get_submodule(n).named_parameters(remove_duplicate=False)}
    return {f"{n}.{k}": firsts[id(q)] for n in plan.last
            for k, q in model.get_submodule(n).named_parameters(remove_duplicate=False)
            if id(q) in firsts}


class PipelineStage(nn.Module):
    """Stage ``index`` of ``num_stages``: the model's blocks [start, end) and, at the ends, the
    embeddings or the final norm and head (its plan's ``first`` / ``last``; ``shared`` modules,
    such as Llama's rotary table, on every stage). forward: token ids (first stage) or the
    residual stream (B, T, C) in; residual stream or logits out (the plan's embed / block /
    final pieces)."""

    def __init__(self, gpt: nn.Module, bounds: list[tuple[int, int]], index: int):
        super().__init__()
        plan = _plan(gpt)
        self.plan, self.prefix = plan, plan.blocks + "."
        self.index, self.num_stages = index, len(bounds)
        self.start, self.end = bounds[index]
        self.is_first, self.is_last = index == 0, index == len(bounds) - 1
        for path in (*plan.shared, *(plan.first if self.is_first else ())):
            _place(self, path, gpt.get_submodule(path))
        _place(self, plan.blocks, nn.ModuleList(plan.blocks_of(gpt)[self.start:self.end]))
        for path in plan.last if self.is_last else ():
            _place(self, path, gpt.get_submodule(path))
        # the last stage's copies of tied weights (none when one stage holds both ends)
        self.tied = {} if self.is_first or not self.is_last else tied_across_stages(gpt, plan)
        # what the plan's pieces read off the model as its own forward does (a Hugging Face
        # model's config: masks, vocabulary; its loss_function: the loss from labels)
        self.config = getattr(gpt, "config", None)
        self.loss_function = getattr(gpt, "loss_function", None) if self.is_last else None
        self.model_class = type(gpt).__name__
        self.signature = inspect.signature(gpt.forward)

    def split_batch(self, batch) -> tuple[torch.Tensor, dict]:
        """(token ids, the other inputs by name) of a micro-batch: a tensor (the ids), a tuple
        (positional) or a dict (keyword), bound to the model's forward signature as the whole
        model would take it. Inputs the plan's stages do not take are refused (they would
        otherwise be dropped without a word)."""
        if torch.is_tensor(batch):
            return batch, {}
        args, kwargs = (tuple(batch), {}) if isinstance(batch, (tuple, list)) else ((), dict(batch))
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ValueError(f"the batch does not fit {self.model_class}.forward ({e}); fix: "
                             "pass a dict of its keyword arguments") from None
        named = {}
        for name, value in bound.arguments.items():
            param = self.signature.parameters[name]
            extra = value if param.kind is param.VAR_KEYWORD else {name: value}
            named.update({k: v for k, v in extra.items()
                          if v is not None and not (k in self.signature.parameters and
                                                    v is self.signature.parameters[k].default)})
        ids = named.pop(self.plan.ids, None)
        if not torch.is_tensor(ids):
            raise ValueError(f"the pipeline's first stage embeds the token ids, and this batch "
                             f"has no {self.plan.ids!r}; fix: put the token ids in the batch "
                             f"as {self.plan.ids!r}")
        unknown = sorted(set(named) - set(self.plan.inputs))
        if unknown:
            takes = ", ".join((self.plan.ids, *self.plan.inputs))
            raise ValueError(f"the pipeline stages of {self.model_class} take {takes}; this batch "
                             f"also has {', '.join(unknown)}, which they would ignore; fix: drop "
                             "them, or train with pp = 1 (ddp, zero1-3, tp), where the whole "
                             "model's forward takes any input")
        return ids, named

    @property
    def stage_blocks(self) -> nn.ModuleList:
        return self.get_submodule(self.plan.blocks)

    def forward(self, x: torch.Tensor, inputs: dict | None = None) -> torch.Tensor:
        """``inputs``: the micro-batch's other inputs by name (:meth:`split_batch`: attention
        mask, positions, labels)."""
        inputs = inputs or {}
        if self.is_first:                                   # x: (B, T) token ids
            x = self.plan.embed(self, x, inputs)            # (B, T, C)
        ctx = self.plan.context(self, x, inputs) if self.plan.context else None
        for block in self.stage_blocks:                     # (B, T, C)
            x = self.plan.block(self, block, x, ctx)
        return self.plan.final(self, x, inputs) if self.is_last else x

    def global_name(self, local: str) -> str:
        """The single-model name of one of this stage's parameters (a tied copy answers to
        the name of the weight it is tied to, as the single model's named_parameters does)."""
        if local in self.tied:
            return self.tied[local]
        if local.startswith(self.prefix):
            i, rest = local[len(self.prefix):].split(".", 1)
            return f"{self.prefix}{int(i) + self.start}.{rest}"
        return local

    def is_tied_copy(self, local: str) -> bool:
        """Whether parameter ``local`` is the last stage's copy of a tied weight (counted once
        in the gradient norm: on the first stage)."""
        return local in self.tied


class VirtualStages(nn.Module):
    """Interleaved pipelines: the v chunks (virtual stages ``rank + c·p``) that one rank holds, as
    one module whose parameters are ``chunks.<c>.<the chunk's own name>`` (the executor runs the
    chunks themselves; this module only holds them for the optimizer, data parallelism and
    state dicts)."""

    def __init__(self, gpt: nn.Module, bounds: list[tuple[int, int]], rank: int, p: int):
        super().__init__()
        self.chunks = nn.ModuleList(PipelineStage(gpt, bounds, c * p + rank)
                                    for c in range(len(bounds) // p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the chunks of an interleaved pipeline run one at a time, in the "
                           "schedule's order (executor.py)")

    def global_name(self, local: str) -> str:
        _, c, rest = local.split(".", 2)                     # chunks.<c>.<name>
        return self.chunks[int(c)].global_name(rest)

    def is_tied_copy(self, local: str) -> bool:
        _, c, rest = local.split(".", 2)
        return self.chunks[int(c)].is_tied_copy(rest)


def stage_of(gpt: nn.Module, bounds: list[tuple[int, int]], rank: int,
             p: int) -> PipelineStage | VirtualStages:
    """Rank ``rank``'s part of the p-rank pipeline cut at ``bounds`` (stage_bounds over p·v
    virtual stages): stage ``rank`` itself, or with v > 1 its v chunks."""
    return PipelineStage(gpt, bounds, rank) if len(bounds) == p else VirtualStages(gpt, bounds, rank, p)
