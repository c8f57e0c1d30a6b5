"""Layouts: the strategy names are presets of (zero stage, tp, pp); any data-parallel stage
composes with tensor parallelism, and stages 0-1 with pipeline parallelism.

    preset   zero stage   tp      pp      what the name fixes
    ddp      0            1       1       stage, tp, pp
    zero1-3  1-3          1       1       stage, tp, pp
    tp       any (0)      free    1       pp
    pp       any (0)      1       free    tp
    3d       any (0)      free    free    nothing

``--zero-stage`` (``parallel.zero_stage``) sets the stage explicitly; without ``--strategy`` the
axis flags and the stage alone say what runs (``--dp 2 --tp 2 --zero-stage 3``: ZeRO-3 over dp x
tensor parallel over tp). A preset named explicitly (``--strategy``, or ``strategy`` in a
config file) and an axis flag or stage that contradicts it are refused with one line; so are
ZeRO-2 and ZeRO-3 with a pipeline (the gradients of one stage's weights arrive over many
micro-batches interleaved with other micro-batches' forwards; DeepSpeed refuses the same
combination), and ``zero1_over_dp`` together with a different ``zero_stage``.

:func:`resolve` returns the config with a concrete stage and a canonical strategy name (what the
run directory and summary show): ``ddp`` / ``zeroN`` for pure data parallelism, the preset's own
name otherwise (``3d`` for a composition typed without ``--strategy``).

:func:`reads` says which layout-specific settings a resolved layout reads, so that
validate.check_ignored refuses a non-default value the layout would silently ignore.
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.config import Config, ConfigError

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
_FLAGS = {"zero_stage": "--zero-stage", "tp": "--tp", "pp": "--pp"}


def zero_stage(cfg: Config) -> int:
    """The data-parallel stage a config asks for (0 for layouts without one)."""
    p = cfg.parallel
    if p.zero_stage >= 0:
        return p.zero_stage
    if p.strategy in PRESETS:
        return PRESETS[p.strategy].get("zero_stage", 1 if p.zero1_over_dp else 0)
    return 0


def resolve(cfg: Config, explicit_strategy: bool | None = None) -> Config:
    """Check the strategy preset against the axis flags and stage; return the config with
    ``zero_stage`` set and the strategy named canonically. ``explicit_strategy``: the person
    named the strategy (the CLI knows); None = only when it is not the default ``ddp``."""
    p = cfg.parallel
    if p.strategy not in DATA_MODEL:
        return cfg            # single, dp, ps, auto: reads() says they ignore zero_stage
    if not -1 <= p.zero_stage <= 3:
        raise ConfigError("parallel.zero_stage", p.zero_stage, "not a ZeRO stage",
                          "use 0 (DDP), 1, 2 or 3")
    if explicit_strategy is None:
        explicit_strategy = p.strategy != "ddp"
    if p.zero1_over_dp and p.zero_stage not in (-1, 1):
        raise ConfigError("parallel.zero1_over_dp", True, f"contradicts --zero-stage {p.zero_stage}",
                          "drop --zero1-over-dp (it means --zero-stage 1)")
    if p.zero1_over_dp and p.strategy in ("ddp", "zero2", "zero3"):
        raise ConfigError("parallel.zero1_over_dp", True, f"contradicts strategy {p.strategy}",
                          "use --zero-stage 1 (or --strategy zero1)")
    preset = PRESETS[p.strategy] if explicit_strategy else {}
    for name, fixed in preset.items():
        value = getattr(p, name)
        if name == "zero_stage" and value == -1:
            continue
        if value != fixed:
            raise ConfigError(f"parallel.{name}", value, f"strategy {p.strategy} means "
                              f"{_FLAGS[name]} {fixed}", f"drop --strategy (the axis flags and "
                              f"--zero-stage compose alone), or drop {_FLAGS[name]}")
    stage = zero_stage(cfg)
    if p.pp > 1 and stage >= 2:
        raise ConfigError("parallel.zero_stage", stage, "ZeRO-2 / ZeRO-3 do not combine with "
                          "pipeline parallelism (each stage's gradients arrive over many "
                          "interleaved micro-batches)", "use --zero-stage 0 or 1 with --pp, or "
                          "drop --pp")
    name = p.strategy
    if not explicit_strategy:
        if p.tp == 1 and p.pp == 1:
            name = "ddp" if stage == 0 else f"zero{stage}"
        else:
            name = "3d"
    return replace(cfg, parallel=replace(p, strategy=name, zero_stage=stage))


def reads(cfg: Config) -> dict[str, bool]:
    """For a resolved config: whether its layout reads each layout-specific setting."""
    p, s = cfg.parallel, cfg.parallel.strategy
    composed = s in DATA_MODEL
    stage = zero_stage(cfg)
    flat_dp = composed and p.pp == 1          # the data-parallel component (parallel/data/)
    return {
        "offload": flat_dp and stage >= 1,
        "offload_dir": flat_dp and stage >= 1 and cfg.memory.offload == "disk",
        "bucket_mb": composed and stage <= 2 and (p.pp == 1 or stage == 0),
        "overlap": composed and (p.pp == 1 or stage == 0),
        "allreduce": composed, "find_unused": flat_dp and stage == 0,
        "grad_compression": composed and stage == 0, "zero3_units": flat_dp and stage == 3,
        "zero_stage": composed, "zero1_over_dp": composed and p.pp > 1, "replicas": s == "dp",
        "num_ps": s == "ps", "num_workers": s == "ps", "ps_mode": s == "ps",
        "staleness": s == "ps", "straggler": s == "ps", "on_worker_failure": s == "ps",
        "ps_timeout": s == "ps",
        "num_microbatches": p.pp > 1, "schedule": p.pp > 1, "stage_layers": p.pp > 1,
    }


# what to change so that a refused setting is read (validate.check_ignored's fix)
WHERE_READ = {
    "offload": "--zero-stage 1, 2 or 3 (without --pp)", "offload_dir": "--offload disk",
    "bucket_mb": "--zero-stage 0, or 1-2 without --pp",
    "overlap": "--zero-stage 0, or any stage without --pp",
    "allreduce": "ddp, zeroN, tp, pp or 3d", "find_unused": "--zero-stage 0 (without --pp)",
    "grad_compression": "--zero-stage 0",
    "zero3_units": "--zero-stage 3 (without --pp)", "zero_stage": "ddp, zeroN, tp, pp or 3d",
    "zero1_over_dp": "--pp 2 or more (else --zero-stage 1)", "replicas": "--strategy dp",
    "num_microbatches": "--pp 2 or more", "schedule": "--pp 2 or more",
    "stage_layers": "--pp 2 or more",
}


def describe(cfg: Config) -> str:
    """One line: what a resolved layout runs."""
    p = cfg.parallel
    if p.strategy not in DATA_MODEL:
        return p.strategy
    stage = zero_stage(cfg)
    dp = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"][stage]
    parts = [f"{dp} over dp"]
    if p.tp > 1:
        parts.append(f"tensor parallel over tp={p.tp}")
    if p.pp > 1:
        parts.append(f"pipeline over pp={p.pp} ({p.schedule})")
    return " x ".join(parts)
