"""``shardwise train --strategy auto``: measure this machine, ask the planner, run its choice.

Calibration lives in :mod:`shardwise.launch.calibrate`. Then :func:`choose` plans the GPT on
``Hardware.custom(...)`` for the local process count and for one process, keeps the fastest
layout that shardwise can run (its strategy is installed and imports, and the resulting config
validates), and converts it into the config: strategy, dp / tp / pp, HSDP's dp_replicate /
dp_shard, sequence_parallel (where this installation has it), cp and cp_impl (context
parallelism, which the planner tries for long sequences), schedule, num_microbatches (or
grad_accum), offload, offload_params, activation_checkpointing, and the model's init (the
planner's start-up peak reads it).

What the person fixed is kept: a ``--dp``, ``--tp``, ``--pp``, ``--grad-accum``, ``--offload`` or
``--activation-checkpointing`` given on the command line or in the config file (``FIXABLE``) rules
out every layout that would change it; the choice is the fastest of the rest, said in one line
("keeping what you set: ..."), and when none is left the run is refused with one line naming
those settings.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.launch.calibrate import (Calibration, Compute, batch_of, calibrate,  # noqa: F401
                                 measure_compute, model_spec, processes)
from shardwise.config import Config, ConfigError, flag_of, section_fields
from shardwise.config.names import Strategy
from shardwise.planner import Estimate, Layout, Ranking, PlanError, plan
from shardwise.planner.units import fmt_bytes, fmt_seconds


def to_config(layout: Layout, cfg: Config) -> tuple[Config, dict]:
    """``cfg`` set up to run ``layout``, and the {section.field: value} it changed.

    Micro-batches: a pipeline runs ``num_microbatches`` of them per step; any other layout
    runs them one after another as ``grad_accum`` micro-steps.
    """
    share = cfg.train.batch_size // layout.dp
    m = max(1, share // layout.micro_batch)
    par = dict(strategy=layout.kind, dp=layout.dp, tp=layout.tp, pp=layout.pp,
               nproc_per_node=layout.world if layout.world > 1 else 0)
    mem = {"offload": layout.offload, "activation_checkpointing": layout.act_ckpt,
           "grad_accum": 1 if layout.pp > 1 else m,
           "offload_params": layout.offload_params != "none"}
    # HSDP's split, or 0 / 0 (shard over all of dp) so a split left in the config cannot stay
    par.update(dp_replicate=layout.dp_replicate if layout.hsdp else 0,
               dp_shard=layout.dp_shard if layout.hsdp else 0)
    if hasattr(cfg.parallel, "sequence_parallel"):
        par["sequence_parallel"] = layout.sequence_parallel
    if hasattr(cfg.parallel, "cp"):      # cp_impl is read only with cp > 1
        par.update(cp=layout.cp, **({"cp_impl": layout.cp_impl} if layout.cp > 1 else {}))
    if layout.kind in (Strategy.SINGLE, Strategy.PS):
        par.update(dp=0)
    if layout.kind == Strategy.PS:
        par.update(num_ps=layout.num_ps, num_workers=layout.dp)
    if layout.pp > 1:
        par.update(schedule=layout.schedule, num_microbatches=m,
                   virtual_stages=layout.virtual_stages)
    if layout.kind == Strategy.THREE_D:
        par["zero1_over_dp"] = layout.zero == 1
    new = replace(cfg, parallel=replace(cfg.parallel, **par), memory=replace(cfg.memory, **mem))
    changes = {f"parallel.{k}": v for k, v in par.items()}
    changes.update({f"memory.{k}": v for k, v in mem.items()})
    return new, changes


def flags(changes: dict) -> list[str]:
    """Command-line flags that apply ``changes`` (appended to argv: later flags win)."""
    by_name = {f"{sec}.{f.name}": f for sec, f in section_fields()}
    out = []
    for key, value in changes.items():
        flag = flag_of(by_name[key])
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def why_not_runnable(layout: Layout, cfg: Config) -> str:
    """Empty when shardwise can run ``layout`` for ``cfg``, else the reason."""
    from shardwise.parallel import available, strategy_class
    from shardwise.run.validate import validate
    kind = layout.kind
    if kind not in available():
        return f"strategy {kind} is not in this installation"
    try:
        strategy_class(kind)
    except Exception as exc:  # a strategy still landing must not break auto
        return f"strategy {kind} does not import ({type(exc).__name__}: {exc})"
    if layout.sequence_parallel and not hasattr(cfg.parallel, "sequence_parallel"):
        return "sequence parallelism (parallel.sequence_parallel) is not in this installation"
    if layout.offload_params not in ("none", layout.offload):
        return ("shardwise train offloads parameters only to where the optimizer goes "
                "(--offload-params)")
    if (cfg.train.batch_size // layout.dp) % layout.micro_batch:
        return "its micro-batch does not divide a replica's batch"
    try:
        validate(to_config(layout, cfg)[0], layout.world)
    except ConfigError as exc:
        return str(exc)
    return ""


@dataclass(frozen=True)
class Choice:
    """What ``--strategy auto`` runs, and why."""

    config: Config
    flags: list[str]
    estimate: Estimate
    plan: Ranking
    calibration: Calibration
    alternatives: dict
    """{processes: the best runnable estimate on that many processes (or None)}."""


FIXABLE = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.nproc_per_node",
           "parallel.schedule", "parallel.num_microbatches", "parallel.virtual_stages",
           "parallel.num_ps", "parallel.num_workers", "parallel.zero1_over_dp",
           "parallel.dp_replicate", "parallel.dp_shard", "parallel.sequence_parallel",
           "parallel.cp", "parallel.cp_impl", "memory.grad_accum", "memory.offload",
           "memory.offload_params", "memory.activation_checkpointing")
"""Every setting :func:`to_config` may change: one the person gave rules out the layouts that
would change it."""


def fixed_by_user(cfg: Config, given) -> dict:
    """{section.field: value} of the FIXABLE settings the person gave (``given(section, name)``:
    a flag or a config-file key; shardwise/launch/checks.py's ``given``)."""
    out = {}
    for key in FIXABLE:
        section, name = key.split(".")
        if hasattr(getattr(cfg, section), name) and given(section, name):
            out[key] = getattr(getattr(cfg, section), name)
    return out


def _keeps(layout: Layout, cfg: Config, fixed: dict) -> bool:
    """Whether running ``layout`` leaves every fixed setting as the person gave it."""
    changes = to_config(layout, cfg)[1]
    return all(changes.get(key, value) == value for key, value in fixed.items())


def _best_runnable(p: Ranking, cfg: Config, fixed: dict | None = None,
                   honours=None, refused: list | None = None) -> Estimate | None:
    """The fastest layout that keeps ``fixed``, runs here and (``honours``) reads every other
    setting the person gave; what ``honours`` said against a layout goes to ``refused``."""
    for e in p.ranked:
        if not _keeps(e.layout, cfg, fixed or {}) or why_not_runnable(e.layout, cfg):
            continue
        why = honours(*to_config(e.layout, cfg)[:1], e.layout.world) if honours else ""
        if not why:
            return e
        if refused is not None:
            refused.append(why)
    return None


def choose(cfg: Config, calibration: Calibration | None = None, say=print,
           fixed: dict | None = None, honours=None) -> Choice:
    """Calibrate (unless given), plan on the local process count and on one process, and
    return the fastest layout shardwise can run, converted into ``cfg``, among those that keep
    ``fixed`` ({section.field: value}: what the person set; module docstring) and that
    ``honours(config, world)`` accepts ("" or why not: a setting the layout would not read)."""
    fixed, refused = fixed or {}, []
    spec, batch = model_spec(cfg), batch_of(cfg)
    cal = calibration or calibrate(cfg)
    say("auto: " + cal.describe().replace("\n", "\nauto: "))
    if fixed:
        say("auto: keeping what you set: " + " ".join(flags(fixed)))
    found: dict[int, tuple[Ranking, Estimate | None]] = {}
    for n in sorted({cal.processes, 1}, reverse=True):
        try:
            p = plan(spec, cal.hardware(n), batch)
        except PlanError as exc:
            say(f"auto: no plan on {n} process(es): {exc}")
            continue
        found[n] = (p, _best_runnable(p, cfg, fixed, honours, refused))
    runnable = [(e.step_s, n) for n, (_, e) in found.items() if e is not None]
    if not runnable and refused:
        raise ConfigError("parallel.strategy", "auto", "no layout the planner ranks reads "
                          f"every setting you gave; the fastest would not: {refused[0]}",
                          "drop that setting and let auto choose, or pick a strategy")
    if not runnable and fixed:
        raise ConfigError("parallel.strategy", "auto", "no layout the planner ranks fits, runs "
                          f"here and keeps what you set ({' '.join(flags(fixed))})",
                          "drop some of those flags and let auto choose them, or pick a strategy")
    if not runnable:
        raise ConfigError("parallel.strategy", "auto", "no layout the planner ranks fits and "
                          "runs here", "pick a strategy, or a smaller model or batch")
    n = min(runnable)[1]
    chosen_plan, best = found[n]
    say("auto: planner on {} process(es): {}".format(n, chosen_plan.explanation.replace(
        "\n", " ")))
    for other, (_, e) in found.items():
        if other != n and e is not None:
            say(f"auto: best on {other} process(es): {e.layout.describe()}, "
                f"{fmt_seconds(e.step_s)} per step (slower)")
    new, changes = to_config(best.layout, cfg)
    args = flags(changes)
    say(f"auto: running {best.layout.describe()}: estimated {fmt_seconds(best.step_s)} per step, "
        f"{best.tokens_per_s:,.0f} tokens/s, {fmt_bytes(best.memory_total)} per rank; "
        f"flags: {' '.join(args)}")
    return Choice(new, args, best, chosen_plan, cal,
                  {k: e for k, (_, e) in found.items()})
