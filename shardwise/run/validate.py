"""Check a Config against itself and the world it will run in, before anything starts.

Here: the cross-cutting checks (choices, finite and positive numbers, model x data, the mesh
and batch sizes, accumulation, devices); where the run writes: shardwise/config/writable.py; the data
settings: shardwise/data/checks.py. Each parallel component checks its own settings (parallel/data/checks.py, parallel/pipeline/checks.py, parallel/ps_checks.py,
parallel/dp_checks.py, parallel/tensor_checks.py), collected by shardwise/parallel/layout.py, which also
says which settings each layout reads (check_ignored below).

Each check raises :class:`~shardwise.config.ConfigError` naming the field, the value and the fix.
The world size is known before launch (nproc_per_node x nnodes, or WORLD_SIZE under a launcher),
so a bad layout never reaches a collective.
"""
from __future__ import annotations

import math
import os
import sys

from shardwise.parallel import layout

from shardwise.config import rundir
from shardwise.config import (Config, ConfigError, MemoryConfig, ModelConfig, ParallelConfig,
                              flag_of, section_fields)

from shardwise.parallel import presets
from shardwise.parallel.presets import SINGLE_PROCESS, resolve_dp  # noqa: F401 (re-exported)
from shardwise.parallel.pipeline import checks as pipeline_checks
from shardwise.models import hf as hf_model
from shardwise.models import user as user_model
from shardwise.config.writable import check_picture, check_writable
from shardwise.data import checks as data_checks


def _choices(cfg: Config) -> None:
    for sec, f in section_fields():
        choices = f.metadata.get("choices")
        value = getattr(getattr(cfg, sec), f.name)
        if sec == "model" and f.name == "name" and isinstance(value, str) and \
                user_model.is_user(value):
            continue          # package.module:function: checked by _model
        if choices and value not in choices:
            also = " or package.module:function" if (sec, f.name) == ("model", "name") else ""
            raise ConfigError(f"{sec}.{f.name}", value, "not a known choice",
                              f"choose one of {', '.join(choices)}{also}")


INT_LIMIT = 2**63          # torch and numpy index with int64: no int setting reaches this
SEED_LIMIT = 2**32         # numpy's generators take seeds in [0, 2**32); torch takes more
TIMEOUT_LIMIT_S = 1e9      # seconds (about 31 years): datetime.timedelta and torch's
                           # millisecond timeouts overflow far above; "never" in practice


def _numbers(cfg: Config) -> None:
    """Every number is usable: no float is nan or infinite (``--weight-decay nan`` would train
    to NaN, ``--collective-timeout inf`` overflows a timedelta), the seed is one every
    generator takes, and no int reaches int64's limit (tensors and indices are int64)."""
    for sec, f in section_fields():
        value = getattr(getattr(cfg, sec), f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{sec}.{f.name}", value, "not a finite number",
                              f"give a number, e.g. {f.default}")
    if not 0 <= cfg.train.seed < SEED_LIMIT:
        raise ConfigError("train.seed", cfg.train.seed, "out of range", "use 0 <= seed < 2**32")
    for sec, f in section_fields():
        value = getattr(getattr(cfg, sec), f.name)
        if type(value) is int and not -INT_LIMIT < value < INT_LIMIT:
            raise ConfigError(f"{sec}.{f.name}", value, "too large (beyond 2**63)",
                              f"give a number of a usable size, e.g. {f.default}")
    for name, value in (("train.collective_timeout", cfg.train.collective_timeout),
                        ("parallel.ps_timeout", cfg.parallel.ps_timeout)):
        if value > TIMEOUT_LIMIT_S:
            raise ConfigError(name, value, f"longer than {TIMEOUT_LIMIT_S:g} seconds (about 31 "
                              "years)", "give seconds, e.g. 300")


