"""The layout facts every layer may read: which strategy names are presets of (zero stage, tp,
pp), which run as one process, the stage a config asks for, and the dp size a world leaves.
Pure (imports the config only); shardwise/parallel/layout.py resolves and checks a layout with them.
"""
from __future__ import annotations

from shardwise.config import Config, ConfigError

SINGLE_PROCESS = ("single", "dp")   # strategies that run as one process (no distributed world)
ROLES = ("ps",)      # strategies whose ranks take roles (servers, workers), not mesh positions
DATA_MODEL = ("ddp", "zero1", "zero2", "zero3", "tp", "pp", "3d")   # the composed layouts
PRESETS = {
    "ddp": {"zero_stage": 0, "tp": 1, "pp": 1},
    "zero1": {"zero_stage": 1, "tp": 1, "pp": 1},
    "zero2": {"zero_stage": 2, "tp": 1, "pp": 1},
    "zero3": {"zero_stage": 3, "tp": 1, "pp": 1},
    "tp": {"pp": 1},
    "pp": {"tp": 1},
    "3d": {},
}


def has_roles(cfg: Config) -> bool:
    """Whether the run's ranks take roles (the parameter server's servers and workers) instead
    of positions on the mesh's axes: its world is one flat group, its timeouts its own."""
    return cfg.parallel.strategy in ROLES


def zero_stage(cfg: Config) -> int:
    """The data-parallel stage a config asks for (0 for layouts without one)."""
    p = cfg.parallel
    if p.zero_stage >= 0:
        return p.zero_stage
    if p.strategy in PRESETS:
        return PRESETS[p.strategy].get("zero_stage", 1 if p.zero1_over_dp else 0)
    return 0


def resolve_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel size: given, or what the world leaves after tp and pp."""
    p = cfg.parallel
    if has_roles(cfg):
        return 1
    if p.dp:
        return p.dp
    rest = p.tp * p.pp * p.cp
    if world_size % rest:
        raise ConfigError("parallel.tp", p.tp, f"tp x pp x cp = {rest} does not divide the world "
                          f"size {world_size}", "choose sizes whose product divides the process count")
    return world_size // rest
