"""Typed configuration: six frozen sections, one help text per field, loaded from TOML / YAML
and overridden by command-line flags.

Every field's help text lives in ``field(metadata={"help": ...})`` so that the CLI's ``--help``,
the README and error messages are generated from one place. Field names are unique across
sections, so each field has exactly one flag: ``--<name-with-dashes>`` (``--n-layer``; the
model's ``name`` is ``--model``).

Validation (:func:`validate`) runs before any process is started and before any collective, and
raises :class:`ConfigError`, whose message names the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import decimal
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shardwise.config.names import STRATEGIES, Strategy

DATASETS = ("stdlib", "digits", "mnist", "fashion-mnist", "synthetic", "text")
MODELS = ("gpt", "lenet", "hf:gpt2", "hf:llama")   # or a user's package.module:function


def _f(default: Any, help: str, choices: tuple | None = None, flag: str | None = None):
    """A dataclass field with its help text, allowed values and CLI flag name attached."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a field: ``--n-layer`` for n_layer (or the field's own)."""
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


@dataclass(frozen=True)
class ModelConfig:
    name: str = _f("gpt", "gpt = shardwise's decoder-only transformer; lenet = LeNet "
                   "(LeCun et al. 1998); hf:gpt2 / hf:llama = a Hugging Face GPT-2 / Llama "
                   "built from a config (the size flags below, or --hf-config; never "
                   "downloaded; the 'hf' extra); or "
                   "package.module:function = your own model: the function gets the ModelConfig"
                   " if it takes an argument (nothing otherwise) and returns an nn.Module whose "
                   "output is logits, or a dict / ModelOutput with 'logits', or a tuple starting"
                   " with them", MODELS, flag="model")
    n_layer: int = _f(4, "GPT: number of transformer blocks")
    n_embd: int = _f(128, "GPT: model width (hidden size)")
    n_head: int = _f(4, "GPT: attention heads; must divide n_embd (and be divisible by tp)")
    block_size: int = _f(128, "GPT: sequence length in tokens")
    vocab_size: int = _f(256, "GPT: vocabulary size (256 = byte-level tokens)")
    dropout: float = _f(0.0, "GPT: dropout probability (0 keeps runs bit-comparable)")
    init: str = _f("meta", "how ranks get their weights: meta = the model is built on the meta "
                   "device and each rank materialises only what it keeps (its ZeRO-3 shards, tp "
                   "slices, pipeline stage) one block at a time, initialised per module from the "
                   "seed (the same weights under every layout); eager = every rank first builds "
                   "the whole model on the CPU (the same weights; for a model whose __init__ "
                   "reads tensors or has modules without reset_parameters)", ("meta", "eager"))
    hf_config: str = _f("", "hf:gpt2 / hf:llama: a Hugging Face config.json to build the model "
                        "from (then --n-layer, --n-embd, --n-head and --vocab-size come from the "
                        "file); empty = built from those flags, with n_positions / "
                        "max_position_embeddings = --block-size")
    hf_weights: str = _f("", "hf:gpt2 / hf:llama: a local folder holding model.safetensors (or "
                         "a sharded model.safetensors.index.json) to load after building; its "
                         "config.json is used when --hf-config is not given")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f("stdlib", "stdlib = the Python standard library's own source (bytes); digits ="
                      " scikit-learn's handwritten digits; mnist / fashion-mnist = IDX files in"
                      " data_dir; synthetic = random tokens for benchmarks; text = your own "
                      "UTF-8 files (--data-path, --tokenizer)", DATASETS)
    data_dir: str = _f("", "directory holding the MNIST / Fashion-MNIST IDX files (.gz or raw)")
    max_bytes: int = _f(4_000_000, "stdlib corpus: read at most this many bytes of source")
    repeat_batch: bool = _f(False, "train on the first batch at every step: an overfitting "
                            "check (the loss must fall), e.g. a huge model's first steps")
    val_fraction: float = _f(0.05, "fraction of the corpus held out for validation")
    data_path: str = _f("", "--dataset text: your UTF-8 text, a file, a directory (every file "
                        "below it, hidden ones left out), a quoted glob ('books/**/*.txt') or a "
                        "Hugging Face dataset saved to disk (its --text-column); "
                        "files in sorted path order, the last val_fraction of the tokens held "
                        "out for validation")
    tokenizer: str = _f("bytes", "--dataset text: bytes (256 tokens), bpe:N (a byte-level BPE of "
                        "N tokens trained here on the corpus, kept in the token cache and copied"
                        " into the run directory) or the path of a local Hugging Face "
                        "tokenizer.json / folder holding one")
    text_column: str = _f("text", "--dataset text with a Hugging Face dataset saved to disk "
                          "(save_to_disk) as --data-path: the string column that is the corpus")
    token_cache: str = _f("", "--dataset text: folder of tokenized corpora (memory-mapped, "
                          "written once, reused while the files are unchanged); empty = "
                          "$SHARDWISE_CACHE/tokens or ~/.cache/shardwise/tokens")


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = _f(Strategy.DDP.value, "how the work is split across processes", STRATEGIES)
    nproc_per_node: int = _f(0, "processes to start on this machine; 0 = one per GPU, or 2 on CPU")
    dp: int = _f(0, "data-parallel size; 0 = whatever the world size leaves after tp and pp")
    tp: int = _f(1, "tensor-parallel size (innermost mesh axis)")
    sequence_parallel: bool = _f(False, "with --tp > 1: norms, residual adds and dropout run on a "
                                 "1/tp slice of the sequence (Megatron-LM sequence parallelism; "
                                 "the sequence length must divide by tp)", flag="sp")
    pp: int = _f(1, "pipeline-parallel size (outermost mesh axis)")
    cp: int = _f(1, "context-parallel size: every sequence cut over this many ranks (ring "
                 "attention or Ulysses, --cp-impl); a mesh axis between dp and tp")
    cp_impl: str = _f("ring", "context parallelism's attention: ring = keys and values passed "
                      "round the cp ranks (p2p); ulysses = all-to-all from sequence- to "
                      "head-split and back (heads must divide by cp)", ("ring", "ulysses"))
    allreduce: str = _f("auto", "data parallelism's collectives (DDP's allreduce, ZeRO's "
                        "reduce-scatter and all-gather): native = the backend's own; ring = "
                        "shardwise's ring; shm = through shared memory between the ranks of one "
                        "CPU host (about half gloo's time); auto = shm where every rank of the "
                        "group is on one x86 CPU host and polls (--comm-wait), else native",
                        ("auto", "native", "ring", "shm"))
    pp_transport: str = _f("auto", "pipeline sends: native = the backend's send / recv; shm = "
                           "byte rings in shared memory between the stages of one CPU host; "
                           "auto = shm where every stage is on one x86 CPU host and polls "
                           "(--comm-wait), else native", ("auto", "native", "shm"))
    bucket_mb: float = _f(25.0, "DDP / ZeRO gradient bucket size in MB")
    overlap: bool = _f(True, "launch each bucket's reduction during backward (off: after it)")
    find_unused: bool = _f(False, "DDP: tolerate parameters that get no gradient in a step")
    grad_compression: str = _f("none", "cast gradients for the allreduce", ("none", "bf16", "fp16"))
    replicas: int = _f(2, "single-process DP (strategy dp): number of model replicas")
    num_microbatches: int = _f(4, "pipeline: micro-batches per step")
    schedule: str = _f("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved-1f1b (virtual "
                       "stages, Megatron) or zb-h1 (zero-bubble: backward split into input and "
                       "weight gradients)", ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"))
    virtual_stages: int = _f(1, "interleaved-1f1b: model chunks per pipeline rank (>= 2; the "
                             "model is cut into pp x virtual_stages stages)")
    stage_layers: str = _f("", "pipeline: blocks per stage, e.g. '1,3'; empty = balanced")
    zero_stage: int = _f(-1, "data-parallel stage over the dp axis: 0 replicate (DDP), 1 shard "
                         "optimizer states (ZeRO-1), 2 + gradients, 3 + parameters; combines with"
                         " --tp (any stage) and --pp (stages 0-1); -1 = the strategy's own "
                         "(ddp 0, zeroN N, tp / pp / 3d 0)")
    zero1_over_dp: bool = _f(False, "3d: shard optimizer states over the dp axis (the same as "
                             "--zero-stage 1)")
    dp_shard: int = _f(0, "HSDP (ZeRO stages 1-3): ranks that shard the model inside each "
                       "replica group; the dp ranks form dp / dp_shard replica groups that "
                       "all-reduce their gradient shards; 0 = shard over all of dp")
    dp_replicate: int = _f(0, "HSDP: replica groups (dp_replicate x dp_shard = the dp size; "
                           "give either or both); 0 = dp / dp_shard")
    num_ps: int = _f(1, "parameter server: number of ps tasks")
    num_workers: int = _f(0, "parameter server: number of worker tasks; 0 = world - num_ps")
    ps_mode: str = _f("sync", "parameter server update rule", ("sync", "async", "ssp"))
    staleness: int = _f(2, "ssp: how many versions a worker may run ahead of the slowest")
    straggler: str = _f("", "inject delay: 'WORKER:FACTOR[,WORKER:FACTOR]', e.g. '1:3'")
    on_worker_failure: str = _f("stop", "ps sync mode: stop the job or continue with the rest",
                                ("stop", "continue"))
    ps_timeout: float = _f(300.0, "parameter server: seconds without a worker's gradient before"
                           " that task is declared failed (workers wait twice as long for a ps)")
    zero3_units: str = _f("", "ZeRO-3: module class names that form one unit each, comma-separated"
                          " (e.g. 'GPT2Block'); empty = the largest repeated module class")
    ft_replicas: int = _f(0, "fault tolerance: split the data-parallel world into this many "
                          "replica groups, each started by a torchrun of its own; a group that "
                          "loses a rank is dropped from the gradient average while the others "
                          "keep stepping, and rejoins (restarted by --max-restarts) with a live "
                          "group's weights and optimizer state; 0 = off (docs/checkpoints.md)")
    ft_rejoin_nproc: int = _f(0, "replica groups (--ft-replicas): a group that loses a rank is "
                              "restarted by shardwise's launcher (not torchrun's agent) with "
                              "this many ranks, up to --max-restarts times per group, and "
                              "rejoins at that size with a live group's state: it keeps its tp, "
                              "pp and cp and changes its dp size (N a multiple of tp x pp x "
                              "cp; any DDP / ZeRO / HSDP / offload layout inside); 0 = off "
                              "(torchrun restarts a group at its own size)")


@dataclass(frozen=True)
class MemoryConfig:
    grad_accum: int = _f(1, "micro-steps whose gradients are summed before one optimizer step")
    mixed_precision: str = _f("no", "autocast dtype for forward/backward", ("no", "bf16", "fp16"))
    offload: str = _f("none", "ZeRO: where optimizer states and master weights live",
                      ("none", "cpu", "disk"))
    offload_dir: str = _f("", "offload=disk: directory for memory-mapped state; empty = temp dir")
    offload_params: bool = _f(False, "ZeRO-3 with --offload cpu|disk: this rank's parameter "
                              "shards and reduced gradients live there too (ZeRO-Infinity), "
                              "gathered into a unit's full parameters only while it computes; "
                              "disk reads are prefetched and writes run in the background")
    offload_sync: str = _f("auto", "offload=disk: when written state reaches the disk. always ="
                           " each chunk synced as soon as it is written back, so dirty pages "
                           "never pile up (what a state bigger than RAM needs); kernel = left to "
                           "the kernel's writeback, which writes a page rewritten every step "
                           "about once per expiry interval; auto = kernel where this machine's "
                           "offloaded state fits in a quarter of the memory available at start, "
                           "else always", ("auto", "always", "kernel"))
    activation_checkpointing: bool = _f(False, "recompute each block's activations in backward")
    compile: bool = _f(False, "torch.compile the forward of each of this rank's transformer "
                       "blocks (TorchInductor; module hooks, checkpointing and the gradient "
                       "sync stay as they are); the first step pays the compilation, reported "
                       "apart as compile_seconds")
    freeze: str = _f("", "freeze parameters: fnmatch globs over model.named_modules() names, "
                     "comma-separated (e.g. 'blocks.0.*,tok_emb'); frozen ones get no gradient, "
                     "no optimizer state, no traffic")
    lora_rank: int = _f(0, "LoRA: rank of the low-rank adapters (0 = off); base weights frozen")
    lora_alpha: float = _f(16.0, "LoRA: scale alpha (the adapter's output is scaled by alpha/rank)")
    lora_targets: str = _f("", "LoRA: globs over module names of the Linear / HF Conv1D layers "
                           "that get adapters, e.g. '*attn.qkv,*mlp.fc'")
    memory_report: bool = _f(False, "print each rank's measured peak and, per enabled memory "
                             "technique, the bytes it saved against the ledger without it")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(500, "optimizer steps to run")
    batch_size: int = _f(16, "global batch (sequences or images per step, all ranks together)")
    lr: float = _f(3e-3, "peak learning rate")
    optimizer: str = _f("adamw", "optimizer (adamw8bit: both Adam moments in 8 bits, "
                        "block-wise scaled)", ("adamw", "adam", "sgd", "adamw8bit"))
    optimizer_kernel: str = _f("fused", "how adamw / adam / sgd step: fused (one kernel for "
                               "all tensors where torch has one for the device, cpu and cuda "
                               "included; 7-9x faster than loop on CPU), foreach (one op per "
                               "kind over all tensors), loop (one tensor at a time: torch's "
                               "own default on CPU)", ("fused", "foreach", "loop"))
    weight_decay: float = _f(0.0, "weight decay (AdamW: decoupled)")
    warmup_steps: int = _f(20, "linear learning-rate warmup steps")
    lr_schedule: str = _f("cosine", "after warmup: cosine decay to 10% or constant",
                          ("cosine", "constant"))
    eval_every: int = _f(100, "evaluate on held-out data every N steps (0 = only at the end)")
    eval_batches: int = _f(8, "batches per evaluation")
    seed: int = _f(0, "seed for weights and data order")
    grad_clip: float = _f(0.0, "clip gradients to this global L2 norm (over every shard and "
                          "parallel axis) before each step; 0 = off")
    device: str = _f("auto", "auto = cuda when present, else cpu", ("auto", "cpu", "cuda"))
    collective_timeout: float = _f(300.0, "seconds a collective waits for the other ranks before "
                                   "the run stops with an error naming the rank, operation and "
                                   "step (a stalled or dead rank); gloo's own default is 30 min")
    comm_wait: str = _f("auto", "how a rank waits for a collective: spin = poll until done (the "
                        "core stays awake: after compute a small gloo allreduce takes 0.3 ms "
                        "instead of 3-4 ms on a machine whose idle cores sleep), block = sleep "
                        "until woken; auto = spin on CPU when each rank of this host has cores "
                        "of its own (ranks x threads <= cores), else block",
                        ("auto", "spin", "block"))
    cpu_allocator: str = _f("auto", "the CPU heap (glibc malloc): cache = keep freed blocks "
                            "under 256 MiB for the next step's tensors instead of returning "
                            "them to the kernel, which faults and zeroes their pages again "
                            "every step; system = glibc as it is; auto = cache on a CPU run "
                            "under glibc unless a MALLOC_* threshold variable is set or ZeRO "
                            "offloads (shardwise/run/allocator.py)", ("auto", "cache", "system"))
    checkpoint_dir: str = _f("", "save checkpoints into this folder (torch.distributed.checkpoint:"
                             " step-N/ sub-folders and a 'latest' pointer); also saved at the end"
                             " and when the run is stopped (SIGINT / SIGTERM); empty = no saving")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (needs --checkpoint-dir); "
                               "0 = only at the end and on a stop")
    keep_checkpoints: int = _f(3, "keep the newest K checkpoints in --checkpoint-dir",
                               flag="keep")
    checkpoint_async: bool = _f(False, "write the periodic checkpoints in the background "
                                "(torch.distributed.checkpoint.async_save): training goes on "
                                "while the files are written; 'latest' switches only once a save"
                                " is complete; the last step's save is written at once")
    checkpoint_move_last: bool = _f(False, "with --offload disk (ZeRO, no tp / pp): the last "
                                    "step's checkpoint takes the offload files' bytes instead "
                                    "of copying them (each piece's disk blocks are freed once "
                                    "it is written), so the end of the run needs no room for "
                                    "the state twice; saved after final.safetensors; the run's "
                                    "state cannot be trained on afterwards")
    resume: bool = _f(False, "continue from the checkpoint --checkpoint-dir's 'latest' names "
                      "(the same layout: bit-identical; another layout or world: resharded)")
    max_restarts: int = _f(0, "restart the whole world up to N times when a rank dies "
                           "(torchrun's elastic agent); a restarted world resumes from "
                           "--checkpoint-dir's latest checkpoint, or from step 0 when none was "
                           "saved yet (needs --checkpoint-dir)")


