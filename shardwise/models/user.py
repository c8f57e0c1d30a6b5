"""A person's own model: ``--model package.module:function``.

The module is imported as Python imports it (installed packages, PYTHONPATH), and from the
current directory when it is not found there. The function is called with the run's
ModelConfig when its first parameter has no default (``def build(cfg): ...``, reading
``cfg.n_embd``, ``cfg.vocab_size``...), and with no argument otherwise (``def build(): ...``);
it must return an ``nn.Module``. Its forward takes the batch's inputs (token ids (B, T), or
images) and returns logits, a dict / ModelOutput holding ``logits``, or a tuple whose first
item is the logits; the loss is cross-entropy on them (shardwise/models/__init__.py's
``output_loss``). The same seed gives every rank the same initial weights (the seed is set
before the call).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys


from shardwise.config import ConfigError

SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", re.ASCII)
FIELD = "model.name"


def is_user(name: str) -> bool:
    """A name of the form package.module:function (hf:... names are Hugging Face's)."""
    return ":" in name and not name.startswith("hf:")


def _import(module: str, name: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name) or os.getcwd() in sys.path:
            raise
    sys.path.insert(0, os.getcwd())           # `shardwise` (a console script) does not add it
    return importlib.import_module(module)


def resolve(name: str):
    """The function ``name`` names; ConfigError when it cannot be found or called."""
    if not SPEC.match(name):
        raise ConfigError(FIELD, name, "not of the form package.module:function",
                          "use gpt, lenet, hf:gpt2, hf:llama or e.g. mypkg.models:build")
    module, func = name.split(":")
    try:
        mod = _import(module, name)
    except Exception as exc:      # not found, or the module itself failed: one line either way
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise ConfigError(FIELD, name, f"module {module!r} cannot be imported ({why})",
                          "run from the folder holding it, install it, or add it to "
                          "PYTHONPATH") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ConfigError(FIELD, name, f"{module} has no function {func!r}",
                          f"define {func}(cfg) in {module}, returning an nn.Module")
    _takes_config(fn, name)
    return fn


def _takes_config(fn, name: str) -> bool:
    """True: call fn(model_config); False: call fn(). More required parameters: refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or (required and required[0] not in positional):
        raise ConfigError(FIELD, name, f"the function needs {len(required)} arguments "
                          f"({', '.join(p.name for p in required)})", "take one argument (the "
                          "ModelConfig) or none")
    return bool(required)


def build(m):
    """Call the person's function (with ``m`` when it takes an argument); check the result."""
    import torch.nn as nn
    fn = resolve(m.name)
    model = fn(m) if _takes_config(fn, m.name) else fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(FIELD, m.name, f"returned a {type(model).__name__}, not an nn.Module",
                          "return the model (an nn.Module)")
    return model