def check_ignored(cfg: Config, args=None, world_size: int | None = None) -> None:
    """Refuse a setting the chosen layout would not read (DESIGN.md: never silently dropped);
    which layout reads what: shardwise/parallel/layout.py's ``reads``; other settings that only some
    runs read: :func:`check_unread`.

    Run by ``shardwise train`` on what the person typed or wrote in a config file (``args``:
    the parsed flags, for config.given). (The library's ``prepare()`` does not run it:
    reference runs in tests reuse one config across strategies.)"""
    p = cfg.parallel
    if p.strategy == "auto":
        check_unread(cfg, args, world_size)
        return            # the planner picks the layout; it checks again after choosing
    cfg = layout.resolve(cfg)
    defaults = {"parallel": ParallelConfig(), "memory": MemoryConfig()}
    for name, used in layout.reads(cfg).items():
        sec = "memory" if name in MEMORY_FIELDS else "parallel"
        value = getattr(getattr(cfg, sec), name)
        if not used and value != getattr(defaults[sec], name):
            raise ConfigError(f"{sec}.{name}", value, f"the layout ({layout.describe(cfg)}) "
                              "does not use it", f"drop {_flag(sec, name)}, or use "
                              + {**layout.WHERE_READ, **pipeline_checks.WHERE_READ}.get(
                                  name, "--strategy ps"))
    check_unread(cfg, args, world_size)


MEMORY_FIELDS = {f.name for sec, f in section_fields() if sec == "memory"}


def _flag(sec: str, name: str) -> str:
    """The command-line flag of field ``sec.name`` (``--sp`` for sequence_parallel)."""
    return next(flag_of(f) for s, f in section_fields() if (s, f.name) == (sec, name))
GPT_SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout")


def _set(cfg: Config, args, sec: str, name: str) -> bool:
    """The person set ``sec.name``: a flag or a config-file key (config.given), or (without
    the parsed flags) a value other than the default. A default alone never counts."""
    from shardwise.config import Config as _Config
    if getattr(getattr(cfg, sec), name) != getattr(getattr(_Config(), sec), name):
        return True
    if args is None:
        return False
    from shardwise.config import given
    return given(args, sec, name)


def _unread(cfg: Config, world_size: int | None) -> list[tuple[str, str, str, str]]:
    """(section, field, why it is not read, fix) for settings this run would not read."""
    p, m, t = cfg.parallel, cfg.memory, cfg.train
    out = []
    if m.lora_rank == 0:
        out += [("memory", n, "LoRA is off (lora_rank = 0), so it would be ignored",
                 f"set --lora-rank (e.g. 8) or drop --{n.replace('_', '-')}")
                for n in ("lora_alpha", "lora_targets")]
    if not presets.has_roles(cfg) or p.ps_mode != "ssp":
        out.append(("parallel", "staleness", f"only --ps-mode ssp reads it (the run: "
                    f"{p.strategy}{', ps_mode ' + p.ps_mode if presets.has_roles(cfg) else ''})",
                    "drop --staleness, or use --strategy ps --ps-mode ssp"))
    if not presets.has_roles(cfg) or p.ps_mode != "sync":
        out.append(("parallel", "on_worker_failure", "only the parameter server's sync mode "
                    f"reads it (the run: {p.strategy}"
                    f"{', ps_mode ' + p.ps_mode if presets.has_roles(cfg) else ''})",
                    "drop --on-worker-failure, or use --strategy ps --ps-mode sync"))
    if t.optimizer == "adamw8bit":
        out.append(("train", "optimizer_kernel", "adamw8bit steps with its own block-wise "
                    "kernel (memory/optim8bit.py)", "drop --optimizer-kernel, or use "
                    "--optimizer adamw"))
    if not t.checkpoint_dir:
        out.append(("train", "keep_checkpoints", "no --checkpoint-dir, so nothing is saved",
                    "drop --keep, or add --checkpoint-dir DIR"))
    if cfg.model.name == "lenet":
        out += [("model", n, "LeNet has fixed sizes; only the GPT and HF models read it",
                 f"drop --{n.replace('_', '-')}, or use --model gpt") for n in GPT_SIZES]
    if world_size is not None and p.strategy in layout.DATA_MODEL and p.strategy != "auto":
        dp = resolve_dp(cfg, world_size)
        if dp == 1:
            out += [("parallel", n, "dp = 1: there is no gradient to reduce over "
                     "data-parallel replicas" + (" (with one replica DDP leaves a parameter "
                                                 "without gradient out of the step by itself)"
                                                 if n == "find_unused" else ""),
                     f"drop --{n.replace('_', '-')}, or run more processes (--nproc-per-node) "
                     "so that dp >= 2")
                    for n in ("allreduce", "grad_compression", "bucket_mb", "find_unused")]
    return out


