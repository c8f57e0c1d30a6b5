"""The parameter server's own settings, checked before launch (``reads``, ``check``); pure, so
the launcher runs it before any process starts (shardwise/run/validate.py collects it)."""
from __future__ import annotations

from shardwise.config import Config, ConfigError

FIELDS = ("num_ps", "num_workers", "ps_mode", "staleness", "straggler", "on_worker_failure",
          "ps_timeout")


def reads(cfg: Config) -> dict[str, bool]:
    return dict.fromkeys(FIELDS, cfg.parallel.strategy == "ps")


def parse_straggler(spec: str, num_workers: int) -> dict[int, float]:
    """'1:3,2:1.5' -> {1: 3.0, 2: 1.5}: worker index -> step-time factor (>= 1)."""
    out = {}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        try:
            w, factor = part.split(":")
            w, factor = int(w), float(factor)
        except ValueError:
            raise ConfigError("parallel.straggler", spec, f"cannot read {part!r}",
                              "write WORKER:FACTOR[,WORKER:FACTOR], e.g. '1:3'") from None
        if not 0 <= w < num_workers or factor < 1:
            raise ConfigError("parallel.straggler", spec, f"worker {w} / factor {factor} out of "
                              f"range", f"use workers 0..{num_workers - 1} and factors >= 1")
        out[w] = factor
    return out


def check(cfg: Config, world_size: int) -> None:
    """num_ps + num_workers = the world, a batch that splits over the workers, a positive
    timeout, a readable straggler spec. (fp16 is accepted: ps.py scales the loss.)"""
    p = cfg.parallel
    if p.strategy != "ps":
        return
    workers = p.num_workers or world_size - p.num_ps
    if workers < 1 or p.num_ps + workers != world_size:
        raise ConfigError("parallel.num_workers", p.num_workers,
                          f"num_ps={p.num_ps} + num_workers={workers} != world size {world_size}",
                          "set --nproc-per-node to num_ps + num_workers")
    if cfg.train.batch_size % workers:
        raise ConfigError("train.batch_size", cfg.train.batch_size,
                          f"not divisible by num_workers={workers}", "use a multiple of it")
    if not p.ps_timeout > 0:
        raise ConfigError("parallel.ps_timeout", p.ps_timeout, "must be positive", "try 300")
    if p.straggler:
        parse_straggler(p.straggler, workers)
