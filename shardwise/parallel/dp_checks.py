"""Single-process DP's own setting (``replicas``), checked before launch; pure."""
from __future__ import annotations

from shardwise.config import Config, ConfigError


def reads(cfg: Config) -> dict[str, bool]:
    return {"replicas": cfg.parallel.strategy == "dp"}


def check(cfg: Config, world_size: int) -> None:
    if cfg.parallel.strategy == "dp" and cfg.train.batch_size % cfg.parallel.replicas:
        raise ConfigError("train.batch_size", cfg.train.batch_size,
                          f"not divisible by replicas={cfg.parallel.replicas}",
                          "use a multiple of the replica count")
