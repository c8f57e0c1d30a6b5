"""The pipeline's own settings, checked before launch: which ones a layout reads (``reads``) and
whether their values can run (``check``). Pure: imports only the config, so the launcher runs it
before any process starts (shardwise/run/validate.py collects every component's checks).
"""
from __future__ import annotations

from shardwise.config import Config, ConfigError

FIELDS = ("num_microbatches", "schedule", "stage_layers", "pp_transport")
# what to change so that a refused setting is read (validate.check_ignored's fix)
WHERE_READ = {"virtual_stages": "--pp 2 or more with --schedule interleaved-1f1b"}


def virtual_stages(cfg: Config) -> int:
    """Model chunks per pipeline rank: virtual_stages under interleaved-1f1b, else 1."""
    p = cfg.parallel
    return p.virtual_stages if p.schedule == "interleaved-1f1b" else 1


def reads(cfg: Config) -> dict[str, bool]:
    """A pipeline (pp > 1) reads its micro-batches, schedule and stage split, and under
    interleaved-1f1b its chunks per rank."""
    pp = cfg.parallel.pp > 1
    return {**dict.fromkeys(FIELDS, pp),
            "virtual_stages": pp and cfg.parallel.schedule == "interleaved-1f1b"}


def parse_stage_layers(text: str, n_layer: int, p: int) -> list[int]:
    """'1,3' -> [1, 3]: blocks per pipeline stage, p positive counts summing to n_layer (with
    interleaving p is the number of virtual stages, pp x virtual_stages, in chunk order)."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise ConfigError("parallel.stage_layers", text, "not a comma-separated list of integers",
                          "give blocks per stage, e.g. '1,3'") from None
    if len(counts) != p or sum(counts) != n_layer or min(counts) < 1:
        raise ConfigError("parallel.stage_layers", text, f"need {p} positive counts summing to "
                          f"n_layer = {n_layer}", "give one count per stage, or leave it empty")
    return counts


def _check_schedule(cfg: Config) -> None:
    """interleaved-1f1b: v >= 2 chunks per rank, pp·v <= n_layer, m divisible by pp (Megatron's
    requirement: micro-batches travel in groups of pp)."""
    p, v = cfg.parallel, cfg.parallel.virtual_stages
    if p.schedule != "interleaved-1f1b":
        return
    if v < 2:
        raise ConfigError("parallel.virtual_stages", v, "interleaved-1f1b needs 2 or more chunks "
                          "per rank (1 is plain 1f1b)", "pass --virtual-stages 2")
    if cfg.model.n_layer < p.pp * v:
        raise ConfigError("parallel.virtual_stages", v, f"pp x virtual_stages = {p.pp * v} "
                          f"chunks but n_layer = {cfg.model.n_layer}",
                          "use pp x virtual_stages <= n_layer")
    if p.num_microbatches % p.pp:
        raise ConfigError("parallel.num_microbatches", p.num_microbatches,
                          f"interleaved-1f1b needs a multiple of pp = {p.pp}",
                          f"pass a multiple of pp, e.g. --num-microbatches {p.pp}")


def check(cfg: Config, world_size: int, dp: int) -> None:
    """pp <= n_layer, a readable stage split, micro-batches that divide each rank's rows, the
    schedule's own needs."""
    p, m = cfg.parallel, cfg.model
    if p.pp == 1:
        return
    if m.n_layer < p.pp:
        raise ConfigError("parallel.pp", p.pp, f"more stages than n_layer={m.n_layer}",
                          "use pp <= n_layer")
    _check_schedule(cfg)
    if p.stage_layers:
        parse_stage_layers(p.stage_layers, m.n_layer, p.pp * virtual_stages(cfg))
    per_rank = cfg.train.batch_size // (dp * cfg.memory.grad_accum)
    if per_rank and per_rank % p.num_microbatches:
        raise ConfigError("parallel.num_microbatches", p.num_microbatches,
                          f"does not divide the per-rank batch {per_rank}",
                          "pick a divisor of batch_size / (dp x grad_accum)")
