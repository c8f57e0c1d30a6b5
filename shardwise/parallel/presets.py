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


SPLITS = {"tp": ("tp", "3d"), "pp": ("pp",)}   # the presets that ask for an axis by name


def runs_alone(cfg: Config) -> bool:
    """Whether the run is one process (no distributed world): single, or one process's
    replicas."""
    return cfg.parallel.strategy in SINGLE_PROCESS


def _splits(cfg: Config, axis: str) -> bool:
    """Whether the run splits the model along ``axis`` (tp or pp): a size above 1, or a
    preset named for it (its size then comes from the world)."""
    p = cfg.parallel
    return getattr(p, axis) > 1 or p.strategy in SPLITS[axis]


def tensor_parallel(cfg: Config) -> bool:
    """Whether the run splits layers over tp (:func:`_splits`)."""
    return _splits(cfg, "tp")


def pipelined(cfg: Config) -> bool:
    """Whether the run cuts the model into pipeline stages (:func:`_splits`)."""
    return _splits(cfg, "pp")


def process_shards(cfg: Config, world_size: int) -> int | None:
    """How many shards of the batch the layouts of their own take (one process: 1; its
    replicas: their count; the parameter server: its workers); None for the mesh's layouts,
    whose dp size the world resolves (:func:`resolve_dp`)."""
    p = cfg.parallel
    if p.strategy in ("single", "auto"):
        return 1
    if p.strategy == "dp":
        return p.replicas
    if has_roles(cfg):
        return p.num_workers or world_size - p.num_ps
    return None


def forward_is_the_models(cfg: Config) -> bool:
    """Whether the strategy's forward is one whole forward of the model (not replicas on
    threads, not a parameter server's workers, not a pipeline's stages)."""
    return cfg.parallel.pp == 1 and cfg.parallel.strategy not in ("dp", *ROLES)


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
