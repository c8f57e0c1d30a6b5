"""What ``shardwise train`` settles before it starts any process: the one-line refusal, the
sizes only files know (a Hugging Face config's vocabulary, a text corpus tokenized into the
cache once), optional packages and data files a setting needs, and where a world that torchrun
restarted resumes. shardwise/cli.py's check_train calls these in order; nothing here starts a
process or imports torch at module level.
"""
from __future__ import annotations

import argparse
import sys

from shardwise.config import Config, ConfigError, given, read_file  # noqa: F401 (given: re-exported)


def error(msg: str) -> int:
    """Print one ``error:`` line (a message is one line by contract) and return exit code 2."""
    print("error: " + msg.replace("\n", "\\n"), file=sys.stderr)
    return 2


class FinishedBeforeRestart(Exception):
    """A restarted world whose newest checkpoint is at the last step: nothing left to train."""


def resume_after_restart(cfg: Config) -> Config:
    """In a world torchrun's agent restarted (``--max-restarts``; TORCHELASTIC_RESTART_COUNT >
    0) with a checkpoint folder: ``train.resume`` when the folder holds a complete checkpoint
    (the refusal of a fresh run into a used folder is for people, not for restarts), else the
    config as it is (no save was published: the run starts over from step 0)."""
    from shardwise.launch import torchrun as launch
    from shardwise.checkpoint import store
    folder = store.newest_intact(cfg.train.checkpoint_dir).folder \
        if cfg.train.checkpoint_dir else None
    if not launch.restart_count() or folder is None:
        return cfg
    step = int(store.read_meta(folder)["step"])
    if step >= cfg.train.steps:   # a rank died after the final save
        raise FinishedBeforeRestart(f"restart {launch.restart_count()}: the checkpoint {folder} "
                                     f"is at the last step ({step}); nothing left to train")
    from dataclasses import replace
    return replace(cfg, train=replace(cfg.train, resume=True))


def restart_step(cfg: Config) -> int | None:
    """The step a restarted world resumes from (None: from scratch)."""
    from shardwise.checkpoint import store
    return int(store.read_meta(store.newest_intact(cfg.train.checkpoint_dir).folder)["step"]) \
        if cfg.train.resume else None


def warn_emulated(cfg: Config) -> None:
    """fp16 autocast on a CPU works but is emulated: say so once, before the run."""
    import torch
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
    if cfg.memory.mixed_precision == "fp16" and on_cpu:
        print("warning: memory.mixed_precision = 'fp16' on a CPU is emulated and slow (and bf16 "
              "needs no loss scaling); use --mixed-precision bf16 on CPUs", file=sys.stderr,
              flush=True)


def resolve_model_data(cfg: Config, args: argparse.Namespace, world: int) -> Config:
    """Sizes known only from files, before launch: the vocabulary a Hugging Face config file
    fixes; for --dataset text, the corpus tokenized into the token cache (once: later runs and
    the ranks find it there) and model.vocab_size set to the tokenizer's unless given (a given
    one that is too small is refused); a --hf-weights checkpoint's tensors against the model."""
    from dataclasses import replace
    from shardwise.models import configured_vocab, hf
    from shardwise.run.validate import validate
    before, given_vocab = cfg, given(args, "model", "vocab_size")
    fixed = configured_vocab(cfg.model)
    if fixed is not None:
        cfg, given_vocab = replace(cfg, model=replace(cfg.model, vocab_size=fixed)), True
    if cfg.data.dataset == "text":
        from shardwise.data import resolve_text
        cfg, _ = resolve_text(cfg, given_vocab)
    if cfg != before:
        validate(cfg, world)       # the sizes it set (memory bounds) are checked like typed ones
    if hf.is_hf(cfg.model.name) and cfg.model.hf_weights:
        hf.check_weights(cfg)
    return cfg


def keep_tokenizer(cfg: Config, folder: str) -> None:
    """--dataset text with a BPE or a tokenizer file: a copy in the run directory, beside the
    weights it was trained with."""
    import shutil
    from shardwise.data import tokenizer_files
    for path in tokenizer_files(cfg):
        shutil.copy(path, folder)


def check_extras(cfg: Config) -> None:
    """Optional packages a setting needs, checked before any process starts."""
    from shardwise.config.extras import require
    if cfg.logging.tensorboard:
        require("tensorboard", "tensorboard", "logging.tensorboard")


def check_data_files(cfg: Config) -> None:
    """MNIST / Fashion-MNIST: the four IDX files must be there and whole before any process
    starts (read once here: a damaged file is one line, not a traceback in every rank)."""
    if cfg.data.dataset not in ("mnist", "fashion-mnist"):
        return
    from shardwise.data.images import IDX_FILES, _find, load_idx_dir
    for pair in IDX_FILES.values():
        for stem in pair:
            try:
                _find(cfg.data.data_dir, stem)
            except FileNotFoundError:
                raise ConfigError("data.data_dir", cfg.data.data_dir, f"{stem}(.gz) is missing",
                                  "put the four IDX files of the data set in that directory") from None
    load_idx_dir(cfg.data.data_dir, cfg.train.seed)


def parameter_count(cfg: Config) -> int | None:
    """Parameters of the configured model without building it (shardwise's GPT: the planner's
    count, planner/model.py, less the 3h qkv bias per block our GPT does not have), or from a
    build on the meta device (no memory); None when neither works."""
    mc = cfg.model
    if mc.name == "gpt":
        from shardwise.planner.model import ModelSpec
        spec = ModelSpec(mc.n_layer, mc.n_embd, mc.n_head, mc.block_size, mc.vocab_size,
                         tied_embeddings=False)
        return spec.params - 3 * mc.n_embd * mc.n_layer
    try:
        import torch
        from shardwise.models import build_model
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(mc, cfg.train.seed).parameters())
    except Exception:       # a model that cannot be built on meta: the run itself will say
        return None


def check_offload_room(cfg: Config, world_size: int, local_ranks: int | None = None) -> None:
    """``offload=disk``: the filesystem of ``offload_dir`` (or the temporary directory) must have
    room for what this machine's ranks will put there, before any process starts: parameters x
    memory/checks.py's ``offload_bytes_per_element`` x the share of the world on this machine (a lower bound:
    shard padding and files other runs write meanwhile are not counted). Skipped with
    ``freeze`` or LoRA (fewer trainable elements than parameters) and for a model that cannot
    be counted."""
    import os
    import shutil
    import tempfile
    from shardwise.memory.checks import offload_bytes_per_element
    m = cfg.memory
    if m.offload != "disk" or m.freeze or m.lora_rank:
        return
    params = parameter_count(cfg)
    if not params:
        return
    local = local_ranks or world_size
    needed = params * offload_bytes_per_element(cfg) * local // max(1, world_size)
    where = os.path.abspath(m.offload_dir or tempfile.gettempdir())
    probe = where
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ConfigError("memory.offload_dir", m.offload_dir or where, f"offload=disk needs "
                          f"{needed:,} bytes there ({params:,} parameters x "
                          f"{offload_bytes_per_element(cfg)} bytes, {local} of {world_size} ranks "
                          f"on this machine) and its filesystem has {free:,} free",
                          "free space there, or give --offload-dir on a disk with room (or use "
                          "--offload cpu)")