def check_unread(cfg: Config, args=None, world_size: int | None = None) -> None:
    """Refuse, with one line, a setting the person gave that this run would not read (LoRA's
    alpha without a rank, SSP's staleness in sync mode, --keep without a checkpoint folder,
    the GPT's sizes with LeNet, gradient-reduction settings at dp = 1, ...)."""
    for sec, name, why, fix in _unread(cfg, world_size):
        if _set(cfg, args, sec, name):
            raise ConfigError(f"{sec}.{name}", getattr(getattr(cfg, sec), name), why, fix)


def _positive(cfg: Config) -> None:
    must_be_positive = {
        "model.n_layer": cfg.model.n_layer, "model.n_embd": cfg.model.n_embd,
        "model.n_head": cfg.model.n_head, "model.block_size": cfg.model.block_size,
        "model.vocab_size": cfg.model.vocab_size, "train.steps": cfg.train.steps,
        "train.batch_size": cfg.train.batch_size, "train.eval_batches": cfg.train.eval_batches,
        "parallel.tp": cfg.parallel.tp, "parallel.pp": cfg.parallel.pp,
        "parallel.cp": cfg.parallel.cp,
        "parallel.replicas": cfg.parallel.replicas, "parallel.num_ps": cfg.parallel.num_ps,
        "parallel.num_microbatches": cfg.parallel.num_microbatches,
        "memory.grad_accum": cfg.memory.grad_accum, "logging.log_every": cfg.logging.log_every,
        "data.max_bytes": cfg.data.max_bytes,
    }
    for name, value in must_be_positive.items():
        if value <= 0:
            raise ConfigError(name, value, "must be positive", "give a number > 0")
    non_negative = {"train.warmup_steps": cfg.train.warmup_steps,
                    "train.eval_every": cfg.train.eval_every, "parallel.dp": cfg.parallel.dp,
                    "parallel.nproc_per_node": cfg.parallel.nproc_per_node,
                    "parallel.num_workers": cfg.parallel.num_workers,
                    "parallel.staleness": cfg.parallel.staleness,
                    "parallel.bucket_mb": cfg.parallel.bucket_mb,
                    "train.weight_decay": cfg.train.weight_decay,
                    "train.grad_clip": cfg.train.grad_clip,
                    "memory.lora_rank": cfg.memory.lora_rank}
    for name, value in non_negative.items():
        if value < 0:
            raise ConfigError(name, value, "must not be negative", "give a number >= 0")
    if not cfg.train.collective_timeout > 0:
        raise ConfigError("train.collective_timeout", cfg.train.collective_timeout,
                          "must be positive", "give seconds, e.g. 300")
    if not cfg.train.lr > 0:
        raise ConfigError("train.lr", cfg.train.lr, "must be positive", "try 3e-3")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError("model.dropout", cfg.model.dropout, "must be in [0, 1)", "try 0.0")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", cfg.data.val_fraction, "must be in (0, 1)", "try 0.05")
    if cfg.memory.offload_sync != "auto" and cfg.memory.offload != "disk":
        raise ConfigError("memory.offload_sync", cfg.memory.offload_sync, "says when disk "
                          f"offload's writes reach the disk, and this run has offload "
                          f"{cfg.memory.offload}", "add --offload disk, or drop --offload-sync")
    if cfg.train.checkpoint_async and cfg.memory.offload == "disk":
        raise ConfigError("train.checkpoint_async", True, "with --offload disk each rank writes "
                          "its checkpoint straight from its offload files; a background save "
                          "would first copy that state into memory", "drop --checkpoint-async")
    if cfg.train.checkpoint_move_last:
        p = cfg.parallel
        if cfg.memory.offload != "disk" or presets.zero_stage(cfg) == 0 or p.tp > 1 or p.pp > 1:
            raise ConfigError("train.checkpoint_move_last", True, "moves a ZeRO run's disk "
                              "offload files into its last checkpoint, and this run has none "
                              f"(offload {cfg.memory.offload}, strategy {p.strategy}, tp {p.tp},"
                              f" pp {p.pp})", "use it with --strategy zero1/2/3 --offload disk "
                              "and no --tp / --pp, or drop --checkpoint-move-last")


