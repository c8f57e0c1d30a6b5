"""Replica groups' own settings (``--ft-replicas R``, ``--ft-rejoin-nproc N``), checked before
launch; pure.

The launcher (launch/replicas.py) splits a data-parallel world of ``dp`` ranks into R groups of
``dp / R`` ranks, each a torchrun of its own; inside a group's ranks the config is the group's
(:func:`group_config`: dp and the process count divided by R), so the same checks run before
launch (on the whole world) and in every rank (on its group), and agree. A group the launcher
restarted at ``--ft-rejoin-nproc N`` ranks (:func:`resized`) has N processes and keeps its
pieces of the model: the same tp, pp and cp, and dp = N / (tp x pp x cp), so only its
data-parallel size changes (any layout: DDP, ZeRO 1-3, HSDP, offload); its ranks check their own
group's layout, the launcher having checked the whole world with every size a group can have
(:func:`check`).

Data rule (:func:`share`): the global batch of a step is cut into equal slices, one per dp rank
of the live groups, the groups in id order: the group whose members before it hold D dp ranks
between them, and its dp rank d, take slice D + d of the sum of the live groups' dp sizes. So a
group of another size takes a share of the rows in proportion to its dp size, every step still
trains on the whole batch, and no row is skipped or repeated, whichever groups are live and at
whichever sizes. ``--batch-size`` must split into those slices (x ``--grad-accum``, x the
micro-batches under a pipeline) for every combination of sizes the live groups can have
(:func:`live_totals`).
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL, has_roles, zero_stage

ENV_GROUP = "SHARDWISE_FT_GROUP"      # this rank's replica group id (set by launch/replicas.py)
ENV_STORE = "SHARDWISE_FT_STORE"      # host:port of the lighthouse store
# --ft-rejoin-nproc: how many times the launcher restarted this group (its torchrun's own
# TORCHELASTIC_RESTART_COUNT starts at 0 again), and the most it will (launch/replicas.py)
ENV_RESTART = "SHARDWISE_FT_RESTART"
ENV_MAX_RESTARTS = "SHARDWISE_FT_MAX_RESTARTS"


def in_group() -> int | None:
    """The replica group this process is a rank of, or None (no --ft-replicas, or the launcher)."""
    value = os.environ.get(ENV_GROUP, "")
    return int(value) if value.isdigit() else None


def group_restarts() -> int:
    """How many times this replica group was restarted (torchrun's agent's count, or the
    launcher's under --ft-rejoin-nproc); 0 outside a group."""
    if in_group() is None:
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) + \
        int(os.environ.get(ENV_RESTART) or 0)


def resized(cfg: Config) -> bool:
    """In a group's rank: the launcher restarted this group at ``--ft-rejoin-nproc`` ranks."""
    return bool(cfg.parallel.ft_rejoin_nproc) and in_group() is not None and \
        int(os.environ.get(ENV_RESTART) or 0) > 0


def _resized_config(cfg: Config, n: int) -> Config:
    """A group of ``n`` processes: the same tp, pp and cp, dp = n / (tp x pp x cp) when dp
    was given (else left to the world, which gives the same)."""
    p = cfg.parallel
    dp = n // pieces(cfg)
    return replace(cfg, parallel=replace(p, dp=dp if p.dp else 0, nproc_per_node=n))


def pieces(cfg: Config) -> int:
    """The ranks one data-parallel rank spans (tp x pp x cp): the model's pieces, which a
    group restarted at another size keeps."""
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def group_config(cfg: Config) -> Config:
    """In a replica group's rank: the config of the group (dp and the process count / R, or
    the ``--ft-rejoin-nproc`` size after a restart by the launcher; with that flag under DDP,
    ``find_unused`` on in every group); elsewhere the config unchanged."""
    r = cfg.parallel.ft_replicas
    if r < 2 or in_group() is None:
        return cfg
    p = cfg.parallel
    ranks = int(os.environ.get("WORLD_SIZE") or 0)      # this group's, from its torchrun
    if p.ft_rejoin_nproc and zero_stage(cfg) == 0 and p.pp == 1 and \
            ranks > p.tp * p.cp:
        # DDP's used flags travel over the lane with the gradients: every group sends them
        # (a one-rank group has them on by itself), so they line up whatever the sizes
        cfg = replace(cfg, parallel=replace(p, find_unused=True))
    if resized(cfg):
        return _resized_config(cfg, p.ft_rejoin_nproc)
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
    group's torchrun after it; with ``--ft-rejoin-nproc N`` also on a group of N ranks."""
    group, size = as_group(cfg, world)
    if size == world:
        return
    plain = lambda c: replace(c, parallel=replace(c.parallel, ft_replicas=0,  # noqa: E731
                                                  ft_rejoin_nproc=0))
    try:        # --ft-replicas itself was checked on the whole world (check)
        checks(plain(group), size)
    except ConfigError as exc:
        raise ConfigError(exc.field_name, exc.value, f"in each of the {cfg.parallel.ft_replicas} "
                          f"replica groups ({size} rank(s) each): {exc.why}",
                          exc.fix) from None
    n = cfg.parallel.ft_rejoin_nproc
    if n <= 0 or n == size:
        return
    try:
        checks(plain(_resized_config(cfg, n)), n)
    except ConfigError as exc:
        raise ConfigError(exc.field_name, exc.value, f"in a replica group restarted at {n} "
                          f"rank(s) (--ft-rejoin-nproc): {exc.why}", exc.fix) from None


