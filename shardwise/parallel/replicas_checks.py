"""Replica groups' own setting (``--ft-replicas R``), checked before launch; pure.

The launcher (launch/replicas.py) splits a data-parallel world of ``dp`` ranks into R groups of
``dp / R`` ranks, each a torchrun of its own; inside a group's ranks the config is the group's
(:func:`group_config`: dp and the process count divided by R), so the same checks run before
launch (on the whole world) and in every rank (on its group), and agree.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL, has_roles, zero_stage

ENV_GROUP = "SHARDWISE_FT_GROUP"      # this rank's replica group id (set by launch/replicas.py)
ENV_STORE = "SHARDWISE_FT_STORE"      # host:port of the lighthouse store


def in_group() -> int | None:
    """The replica group this process is a rank of, or None (no --ft-replicas, or the launcher)."""
    value = os.environ.get(ENV_GROUP, "")
    return int(value) if value.isdigit() else None


def group_config(cfg: Config) -> Config:
    """In a replica group's rank: the config of the group (dp and the process count / R);
    elsewhere the config unchanged."""
    r = cfg.parallel.ft_replicas
    if r < 2 or in_group() is None:
        return cfg
    p = cfg.parallel
    return replace(cfg, parallel=replace(p, dp=p.dp // r, nproc_per_node=p.nproc_per_node // r))


def as_group(cfg: Config, world: int) -> tuple[Config, int]:
    """The config and world of one replica group, in the launcher as in a group's rank (its
    checkpoint checks then see what each group will save and resume: a group's world)."""
    r = cfg.parallel.ft_replicas
    if r < 2 or in_group() is not None:
        return cfg, world
    p = cfg.parallel
    return replace(cfg, parallel=replace(p, dp=p.dp // r, nproc_per_node=p.nproc_per_node // r)), \
        world // r


def check_each_group(cfg: Config, world: int, checks) -> None:
    """In the launcher (``--ft-replicas`` R >= 2): run ``checks(config, world)`` on one
    group's config and world as well, which is what every group's ranks check when they start
    (:func:`group_config`), so a setting only a group refuses (``--bucket-mb`` with one-rank
    groups, whose dp is 1) stops before launch with one line naming the groups, not in every
    group's torchrun after it."""
    group, size = as_group(cfg, world)
    if size == world:
        return
    try:        # --ft-replicas itself was checked on the whole world (check)
        checks(replace(group, parallel=replace(group.parallel, ft_replicas=0)), size)
    except ConfigError as exc:
        raise ConfigError(exc.field_name, exc.value, f"in each of the {cfg.parallel.ft_replicas} "
                          f"replica groups ({size} rank(s) each): {exc.why}",
                          exc.fix) from None


def _refuse(value, why: str, fix: str) -> None:
    raise ConfigError("parallel.ft_replicas", value, why, fix)


def check(cfg: Config, world_size: int, dp: int) -> None:
    """``--ft-replicas`` against the layout and the batch (one line each, exit 2)."""
    r = cfg.parallel.ft_replicas
    if r == 0:
        return
    if r < 2:
        _refuse(r, "one replica group cannot survive the loss of its own ranks",
                "give 2 or more groups, or 0 (off)")
    if has_roles(cfg):
        _refuse(r, "the parameter server handles a lost worker itself", "drop --ft-replicas "
                "(see --on-worker-failure), or use --strategy ddp")
    if cfg.parallel.strategy not in DATA_MODEL:
        _refuse(r, f"strategy {cfg.parallel.strategy} runs as one process", "use --strategy ddp")
    whole = dp * r if in_group() is not None else dp
    if whole % r:
        _refuse(r, f"does not divide the data-parallel size {whole}", "give a divisor of the dp "
                "size, or change --nproc-per-node / --dp")
    _not_built(cfg, r)
    group = whole // r
    shard = cfg.parallel.dp_shard
    if shard and group % shard:
        _refuse(r, f"--dp-shard {shard} does not divide a group's data-parallel size {group} "
                f"({whole} / {r} groups)", f"give a divisor of {group}")
    m = cfg.parallel.num_microbatches if cfg.parallel.pp > 1 else 1   # a pipeline's pieces
    per = cfg.memory.grad_accum * group * m
    lcm = math.lcm(*range(1, r + 1)) * per
    if cfg.train.batch_size % lcm:
        pieces = f" x {m} micro-batches" if m > 1 else ""
        _refuse(r, f"batch size {cfg.train.batch_size} does not split into equal shares over "
                f"every live count of groups (1 to {r}) x {group} rank(s) x grad_accum "
                f"{cfg.memory.grad_accum}{pieces}", f"use a --batch-size that is a multiple "
                f"of {lcm}")


def _not_built(cfg: Config, r: int) -> None:
    """Layouts inside a group that replica groups do not serve yet (docs/checkpoints.md). DDP
    and ZeRO stages 1-3 over the group's dp ranks are served, with tensor parallelism (--tp),
    a pipeline (--pp), context parallelism (--cp), offload (--offload cpu|disk,
    --offload-params), fp16 and HSDP (--dp-shard: the shard size inside each group) inside the
    group too (parallel/replicas.py)."""
    p = cfg.parallel
    if p.dp_replicate:
        _refuse(r, f"--dp-replicate {p.dp_replicate} under replica groups: the groups are the "
                "outer replicas (each averages its shards with the others' every step)",
                "give --dp-shard S alone (HSDP inside each group: the group's dp ranks form "
                "dp / R / S replicas of S-rank shard groups), or drop --ft-replicas")
