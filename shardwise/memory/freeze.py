"""Freezing: turn off ``requires_grad`` for the parameters named by fnmatch globs.

What and why: fine-tuning often trains only part of a model (the top blocks, the head). A frozen
parameter gets no gradient, so the optimizer (built on ``[p for p in params if p.requires_grad]``)
holds no state for it, data parallelism moves no gradient traffic for it, and its value stays
bit-identical. This module only flips the flags; it knows no strategy, so it runs before any
wrapping (``parallelize``) and every strategy sees the same trainable set.

A glob is matched (``fnmatch.fnmatchcase``) against both

  - module names from ``model.named_modules()``: every parameter under a matching module is
    frozen (``'tok_emb'``, ``'blocks.0.*'``, ``'blocks.*.attn'``), and
  - full parameter names from ``model.named_parameters()`` (``'tok_emb.weight'``, ``'*.bias'``).

Tied parameters (one ``nn.Parameter`` under two names, e.g. Hugging Face GPT-2's ``lm_head.weight``
and ``transformer.wte.weight``) are frozen once and reported under both names. A glob that
matches nothing is refused with the names that do exist: a typo must not silently train
everything.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch.nn as nn


def parse_patterns(text: str) -> list[str]:
    """Comma-separated globs -> list: whitespace stripped, empty items dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def no_match_error(what: str, pattern: str, names: list[str], shown: int = 8) -> ValueError:
    """A one-line error for a glob that matched nothing: the pattern, the first ``shown`` names
    that exist, the closest names (difflib) when there are any, and how to fix it."""
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    listed = ", ".join(repr(n) for n in names[:shown])
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ValueError(f"{what} pattern {pattern!r} matches no module or parameter{hint}; "
                      f"modules here: {listed}{more}; fix: use names from "
                      f"model.named_modules() (globs such as 'blocks.0.*' or '*.attn' work)")


def module_names(model: nn.Module) -> list[str]:
    """Every submodule's name, shared ones under each of their names; the root ('') left out."""
    return [n for n, _ in model.named_modules(remove_duplicate=False) if n]


def _params_under(model: nn.Module, pattern: str) -> list[nn.Parameter]:
    """Parameters of every module whose name matches, plus parameters whose full name matches."""
    found = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if fnmatchcase(name, pattern):
            found.extend(mod.parameters())
    for name, p in model.named_parameters(remove_duplicate=False):
        if fnmatchcase(name, pattern):
            found.append(p)
    return found


def _matches_anything(model: nn.Module, pattern: str) -> bool:
    """True if the glob names a module (parameters or not) or a parameter."""
    return any(fnmatchcase(n, pattern) for n, _ in model.named_modules(remove_duplicate=False)) \
        or any(fnmatchcase(n, pattern) for n, _ in model.named_parameters(remove_duplicate=False))


def freeze(model: nn.Module, patterns: Iterable[str] | str) -> list[str]:
    """Set ``requires_grad=False`` on every parameter matched by ``patterns`` (globs, or one
    comma-separated string); returns the sorted names of the frozen parameters, each tied name
    included. Every pattern is checked before anything is frozen, so an error changes nothing."""
    if isinstance(patterns, str):
        patterns = parse_patterns(patterns)
    patterns = list(patterns)
    for pattern in patterns:
        if not _matches_anything(model, pattern):
            raise no_match_error("freeze", pattern, module_names(model))
    frozen: dict[int, nn.Parameter] = {}              # id -> parameter: a tied one counts once
    for pattern in patterns:
        for p in _params_under(model, pattern):
            frozen[id(p)] = p
    for p in frozen.values():
        p.requires_grad_(False)
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in frozen)