def _model(cfg: Config) -> None:
    m = cfg.model
    if m.name == "gpt" and m.n_embd % m.n_head:
        raise ConfigError("model.n_head", m.n_head, f"does not divide n_embd={m.n_embd}",
                          "pick n_head so that n_embd / n_head is whole")
    if m.name != "lenet" and cfg.data.dataset == "stdlib" and m.vocab_size < 256:
        raise ConfigError("model.vocab_size", m.vocab_size, "the stdlib corpus is byte tokens "
                          "(0-255)", "use --vocab-size 256 or more")
    if m.name == "lenet" and cfg.data.dataset in ("stdlib", "synthetic", "text"):
        raise ConfigError("data.dataset", cfg.data.dataset, "LeNet needs an image data set",
                          "use --dataset digits, mnist or fashion-mnist")
    if m.name in ("gpt",) + tuple(hf_model.FAMILIES) and cfg.data.dataset in (
            "digits", "mnist", "fashion-mnist"):
        raise ConfigError("data.dataset", cfg.data.dataset, f"{m.name} needs a token corpus",
                          "use --model lenet for images, or --dataset stdlib or text")
    if m.name == "lenet" and cfg.memory.activation_checkpointing:
        raise ConfigError("memory.activation_checkpointing", True, "LeNet has no transformer blocks",
                          "drop --activation-checkpointing, or train the GPT")
    if m.name == "lenet" and cfg.memory.compile:
        raise ConfigError("memory.compile", True, "--compile compiles transformer blocks and "
                          "LeNet has none", "drop --compile, or train the GPT")
    _foreign_model(cfg)