@dataclass(frozen=True)
class LoggingConfig:
    out_dir: str = _f("runs", "directory for metrics.jsonl, summary.json and pictures")
    run_name: str = _f("", "sub-directory name; empty = strategy and timestamp")
    progress: bool = _f(True, "progress bar on rank 0")
    log_every: int = _f(10, "write a metrics line every N steps (the mean over those steps); "
                        "also one printed log line when stdout is not a terminal")
    tensorboard: bool = _f(False, "also write TensorBoard event files to <run dir>/tensorboard "
                           "(needs the 'tensorboard' extra)")
    csv: bool = _f(False, "also write <run dir>/metrics.csv (one row per logged step)")
    schedule_png: str = _f("", "pipeline: picture of the last step's schedule; empty = "
                           "<run dir>/schedule.png, 'off' = none")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS = {f.name: f.type for f in fields(Config)}


class ConfigError(ValueError):
    """A bad setting: the message names the field, the value and the fix."""

    def __init__(self, field_name: str, value: Any, why: str, fix: str):
        self.field_name, self.value, self.why, self.fix = field_name, value, why, fix
        super().__init__(f"{field_name} = {value!r}: {why}; fix: {fix}")


def section_fields():
    """Yield (section_name, dataclasses.Field) for every field of every section."""
    for sec in fields(Config):
        cls = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig,
               "memory": MemoryConfig, "train": TrainConfig, "logging": LoggingConfig}[sec.name]
        for f in fields(cls):
            yield sec.name, f


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,60}$")
_INT_DIGITS = 18        # "5e3" is 5000; more than 18 digits in exponent notation is no usable int


