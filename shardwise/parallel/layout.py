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

:func:`reads` gathers, from each component's own checks module, which layout-specific settings
a resolved layout reads, so that validate.check_ignored refuses a non-default value the layout
would silently ignore; :func:`check_components` runs each component's checks of its values.
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL, PRESETS, zero_stage  # noqa: F401 (re-exported)
from shardwise.memory import checks as memory_checks
from shardwise.parallel import (context_checks, dp_checks, ps_checks, replicas_checks,
                                sequence_checks, tensor_checks)
from shardwise.parallel.data import checks as data_checks
from shardwise.parallel.pipeline import checks as pipeline_checks

_FLAGS = {"zero_stage": "--zero-stage", "tp": "--tp", "pp": "--pp"}


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
    name = p.strategy
    if not explicit_strategy:
        if p.tp == 1 and p.pp == 1 and p.cp == 1:
            name = "ddp" if stage == 0 else f"zero{stage}"
        else:
            name = "3d"
    return replace(cfg, parallel=replace(p, strategy=name, zero_stage=stage))


def reads(cfg: Config) -> dict[str, bool]:
    """For a resolved config: whether its layout reads each layout-specific setting, as each
    component declares it."""
    return {**data_checks.reads(cfg, zero_stage(cfg)), **pipeline_checks.reads(cfg),
            **ps_checks.reads(cfg), **dp_checks.reads(cfg), **sequence_checks.reads(cfg),
            **context_checks.reads(cfg)}


def check_components(cfg: Config, world_size: int, dp: int) -> None:
    """Every component's own checks of its own settings (validate.py calls this)."""
    data_checks.check(cfg, world_size, zero_stage(cfg), dp)
    tensor_checks.check(cfg, world_size)
    sequence_checks.check(cfg, world_size)
    context_checks.check(cfg, world_size)
    pipeline_checks.check(cfg, world_size, dp)
    ps_checks.check(cfg, world_size)
    dp_checks.check(cfg, world_size)
    replicas_checks.check(cfg, world_size, dp)
    memory_checks.check(cfg)


def check_model_names(cfg: Config) -> None:
    """``shardwise train``, before any process starts, on the model built on the meta device (no
    memory, no weights): the freeze / LoRA globs against its names, and a person's model's
    meta-init contract under ``--init meta`` (models/init.py: its ``__init__`` needs no real
    tensors, every module has an initialiser), each refused in one line."""
    from shardwise.models import user
    contract = user.is_user(cfg.model.name) and cfg.model.init == "meta"
    if not cfg.memory.freeze and cfg.memory.lora_rank == 0 and not contract:
        return
    from shardwise.models import build_model
    from shardwise.models.init import check_initialisable
    model = build_model(cfg.model, cfg.train.seed, init="meta")
    if contract:
        check_initialisable(model)
    memory_checks.check_names(cfg, model)


# what to change so that a refused setting is read (validate.check_ignored's fix)
WHERE_READ = {
    "offload": "--zero-stage 1, 2 or 3", "offload_dir": "--offload disk",
    "offload_params": "--zero-stage 3 with --offload cpu or disk",
    "bucket_mb": "--zero-stage 0, 1 or 2",
    "dp_shard": "--zero-stage 1, 2 or 3", "dp_replicate": "--zero-stage 1, 2 or 3",
    "overlap": "ddp, zeroN, tp, pp or 3d",
    "allreduce": "ddp, zeroN, tp, pp or 3d (shm: --zero-stage 0, whose all-reduce it serves)", "find_unused": "--zero-stage 0 (without --pp)",
    "grad_compression": "--zero-stage 0",
    "zero3_units": "--zero-stage 3", "zero_stage": "ddp, zeroN, tp, pp or 3d",
    "zero1_over_dp": "--pp 2 or more (else --zero-stage 1)", "replicas": "--strategy dp",
    "num_microbatches": "--pp 2 or more", "schedule": "--pp 2 or more",
    "stage_layers": "--pp 2 or more", "pp_transport": "--pp 2 or more",
    "sequence_parallel": "ddp, zeroN, tp or 3d with --tp 2 or more",
    "cp": "ddp, zeroN, tp or 3d", "cp_impl": "--cp 2 or more",
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
        parts.append(f"tensor parallel over tp={p.tp}"
                     + (" with sequence parallelism" if p.sequence_parallel else ""))
    if p.cp > 1:
        parts.append(f"context parallel over cp={p.cp} ({p.cp_impl})")
    if p.pp > 1:
        parts.append(f"pipeline over pp={p.pp} ({p.schedule})")
    return " x ".join(parts)
