"""The memory techniques' own settings (freeze, LoRA), checked before launch.

``check`` is pure (settings against each other). ``check_names`` takes the run's model built on
the meta device (no memory, no weights: layout.check_model_names) and matches ``freeze`` and ``lora_targets`` against its
module names, so a glob that matches nothing, or LoRA on a layer that is not linear, is refused
before any process starts; ``shardwise train`` runs it (the Python API checks the user's own
model when ``prepare`` applies the techniques).
"""
from __future__ import annotations

import math

from shardwise.config import Config, ConfigError, MemoryConfig


def check(cfg: Config) -> None:
    m, default = cfg.memory, MemoryConfig()
    if m.lora_rank < 0:
        raise ConfigError("memory.lora_rank", m.lora_rank, "must be >= 0", "use 8, or 0 for off")
    if m.lora_rank == 0:
        for name in ("lora_alpha", "lora_targets"):
            if getattr(m, name) != getattr(default, name):
                raise ConfigError(f"memory.{name}", getattr(m, name), "LoRA is off "
                                  "(lora_rank = 0), so it would be ignored",
                                  f"set --lora-rank (e.g. 8) or drop --{name.replace('_', '-')}")
        return
    if not m.lora_targets.strip():
        raise ConfigError("memory.lora_targets", m.lora_targets, "LoRA needs the layers to "
                          "adapt", "e.g. --lora-targets '*attn.qkv,*mlp.fc'")
    if not (math.isfinite(m.lora_alpha) and m.lora_alpha > 0):
        raise ConfigError("memory.lora_alpha", m.lora_alpha, "must be a positive number",
                          "try 16 (the adapter's output is scaled by alpha / rank)")


def check_names(cfg: Config, model) -> None:
    """Match the globs against ``model`` (the run's model, built on the meta device by
    layout.check_model_names); changes that model."""
    m = cfg.memory
    if not m.freeze and m.lora_rank == 0:
        return
    from shardwise.memory.freeze import freeze
    from shardwise.memory.lora import inject_lora
    try:
        if m.lora_rank > 0:
            inject_lora(model, m.lora_rank, m.lora_alpha, m.lora_targets)
        if m.freeze:
            freeze(model, m.freeze)
    except ValueError as exc:
        field = "memory.lora_targets" if "LoRA" in str(exc) else "memory.freeze"
        raise ConfigError(field, getattr(m, field.split(".")[1]), str(exc).split("; fix")[0],
                          str(exc).split("fix: ")[-1] if "fix: " in str(exc) else
                          "use names that model.named_modules() prints") from None
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("memory.freeze", m.freeze, "every parameter would be frozen",
                          "freeze fewer modules")


# bytes on disk per trainable element, by optimizer: fp32 states the disk store holds (Adam's
# two moments; torch's SGD without momentum keeps none; adamw8bit's 8-bit moments stay in RAM)
STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "adamw8bit": 0}


def offload_bytes_per_element(cfg: Config) -> int:
    """Bytes ``offload=disk`` keeps in files per trainable element, summed over the ranks that
    share it (ZeRO shards it; its memory_ledger counts the same tensors): the fp32 master (4),
    the optimizer's fp32 states, and with ``offload_params`` the working-precision parameter
    shard (none in fp32: the master is the shard) and gradient shard."""
    m = cfg.memory
    working = 4 if m.mixed_precision == "no" else 2
    out = 4 + STATE_BYTES.get(cfg.train.optimizer, 8)
    if m.offload_params:
        out += (0 if working == 4 else working) + working
    return out