def share(members: tuple[int, ...], dp_sizes: tuple[int, ...], group: int,
          dp_rank: int) -> tuple[int, int]:
    """(index, count): the slice of the step's global batch that dp rank ``dp_rank`` of
    ``group`` trains on, the live ``members`` (sorted ids) having ``dp_sizes`` dp ranks each
    (module docstring's data rule)."""
    at = members.index(group)
    return sum(dp_sizes[:at]) + dp_rank, sum(dp_sizes)


def live_totals(r: int, group: int, rejoin: int) -> list[int]:
    """Every total dp size the live groups can have: 1 to ``r`` of them, each at its launch
    dp size ``group`` or, once the launcher restarted it, at ``rejoin`` (0: no other size)."""
    sizes = {group, rejoin} if rejoin else {group}
    totals = set()
    for live in range(1, r + 1):
        if len(sizes) == 1:
            totals.add(live * group)
        else:
            totals.update(k * group + (live - k) * rejoin for k in range(live + 1))
    return sorted(totals)


def _refuse(value, why: str, fix: str) -> None:
    raise ConfigError("parallel.ft_replicas", value, why, fix)


def check(cfg: Config, world_size: int, dp: int) -> None:
    """``--ft-replicas`` and ``--ft-rejoin-nproc`` against the layout and the batch (one line
    each, exit 2)."""
    r = cfg.parallel.ft_replicas
    _check_rejoin_flag(cfg)
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
    if resized(cfg):     # the launcher checked the whole world, with this size among the others
        return
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
    ranks = world_size if in_group() is not None else world_size // r
    rejoin = _check_rejoin_size(cfg, ranks, group)
    m = cfg.parallel.num_microbatches if cfg.parallel.pp > 1 else 1   # a pipeline's pieces
    per = cfg.memory.grad_accum * m
    lcm = math.lcm(*live_totals(r, group, rejoin)) * per
    if cfg.train.batch_size % lcm:
        pieces = f" x {m} micro-batches" if m > 1 else ""
        counts = f"{group} rank(s)" if rejoin in (0, group) else \
            f"{group} or {rejoin} (--ft-rejoin-nproc) rank(s) each"
        _refuse(r, f"batch size {cfg.train.batch_size} does not split into equal shares over "
                f"every live count of groups (1 to {r}) x {counts} x grad_accum "
                f"{cfg.memory.grad_accum}{pieces}", f"use a --batch-size that is a multiple "
                f"of {lcm}")


def _rejoin_refuse(n: int, why: str, fix: str) -> None:
    raise ConfigError("parallel.ft_rejoin_nproc", n, why, fix)


def _check_rejoin_flag(cfg: Config) -> None:
    """``--ft-rejoin-nproc`` on its own: a size, under replica groups, with restarts."""
    n = cfg.parallel.ft_rejoin_nproc
    if n == 0:
        return
    if n < 0:
        _rejoin_refuse(n, "is negative", "give the rank count a restarted group comes back "
                       "with (1 or more), or 0 (torchrun restarts a group at its own size)")
    if not cfg.parallel.ft_replicas:
        _rejoin_refuse(n, "restarts a replica group, and there are none", "add --ft-replicas "
                       "R (2 or more), or drop --ft-rejoin-nproc")
    if cfg.train.max_restarts < 1:
        _rejoin_refuse(n, "the launcher restarts a group that lost a rank up to "
                       "--max-restarts times, and --max-restarts is 0", "add --max-restarts N "
                       "(restarts per group), or drop --ft-rejoin-nproc")


def _check_rejoin_size(cfg: Config, ranks: int, group: int) -> int:
    """A rejoin at another size than the groups' ``ranks`` processes (``group`` dp ranks):
    the restarted group keeps its tp x pp x cp pieces of the model and changes its dp size
    only (DDP, or ZeRO stages 1-3, HSDP and offload included): for each piece the dp
    leaders sum whole gradients (ZeRO's shards gathered first, whose flat layout differs
    between sizes only in its end padding) and a joiner loads the piece's state whole over dp
    (docs/checkpoints.md). Returns the dp size a restarted group has (0: no
    --ft-rejoin-nproc)."""
    n = cfg.parallel.ft_rejoin_nproc
    if n == 0 or n == ranks:
        return group if n else 0
    p = cfg.parallel
    keep = f"use --ft-rejoin-nproc {ranks} (a group's own size), or drop it"
    per = pieces(cfg)
    if n % per:
        axes = " x ".join(f"{a} {v}" for a, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp))
                          if v > 1)
        _rejoin_refuse(n, f"a restarted group keeps its pieces of the model ({axes} = {per} "
                       f"ranks per data-parallel rank) and changes only its dp size, and {n} "
                       f"is not a multiple of {per}", f"give a multiple of {per}, or "
                       f"{ranks} (a group's own size)")
    return n // per


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
