"""LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021).

What: a frozen linear map W (out x in) gets a trainable low-rank update, y = W x + s B A x with
A (r x in), B (out x r), s = alpha / r. A starts Kaiming-uniform(a = sqrt(5)) and B at zero (the
init peft and the paper's loralib use), so at step 0 the adapted model equals the base model
exactly. Only A and B train: r (in + out) parameters per adapted layer instead of in x out, so
gradients, optimizer state and data-parallel traffic shrink by about that ratio, while the
frozen base weights still take memory and forward / backward FLOPs. ``merge_lora`` folds
W + s B A back into plain modules for export or inference.

Why our own module and not ``peft``: peft is not a dependency here (not installed in the dev
venv) and its layouts do not fit ours:
  - tensor parallelism: our ``parallel/tensor.py`` builds ColumnParallelLinear /
    RowParallelLinear by slicing a full ``nn.Linear``, and an adapter must be sliced the same
    way: for a column-parallel layer A replicated and B split by output rows (with the base
    weight's ShardSpec, qkv's 3 interleaved parts included); for a row-parallel layer A split by
    input columns and B replicated. peft's TP layer (``LoraParallelLinear``) is built on
    megatron-core's parallel linears and ``megatron_config``, not on ours.
  - ZeRO-3 flattens each unit's parameters into flat buffers: plain Parameters with fixed
    shapes (``lora_A`` (r, in), ``lora_B`` (out, r)) flatten and slice like any weight, where
    peft keeps them inside per-adapter ModuleDicts of nn.Linear (``lora_A.default.weight``) with
    multi-adapter switching that we do not need.
  - names: peft wraps the model (``base_model.model.<name>.base_layer.weight``); here only the
    adapted module changes (``<name>.base.weight``, ``<name>.lora_A``), and after
    ``merge_lora`` the state dict has exactly the original model's keys.
So ``LoRALinear`` is a small module of two Parameters around the untouched base layer.

Hugging Face GPT-2's ``Conv1D`` (weight stored transposed, (in, out)) is adapted too. It is
recognised by class name and its ``nf`` attribute, so transformers is never imported here.
Tied weights: adapting a layer whose weight is tied (GPT-2's ``lm_head`` / ``wte``) is correct;
the merged layer gets W + s B A as its own weight, which unties it from the embedding.
"""
from __future__ import annotations

import copy
import math
from fnmatch import fnmatchcase

import torch
import torch.nn as nn

from shardwise.memory.freeze import module_names, no_match_error, parse_patterns


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's transformers.pytorch_utils.Conv1D: y = x @ W + b with W of shape (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


class LoRALinear(nn.Module):
    """base(x) + s * (x @ A^T) @ B^T around a frozen nn.Linear or Conv1D ``base``."""

    def __init__(self, base: nn.Module, rank: int, alpha: float):
        super().__init__()
        if not adaptable(base):
            raise TypeError(f"LoRA adapts nn.Linear or Conv1D, got {type(base).__name__}")
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        base.requires_grad_(False)
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.rank, self.scale = rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))    # (r, in)
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **like))   # (out, r)
        self.reset_parameters()

    # a meta-device build's initialiser (models/init.py) calls reset_parameters on this module
    # whatever the model's family: it sets lora_A and lora_B only (the base sets itself)
    initialises_itself = True

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))   # as nn.Linear's own init (peft)
        nn.init.zeros_(self.lora_B)

    @property
    def in_features(self) -> int:
        return self.base.weight.shape[0] if is_conv1d(self.base) else self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.nf if is_conv1d(self.base) else self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x: (..., in)
        low = x @ self.lora_A.t()                                  # (..., r)
        return self.base(x) + (low @ self.lora_B.t()) * self.scale  # (..., out)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """s * B @ A in the base weight's own layout: (out, in) for Linear, (in, out) for Conv1D."""
        d = (self.lora_B @ self.lora_A) * self.scale               # (out, in)
        return d.t() if is_conv1d(self.base) else d

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """A copy of the base module (same type, same names) with weight W + s B A. The base itself
        is left untouched (its weight may be tied elsewhere), so training can go on."""
        out = copy.deepcopy(self.base)
        out.weight.copy_(self.base.weight + self.delta())
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def _targets(model: nn.Module, globs: list[str]) -> list[str]:
    """Module names matched by the globs, checked: every glob matches, every match adaptable.
    Modules inside an existing LoRALinear (its ``base``) are not candidates."""
    inside = [n + "." for n, m in model.named_modules(remove_duplicate=False)
              if isinstance(m, LoRALinear)]
    names = [n for n in module_names(model) if not any(n.startswith(p) for p in inside)]
    chosen: list[str] = []
    for glob in globs:
        hits = [n for n in names if fnmatchcase(n, glob)]
        if not hits:
            raise no_match_error("LoRA target", glob, names)
        for n in hits:
            mod = model.get_submodule(n)
            if isinstance(mod, LoRALinear):
                raise ValueError(f"LoRA target {glob!r} matches {n!r}, which already has LoRA; "
                                 f"fix: inject once per layer")
            if not adaptable(mod):
                raise ValueError(f"LoRA target {glob!r} matches {n!r}, a {type(mod).__name__}, "
                                 f"not an nn.Linear or Conv1D; fix: narrow the glob to linear "
                                 f"layers (e.g. '*attn.qkv')")
            if n not in chosen:
                chosen.append(n)
    return chosen


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def inject_lora(model: nn.Module, rank: int, alpha: float, targets: list[str] | str) -> list[str]:
    """Wrap every Linear / Conv1D matched by ``targets`` (fnmatch globs over named_modules, or
    one comma-separated string) in a LoRALinear, in place, and freeze every other parameter of
    the model: only the adapters train. Returns the adapted module names (sorted). All checks
    run before the model is changed."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}; "
                         f"fix: lora_rank = 8, say (0 turns LoRA off)")
    globs = parse_patterns(targets) if isinstance(targets, str) else list(targets)
    if not globs:
        raise ValueError("LoRA needs target modules; fix: e.g. lora_targets='*attn.qkv,*mlp.fc'")
    names = _targets(model, globs)
    model.requires_grad_(False)                    # base weights and everything else: frozen
    wrapped: dict[int, LoRALinear] = {}            # a module shared under two names: one adapter
    for name in names:
        base = model.get_submodule(name)
        if id(base) not in wrapped:
            wrapped[id(base)] = LoRALinear(base, rank, alpha)
        _replace(model, name, wrapped[id(base)])
    return sorted(names)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each LoRALinear by its merged plain module, in place; returns the model, whose
    state_dict keys are again the original model's. Parameters keep their (frozen) flags."""
    adapted = [n for n, m in model.named_modules(remove_duplicate=False)
               if isinstance(m, LoRALinear)]
    merged: dict[int, nn.Module] = {}
    for name in adapted:
        lora = model.get_submodule(name)
        if id(lora) not in merged:
            merged[id(lora)] = lora.merged()
        _replace(model, name, merged[id(lora)])
    return model


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements; a tied parameter counts once."""
    params = list(model.parameters())              # parameters() yields each Parameter once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