def _shown(key: Any) -> str:
    """A section or field name as a message shows it: plain names as they are, anything else
    (a newline, 300 characters, a number) quoted, so that the message stays one line."""
    return key if isinstance(key, str) and _PLAIN_KEY.match(key) else repr(key)[:60]


def _coerce(section: str, f: dataclasses.Field, value: Any) -> Any:
    """Turn a file or flag value into the field's type, or raise ConfigError.

    bool: true / false (and 1 / 0, yes / no, on / off); int: a whole number (``5``, ``1_000``,
    ``5e3``; never a bool, ``5.5`` or ``1.5e0``); float: any number (nan and inf pass here and
    are refused by validate); text: a string or a number, never a YAML boolean (an unquoted
    ``no`` / ``off`` in YAML), a list, a mapping or a NUL character. No value (YAML ``key:``
    with nothing after it) is refused for every type."""
    kind = type(f.default)
    name = f"{section}.{f.name}"
    if value is None:
        raise ConfigError(name, value, "has no value", f"give one (e.g. {f.default!r}) or drop "
                          "the line")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, str)) and str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, (int, str)) and str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(name, value, "not a boolean", "use true or false")
    if kind is int:
        return _as_int(name, f, value)
    if kind is float:
        return _as_float(name, f, value)
    return _as_text(name, f, value)


