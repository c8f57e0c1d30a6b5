"""Strategies, one per file; ``strategy_class(name)`` maps a config name to its class.

Imported lazily so that a run pays only for the strategy it uses, and so that a strategy file
that fails to import does not break the others.
"""
from __future__ import annotations

import importlib
import importlib.util

STRATEGY_CLASSES = {
    "single": "shardwise.parallel.base:Strategy",
    "ddp": "shardwise.parallel.data.ddp:DDPStrategy",
    "dp": "shardwise.parallel.dp:DataParallelStrategy",
    "zero1": "shardwise.parallel.data.zero:Zero1Strategy",
    "zero2": "shardwise.parallel.data.zero:Zero2Strategy",
    "zero3": "shardwise.parallel.data.zero:Zero3Strategy",
    "tp": "shardwise.parallel.hybrid:HybridStrategy",
    "pp": "shardwise.parallel.hybrid:HybridStrategy",
    "3d": "shardwise.parallel.hybrid:HybridStrategy",
    "ps": "shardwise.parallel.ps:ParameterServerStrategy",
}


def available() -> list[str]:
    """Strategy names whose module is present in this installation."""
    out = []
    for name, target in STRATEGY_CLASSES.items():
        module = target.split(":")[0]
        if importlib.util.find_spec(module) is not None:
            out.append(name)
    return out


def strategy_class(name: str):
    """The Strategy subclass for ``name`` (imports its module on first use)."""
    module, cls = STRATEGY_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)
