"""The data-parallel component's own settings, checked before launch (``reads``, ``check``);
pure, so the launcher runs it before any process starts. Which stage reads what:

    bucket_mb          stages 0-2 (stage 3 groups by units)
    overlap            every stage
    allreduce          every stage (native or ring reducer); shm only stage 0 (its allreduce)
    find_unused        stage 0 without a pipeline (a pipeline needs every stage parameter)
    grad_compression   stage 0
    zero3_units        stage 3
    offload            stages 1-3; offload_dir with offload = disk
    offload_params     stage 3 with offload cpu or disk
    zero1_over_dp      a pipeline's old name for --zero-stage 1
    dp_shard,          stages 1-3 (HSDP: shard inside groups of dp_shard ranks, all-reduce the
    dp_replicate       gradient shards across the dp_replicate groups)

The component is the same with or without a pipeline (parallel/compose.py), so it reads the
same settings; only ``find_unused`` differs.
"""
from __future__ import annotations

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL as COMPOSED


def reads(cfg: Config, stage: int) -> dict[str, bool]:
    p = cfg.parallel
    composed = p.strategy in COMPOSED
    return {
        "zero_stage": composed,
        "allreduce": composed and (p.allreduce != "shm" or stage == 0),   # shm: all-reduce only
        "bucket_mb": composed and stage <= 2, "overlap": composed,
        "find_unused": composed and p.pp == 1 and stage == 0,
        "grad_compression": composed and stage == 0,
        "zero3_units": composed and stage == 3, "offload": composed and stage >= 1,
        "offload_dir": composed and stage >= 1 and cfg.memory.offload == "disk",
        "offload_params": composed and stage == 3 and cfg.memory.offload != "none",
        "zero1_over_dp": composed and p.pp > 1,
        "dp_shard": composed and stage >= 1, "dp_replicate": composed and stage >= 1,
    }


def hsdp(cfg: Config, dp: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the dp axis: (1, dp) without HSDP. Raises ConfigError when
    the given sizes do not multiply to ``dp``."""
    p = cfg.parallel
    for name in ("dp_shard", "dp_replicate"):
        if getattr(p, name) < 0:
            raise ConfigError(f"parallel.{name}", getattr(p, name), "is negative",
                              "give a positive size, or 0 (not HSDP)")
    if not p.dp_shard and not p.dp_replicate:
        return 1, dp
    shard = p.dp_shard or (dp // p.dp_replicate if dp % p.dp_replicate == 0 else 0)
    replicate = p.dp_replicate or (dp // p.dp_shard if dp % p.dp_shard == 0 else 0)
    if shard * replicate != dp:
        field = "dp_replicate" if p.dp_replicate else "dp_shard"
        raise ConfigError(f"parallel.{field}", getattr(p, field),
                          f"--dp-replicate {p.dp_replicate or '?'} x --dp-shard "
                          f"{p.dp_shard or '?'} does not make the dp size {dp}",
                          f"give sizes whose product is {dp} (e.g. --dp-replicate 2 --dp-shard "
                          f"{max(1, dp // 2)})")
    return replicate, shard


def check(cfg: Config, world_size: int, stage: int, dp: int | None = None) -> None:
    """Class names for ZeRO-3's units must be identifiers; HSDP's sizes make the dp size;
    parameters are offloaded only by ZeRO-3 and only to a place ``offload`` names."""
    check_offload_params(cfg, stage)
    if dp is not None and stage >= 1:
        hsdp(cfg, dp)
    names = [c.strip() for c in cfg.parallel.zero3_units.split(",") if c.strip()]
    bad = [c for c in names if not c.isidentifier()]
    if stage == 3 and bad:
        raise ConfigError("parallel.zero3_units", cfg.parallel.zero3_units,
                          f"{bad[0]!r} is not a class name", "give module class names, e.g. "
                          "'Block' or 'GPT2Block,LlamaDecoderLayer'")


def check_offload_params(cfg: Config, stage: int) -> None:
    """``offload_params`` needs ZeRO-3 (the only stage whose parameters are shards) and an
    ``offload`` place to move them to (the place of the masters and optimizer states)."""
    m = cfg.memory
    if not m.offload_params:
        return
    composed = cfg.parallel.strategy in COMPOSED
    if composed and stage == 3 and m.offload != "none":
        return
    what = (f"the run is {['DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][stage]}" if composed else
            f"the run is {cfg.parallel.strategy}")
    why = ("there is no --offload place to move them to" if composed and stage == 3 else
           f"only ZeRO-3 keeps parameters as shards to offload ({what})")
    raise ConfigError("memory.offload_params", True, why, "use --zero-stage 3 (or --strategy "
                      "zero3) with --offload cpu or disk, or drop --offload-params")


class UnusedParameters(ConfigError, RuntimeError):
    """Trainable parameters that got no gradient in a step, under a data-parallel stage that
    needs every one (one line: the parameters, the setting that handles them). A ConfigError
    (``shardwise train`` prints it as one line, exit 2) and a RuntimeError (what a user's
    loop catches around ``engine.step()``)."""

    def __init__(self, layout: str, names: list[str], field: str, value, why: str, fix: str):
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        super().__init__(field, value, f"{layout}: {len(names)} trainable parameter(s) got no "
                         f"gradient in this step ({shown or 'unknown'}); {why}", fix)


def unused_fix(stage: int, dp: int, pp: int) -> str:
    """What handles parameters without a gradient under this layout."""
    drop = "use them in forward, or freeze them (requires_grad_(False)) before prepare"
    if pp > 1:
        return f"{drop} (a pipeline needs every stage parameter used)"
    if stage == 0:
        return f"pass --find-unused (ParallelConfig(find_unused=True)), or {drop}"
    return f"{drop}, or train with --zero-stage 0 --find-unused (DDP)"