def _as_int(name: str, f: dataclasses.Field, value: Any) -> int:
    """A whole number; range checks (at most 2**63 - 1, positive...) are validate's."""
    refuse = ConfigError(name, value, "not an int of a usable size", f"give a number, e.g. {f.default}")
    if isinstance(value, bool):
        raise refuse
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise refuse
        return _as_int(name, f, repr(value))   # 1e30 as a float is not exactly 10**30
    if not isinstance(value, str):
        raise refuse
    text = value.strip()
    try:
        return int(text)                       # "5", "-3", "1_000", "99999999999999999999"
    except ValueError:
        pass
    try:
        number = decimal.Decimal(text)         # "5e3", "5.0e0": exact, no float rounding
    except decimal.InvalidOperation:
        raise refuse from None
    if not number.is_finite() or number.adjusted() >= _INT_DIGITS or number != number.to_integral_value():
        raise refuse
    return int(number)


def _as_float(name: str, f: dataclasses.Field, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(name, value, "not a float", f"give a number, e.g. {f.default}")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise ConfigError(name, value, "not a float", f"give a number, e.g. {f.default}") from None


def _as_text(name: str, f: dataclasses.Field, value: Any) -> str:
    if isinstance(value, bool):     # YAML reads an unquoted no / off / yes / on as a boolean
        raise ConfigError(name, value, "a boolean, not text (YAML reads unquoted no, off, yes "
                          "and on as booleans)", "quote the value, e.g. 'no' or 'off'")
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(name, value, f"a {type(value).__name__}, not text",
                          f"give one string, e.g. {f.default!r}")
    if "\x00" in value:
        raise ConfigError(name, value, "holds a NUL character", "remove it")
    return value


def from_dict(data: dict, base: Config | None = None) -> Config:
    """Build a Config from nested ``{section: {field: value}}`` (unknown keys are errors)."""
    cfg = base or Config()
    known = {s: {f.name: f for _, f in section_fields() if _ == s} for s in SECTIONS}
    if not isinstance(data, dict):
        raise ConfigError("--config", type(data).__name__, "the file must hold a mapping of sections",
                          "write [section] tables (TOML) or 'section:' mappings (YAML)")
    for sec, values in data.items():
        if not isinstance(sec, str):
            raise ConfigError("--config", sec, "section names must be text",
                              f"use section names: {', '.join(known)}")
        if sec not in known:
            raise ConfigError(_shown(sec), "...", "unknown section", f"use one of {', '.join(known)}")
        if not isinstance(values, dict):
            raise ConfigError(sec, values, "a section must be a table", f"write [{sec}] then fields")
        updates = {}
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError("--config", key, f"field names (under {sec}) must be text",
                                  "quote the key, e.g. 'steps: 50' under 'train:'")
            key = key.replace("-", "_")
            if key not in known[sec]:
                raise ConfigError(f"{sec}.{_shown(key)}", value, "unknown field",
                                  f"use one of {', '.join(known[sec])}")
            updates[key] = _coerce(sec, known[sec][key], value)
        cfg = replace(cfg, **{sec: replace(getattr(cfg, sec), **updates)})
    return cfg


def load_file(path: str, base: Config | None = None) -> Config:
    """Load a TOML (.toml) or YAML (.yaml / .yml) file into a Config."""
    return from_dict(read_file(path), base)


def read_file(path: str) -> dict:
    """The nested mapping a TOML (.toml) or YAML (.yaml / .yml) file holds (an empty YAML file
    holds no settings: ``{}``). Whether it is a mapping of sections is from_dict's check."""
    if not os.path.isfile(path):
        why = "not a file" if os.path.exists(path) else "no such file"
        raise ConfigError("--config", path, why, "give the path of a .toml or .yaml file")
    if not path.endswith((".toml", ".yaml", ".yml")):
        raise ConfigError("--config", path, "unknown file type", "use a .toml or .yaml file")
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        else:
            import yaml
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
            data = {} if data is None else data
    except OSError as exc:
        raise ConfigError("--config", path, f"cannot be read ({exc.strerror or exc})",
                          "give a file you can read") from None
    except Exception as exc:  # a parse error: say where, on one line, without a traceback
        where = " ".join(str(exc).split())
        raise ConfigError("--config", path, f"cannot be parsed ({where})", "fix the file's syntax") from None
    return data


def to_dict(cfg: Config) -> dict:
    """The nested plain-dict form (what summary.json records)."""
    return dataclasses.asdict(cfg)


def given(args, section: str, name: str) -> bool:
    """Whether the person set ``section.name``: a flag (``args``, the parsed command line), or a
    key in the ``--config`` file. A default alone never counts."""
    if hasattr(args, f"{section}.{name}"):
        return True
    data = read_file(args.config) if getattr(args, "config", None) else {}
    keys = data.get(section) if isinstance(data, dict) else None
    return isinstance(keys, dict) and any(str(k).replace("-", "_") == name for k in keys)
