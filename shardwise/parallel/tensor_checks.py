"""Tensor parallelism's own constraints, checked before launch; pure. It splits the heads and
vocabulary (of shardwise's GPT, Hugging Face GPT-2 and Llama: their plans), so tp must divide the
heads (and Llama's key-value heads), and models without transformer blocks cannot use it
(pipeline parallelism cuts the same blocks)."""
from __future__ import annotations

from shardwise.config import Config, ConfigError
from shardwise.models import hf as hf_model


def _check_hf_heads(m, tp: int) -> None:
    """A Hugging Face model's heads (and Llama's key-value heads) split by tp, from the flags or
    the config file."""
    data = hf_model.read_config(m) or {}
    llama = hf_model.FAMILIES[m.name] == "llama"
    heads = data.get("num_attention_heads" if llama else "n_head", m.n_head)
    kv = data.get("num_key_value_heads", heads) if llama else heads
    if heads % tp:
        raise ConfigError("parallel.tp", tp, f"does not divide the model's {heads} attention "
                          "heads", "pick a tp that divides the number of heads")
    if kv % tp:
        raise ConfigError("parallel.tp", tp, f"does not divide the model's {kv} key-value heads "
                          "(grouped-query attention: each rank keeps whole kv heads)",
                          f"pick a tp that divides {kv}, or a config with more key-value heads")


def reads(cfg: Config) -> dict[str, bool]:
    return {}          # tp is an axis size, read by every layout that composes it


def check(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    if m.name == "gpt" and m.n_head % p.tp:
        raise ConfigError("parallel.tp", p.tp, f"does not divide n_head={m.n_head}",
                          "pick a tp that divides the number of heads")
    if p.tp > 1 and hf_model.is_hf(m.name):
        _check_hf_heads(m, p.tp)
    if m.name == "lenet" and (p.tp > 1 or p.pp > 1):
        name = "parallel.tp" if p.tp > 1 else "parallel.pp"
        raise ConfigError(name, max(p.tp, p.pp), "tensor and pipeline parallelism split the "
                          "GPT's transformer blocks; LeNet has none",
                          "use --dp with --zero-stage 0-3 for LeNet, or train the GPT")


def check_heads(sizes: dict, tp: int) -> None:
    """tp must divide the attention heads, and the key-value heads (grouped-query attention:
    each rank keeps whole kv heads and the query heads that read them). Raises ValueError."""
    if sizes.get("n_head", tp) % tp:
        raise ValueError(f"tp = {tp} does not divide n_head = {sizes['n_head']}")
    if sizes.get("n_kv_head", tp) % tp:
        raise ValueError(f"tp = {tp} does not divide the {sizes['n_kv_head']} key-value heads; "
                         "fix: a tp that divides num_key_value_heads")