def _foreign_model(cfg: Config) -> None:
    """Hugging Face and a person's own models (shardwise/models/hf.py, user.py): their own
    checks, the settings only they read, and the layouts they cannot run: pipeline and the
    planner for every one; tensor parallelism and activation checkpointing for a person's
    model whose module registered no plan (shardwise/models/plans.py)."""
    m = cfg.model
    if hf_model.is_hf(m.name):
        hf_model.check(cfg)
    elif user_model.is_user(m.name):
        user_model.resolve(m.name)
    for name in ("hf_config", "hf_weights"):
        if getattr(m, name) and not hf_model.is_hf(m.name):
            raise ConfigError(f"model.{name}", getattr(m, name), f"only hf:gpt2 / hf:llama read "
                              f"it (the model is {m.name})", f"drop --{name.replace('_', '-')}, "
                              "or use --model hf:gpt2 or hf:llama")
    if m.name in ("gpt", "lenet"):
        return
    p, hf = cfg.parallel, hf_model.is_hf(m.name)
    what = "HF models" if hf else "your own models"
    if p.strategy == "auto":
        raise ConfigError("parallel.strategy", p.strategy, f"the planner (auto) for {what} "
                          f"({m.name}) is not supported yet (it sizes shardwise's GPT)",
                          "choose the layout: --dp, --tp, --pp with --zero-stage 0-3")
    if not hf and presets.pipelined(cfg):
        field, value = (("parallel.pp", p.pp) if p.pp > 1 else ("parallel.strategy", p.strategy))
        raise ConfigError(field, value, f"pipeline parallelism from the command line for your "
                          f"own models ({m.name}) is not supported (a stage runs the plan's "
                          "embed / block / final pieces, which a user's plan may not give)",
                          "use shardwise.prepare with a ModelPlan that has them, or --tp with "
                          "--dp and --zero-stage 0-3")
    if hf_model.is_hf(m.name):        # their plans: shardwise/models/plans.py
        return
    plans = sys.modules.get("shardwise.models.plans")    # loaded if the module registered one
    module = m.name.split(":")[0]
    if plans is not None and module in plans.registered_modules():
        return
    why = (f"{m.name} has no model plan (register_plan was not called in {module})",
           f"call shardwise.register_plan(YourModel, shardwise.ModelPlan(...)) in {module}, ")
    if presets.tensor_parallel(cfg):
        field, value = (("parallel.tp", p.tp) if p.tp > 1 else ("parallel.strategy", p.strategy))
        raise ConfigError(field, value, f"tensor parallelism splits a model by its plan; {why[0]}",
                          why[1] + "or use --strategy single, ddp, zero1, zero2 or zero3")
    if cfg.memory.activation_checkpointing:
        raise ConfigError("memory.activation_checkpointing", True, f"checkpointing wraps the "
                          f"blocks a model plan names; {why[0]}", why[1] + "or drop "
                          "--activation-checkpointing")
    if cfg.memory.compile:
        raise ConfigError("memory.compile", True, f"--compile compiles the blocks a model plan "
                          f"names; {why[0]}", why[1] + "or drop --compile")


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _fits_in_memory(cfg: Config, world_size: int) -> None:
    """Sizes that cannot fit in this machine's memory, however the work is split: lower bounds
    of what the run must hold, so a run that could fit is never refused (running out of memory
    later is still possible, and ends with one line too: cli.py).

    * every rank builds the whole model in fp32 on the CPU before any sharding: 4 bytes per
      weight (a GPT holds at least 12 n_layer n_embd^2 + (vocab_size + block_size) n_embd);
    * every rank draws the global batch's indices (8 bytes a row) and fetches its own rows, at
      least batch_size / world_size of them: int64 windows (twice (block_size + 1) x 8 bytes)
      or 28 x 28 fp32 images;
    * a GPT on a CPU: one micro-batch's logits (rows x block_size x vocab_size / tp, fp32)."""
    ram, m = machine_memory_bytes(), cfg.model
    if not ram:
        return
    gib = lambda n: f"{n / 2**30:,.3g} GiB"
    gpt = m.name == "gpt" or hf_model.is_hf(m.name)     # a decoder: the GPT's sizes bound it
    weights = 4 * (12 * m.n_layer * m.n_embd**2 + (m.vocab_size + m.block_size) * m.n_embd)
    if gpt and weights > ram:
        blown = max(("n_layer", "n_embd", "vocab_size"),
                    key=lambda k: getattr(m, k) / getattr(ModelConfig(), k))
        raise ConfigError(f"model.{blown}", getattr(m, blown), f"the GPT's fp32 weights alone take"
                          f" {gib(weights)}, more than this machine's {gib(ram)} (every rank "
                          "builds the whole model)", "make the model smaller (--n-layer, --n-embd,"
                          " --vocab-size)")
    rows = max(1, cfg.train.batch_size // max(1, world_size))
    batch = 8 * cfg.train.batch_size + rows * (2 * 8 * (m.block_size + 1) if gpt else 4 * 28 * 28)
    micro = max(1, rows // (cfg.memory.grad_accum * (cfg.parallel.num_microbatches
                                                     if cfg.parallel.pp > 1 else 1)))
    logits = 4 * micro * m.block_size * m.vocab_size // max(1, cfg.parallel.tp) if gpt else 0
    if batch > ram or (logits > ram and _on_cpu(cfg)):
        what = "its rows" if batch > ram else "one micro-batch's logits"
        raise ConfigError("train.batch_size", cfg.train.batch_size, f"{what} alone take "
                          f"{gib(batch if batch > ram else logits)} per rank, more than this machine's {gib(ram)}",
                          "use a smaller --batch-size" + ("" if batch > ram else
                                                          " (or more --grad-accum)"))


def _on_cpu(cfg: Config) -> bool:
    if cfg.train.device != "auto":
        return cfg.train.device == "cpu"
    import torch
    return not torch.cuda.is_available()


