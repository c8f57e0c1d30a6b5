"""The pipeline's own settings, checked before launch: which ones a layout reads (``reads``) and
whether their values can run (``check``). Pure: imports only the config, so the launcher runs it
before any process starts (shardwise/validate.py collects every component's checks).
"""
from __future__ import annotations

from shardwise.config import Config, ConfigError

FIELDS = ("num_microbatches", "schedule", "stage_layers")


def reads(cfg: Config) -> dict[str, bool]:
    """A pipeline (pp > 1) reads its micro-batches, schedule and stage split."""
    return dict.fromkeys(FIELDS, cfg.parallel.pp > 1)


def parse_stage_layers(text: str, n_layer: int, p: int) -> list[int]:
    """'1,3' -> [1, 3]: blocks per pipeline stage, p positive counts summing to n_layer."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise ConfigError("parallel.stage_layers", text, "not a comma-separated list of integers",
                          "give blocks per stage, e.g. '1,3'") from None
    if len(counts) != p or sum(counts) != n_layer or min(counts) < 1:
        raise ConfigError("parallel.stage_layers", text, f"need {p} positive counts summing to "
                          f"n_layer = {n_layer}", "give one count per stage, or leave it empty")
    return counts


def check(cfg: Config, world_size: int, dp: int) -> None:
    """pp <= n_layer, a readable stage split, micro-batches that divide each rank's rows."""
    p, m = cfg.parallel, cfg.model
    if p.pp == 1:
        return
    if m.n_layer < p.pp:
        raise ConfigError("parallel.pp", p.pp, f"more stages than n_layer={m.n_layer}",
                          "use pp <= n_layer")
    if p.stage_layers:
        parse_stage_layers(p.stage_layers, m.n_layer, p.pp)
    per_rank = cfg.train.batch_size // (dp * cfg.memory.grad_accum)
    if per_rank and per_rank % p.num_microbatches:
        raise ConfigError("parallel.num_microbatches", p.num_microbatches,
                          f"does not divide the per-rank batch {per_rank}",
                          "pick a divisor of batch_size / (dp x grad_accum)")
