"""Sequence parallelism's own constraints (``--sp``), checked before launch; pure. It cuts the
sequence over the tp ranks (parallel/sequence.py), so it needs tp > 1 and a sequence length
that tp divides; it does not run under a pipeline or with LoRA adapters. Dropout runs, on a
random stream per tp rank (parallel/sequence.py, "Dropout")."""
from __future__ import annotations

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL


def reads(cfg: Config) -> dict[str, bool]:
    """--sp is read by the composed layouts (tp > 1 is checked below, with its own fix)."""
    return {"sequence_parallel": cfg.parallel.strategy in DATA_MODEL}


def check(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    if not p.sequence_parallel:
        return
    if p.tp < 2:
        raise ConfigError("parallel.sequence_parallel", True, f"cuts the sequence over the tp "
                          f"ranks, and tp = {p.tp}", "add --tp 2 (or more), or drop --sp")
    if m.block_size % p.tp:
        raise ConfigError("model.block_size", m.block_size, f"--sp cuts the sequence over "
                          f"tp = {p.tp} ranks, which do not divide it", f"a --block-size "
                          f"divisible by {p.tp}, or drop --sp")
    if p.pp > 1:
        raise ConfigError("parallel.sequence_parallel", True, "does not run under a pipeline "
                          f"(pp = {p.pp}): stages would pass sequence slices", "drop --sp or --pp")
    if cfg.memory.lora_rank > 0:
        raise ConfigError("parallel.sequence_parallel", True, "does not split LoRA adapters",
                          "drop --sp or --lora-rank")
