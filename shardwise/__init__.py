"""shardwise: every distributed-training strategy behind one API, proven equal to plain
training, and measured.

The top-level names are imported lazily, so that ``shardwise.planner`` (pure Python) and the
CLI's error paths load without importing torch.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "prepare": "shardwise.run.api", "Engine": "shardwise.run.api", "optimizer_factory": "shardwise.run.api",
    "Config": "shardwise.config", "ConfigError": "shardwise.config", "Mesh": "shardwise.mesh",
    "Runtime": "shardwise.run.runtime", "init_runtime": "shardwise.run.runtime",
    "register_plan": "shardwise.models.plans", "ModelPlan": "shardwise.models.plans",
    "Split": "shardwise.models.plans",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
