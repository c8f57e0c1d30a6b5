"""Strategies by config name; ``strategy_class(name)`` maps a name to the class that runs it
(the composed names: the class at the top of what compose.parallelize builds: the data-parallel
component, or with pp the pipeline driver; tp's slices are parallel/tensor.py's).

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
    "zero1": "shardwise.parallel.data.zero:ZeroStrategy",       # the stage: from the config
    "zero2": "shardwise.parallel.data.zero:ZeroStrategy",
    "zero3": "shardwise.parallel.data.zero_stage3:Zero3Strategy",
    "tp": "shardwise.parallel.tensor:TensorPlan",
    "pp": "shardwise.parallel.pipeline.driver:PipelineDriver",
    "3d": "shardwise.parallel.pipeline.driver:PipelineDriver",
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