def _runtime_checks(cfg: Config, world_size: int) -> None:
    """What the run would only discover after its processes started."""
    p, m = cfg.parallel, cfg.model
    if p.strategy not in layout.DATA_MODEL + ("auto",) and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.tp" if p.tp > 1 else "parallel.pp", p.tp if p.tp > 1 else p.pp,
                          f"strategy {p.strategy} does not split the model",
                          "drop --strategy (the axis flags compose), or leave tp and pp at 1")
    layout.resolve(cfg)      # a preset that contradicts the axis flags or the stage
    if cfg.data.dataset in ("stdlib", "synthetic") and m.name != "lenet":
        smallest = (int(cfg.data.max_bytes * cfg.data.val_fraction) if cfg.data.dataset == "stdlib"
                    else (1 << 20) // 10)
        if m.block_size + 1 >= smallest:
            raise ConfigError("model.block_size", m.block_size, f"longer than the validation split"
                              f" (~{smallest} tokens)", "use a shorter block_size or more --max-bytes")
    if cfg.train.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is visible",
                              "use --device cpu (or auto)")
    if cfg.memory.compile:
        from shardwise.memory.compile import check_compiler
        why = check_compiler("cpu" if _on_cpu(cfg) else "cuda")
        if why:
            raise ConfigError("memory.compile", True, why, "install one (e.g. apt install g++) "
                              "or set CXX to its path, or drop --compile")
    if cfg.train.cpu_allocator == "cache":
        from shardwise.run.allocator import unusable
        why = unusable()
        if why:
            raise ConfigError("train.cpu_allocator", "cache", why,
                              "use --cpu-allocator system (or auto, which chooses it here)")
    check_writable(cfg.logging.out_dir)
    rundir.check_name(cfg.logging.run_name)     # a plain folder name: no '/', '..', 300 bytes
    check_picture(cfg.logging.schedule_png)


def _layout(cfg: Config, world_size: int) -> None:
    """The mesh and the batch: dp x tp x pp = the world, rows that split over dp x grad_accum;
    then each component's own checks (shardwise/parallel/layout.py's ``check_components``)."""
    p = cfg.parallel
    dp = 1
    if not presets.runs_alone(cfg) and not presets.has_roles(cfg):
        dp = resolve_dp(cfg, world_size)
        if dp * p.tp * p.pp * p.cp != world_size:
            raise ConfigError("parallel.dp", dp, f"dp x cp x tp x pp = {dp}x{p.cp}x{p.tp}x{p.pp} "
                              f"= {dp * p.cp * p.tp * p.pp} != world size {world_size}",
                              "make the product equal the number of processes (--nproc-per-node)")
        per_rank = cfg.train.batch_size // (dp * cfg.memory.grad_accum)
        if cfg.train.batch_size % (dp * cfg.memory.grad_accum) or per_rank == 0:
            raise ConfigError("train.batch_size", cfg.train.batch_size,
                              f"not divisible by dp x grad_accum = {dp}x{cfg.memory.grad_accum}",
                              "use a multiple of dp x grad_accum")
    layout.check_components(cfg, world_size, dp)


def validate(cfg: Config, world_size: int) -> Config:
    """Raise ConfigError on the first bad setting; return cfg unchanged when all is well."""
    _choices(cfg)
    _numbers(cfg)
    _positive(cfg)
    _model(cfg)
    _fits_in_memory(cfg, world_size)
    data_checks.check(cfg)
    _layout(cfg, world_size)
    _accumulation(cfg, world_size)
    _runtime_checks(cfg, world_size)
    return cfg


def _accumulation(cfg: Config, world_size: int) -> None:
    """Every process's rows must split into grad_accum equal micro-batches (whatever the
    strategy), or accumulation would weight unequal halves equally."""
    k = cfg.memory.grad_accum
    shards = presets.process_shards(cfg, world_size)
    if shards is None:
        return  # checked by _layout with the dp size
    if cfg.train.batch_size % (shards * k):
        raise ConfigError("memory.grad_accum", k, f"batch_size {cfg.train.batch_size} does not "
                          f"split into {shards} shard(s) x {k} equal micro-batches",
                          "use a batch_size that is a multiple of shards x grad_accum")
