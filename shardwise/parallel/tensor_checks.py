"""Tensor parallelism's own constraints, checked before launch; pure. It splits the GPT's heads
and vocabulary, so tp must divide the heads, and models without transformer blocks cannot use
it (pipeline parallelism cuts the same blocks)."""
from __future__ import annotations

from shardwise.config import Config, ConfigError


def reads(cfg: Config) -> dict[str, bool]:
    return {}          # tp is an axis size, read by every layout that composes it


def check(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    if m.name == "gpt" and m.n_head % p.tp:
        raise ConfigError("parallel.tp", p.tp, f"does not divide n_head={m.n_head}",
                          "pick a tp that divides the number of heads")
    if m.name == "lenet" and (p.tp > 1 or p.pp > 1):
        name = "parallel.tp" if p.tp > 1 else "parallel.pp"
        raise ConfigError(name, max(p.tp, p.pp), "tensor and pipeline parallelism split the "
                          "GPT's transformer blocks; LeNet has none",
                          "use --dp with --zero-stage 0-3 for LeNet, or train the GPT")
