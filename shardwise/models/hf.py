"""Hugging Face GPT-2 and Llama (``--model hf:gpt2`` / ``hf:llama``), built from a config, never
downloaded; optionally loaded from a local safetensors checkpoint.

The config is either
  * the size flags mapped onto the Hugging Face config: n_layer -> n_layer / num_hidden_layers,
    n_embd -> n_embd / hidden_size, n_head -> n_head / num_attention_heads (Llama: as many
    key-value heads, so no grouped-query attention from flags), vocab_size, block_size ->
    n_positions / max_position_embeddings, dropout -> every dropout of the model (0 by
    default); Llama's MLP width is 8/3 x n_embd rounded up to a multiple of 32 (Llama's own
    ratio), its embedding and head untied; GPT-2's are tied, as Hugging Face builds it; or
  * ``--hf-config FILE.json`` (or ``config.json`` in ``--hf-weights DIR``): the file as it is,
    with ``use_cache`` off (training never reads the key-value cache). The size flags then come
    from the file: a value given that differs from the file's is refused.

``--hf-weights DIR`` loads ``DIR/model.safetensors`` (or the shards a
``model.safetensors.index.json`` lists) after building; keys saved without the model's prefix
(``h.0...`` for ``transformer.h.0...``) are matched too, weights tied to a loaded one (GPT-2's
``lm_head.weight``) may be absent, and a missing or wrongly shaped weight is refused before
launch (:func:`check_weights` reads only the file's header). The forward returns a ModelOutput
whose ``logits`` the loss reads (shardwise/models/__init__.py's ``output_loss``).
"""
from __future__ import annotations

import json
import math
import os

import typing

if typing.TYPE_CHECKING:   # torch is imported where a model is built: the launcher's checks
    import torch.nn as nn   # of names and sizes do not pay its import

from shardwise.config import ConfigError

FAMILIES = {"hf:gpt2": "gpt2", "hf:llama": "llama"}
SIZE_KEYS = {"gpt2": {"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head",
                      "vocab_size": "vocab_size", "block_size": "n_positions"},
             "llama": {"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
                       "n_head": "num_attention_heads", "vocab_size": "vocab_size",
                       "block_size": "max_position_embeddings"}}


def is_hf(name: str) -> bool:
    return name in FAMILIES


def config_path(m) -> str | None:
    """The config.json the model is built from: --hf-config, else --hf-weights' own, else None."""
    if m.hf_config:
        return m.hf_config
    if m.hf_weights and os.path.isfile(os.path.join(m.hf_weights, "config.json")):
        return os.path.join(m.hf_weights, "config.json")
    return None


def read_config(m) -> dict | None:
    """The config file's mapping (None when the model is built from the flags)."""
    path = config_path(m)
    if path is None:
        return None
    field = "model.hf_config" if m.hf_config else "model.hf_weights"
    if not os.path.isfile(path):
        raise ConfigError(field, path, "no such file", "give the path of a config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(field, path, f"cannot be read as JSON ({' '.join(str(exc).split())})",
                          "give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(field, path, "does not hold a JSON object", "give a config.json")
    return data


def file_vocab(m) -> int | None:
    """The vocabulary size the config file fixes (None: built from the flags)."""
    data = read_config(m)
    return None if data is None else int(data.get("vocab_size", 0)) or None


def check(cfg) -> None:
    """Before launch, without importing transformers: the family's sizes, the config file and
    the weights folder (the file's tensors: :func:`check_weights`)."""
    from shardwise.config.extras import available
    m, family = cfg.model, FAMILIES[cfg.model.name]
    if not available("transformers"):
        raise ConfigError("model.name", m.name, "needs the 'transformers' package, which is not "
                          "installed", "pip install 'shardwise[hf]'")
    if m.hf_weights:
        if not os.path.isdir(m.hf_weights):
            raise ConfigError("model.hf_weights", m.hf_weights, "no such directory",
                              "give a folder holding model.safetensors")
        weight_files(m.hf_weights)
    data = read_config(m)
    if data is None:
        if m.n_embd % m.n_head:
            raise ConfigError("model.n_head", m.n_head, f"does not divide n_embd={m.n_embd}",
                              "pick n_head so that n_embd / n_head is whole")
        if family == "llama" and (m.n_embd // m.n_head) % 2:
            raise ConfigError("model.n_head", m.n_head, f"Llama's rotary embedding needs an even"
                              f" head width (n_embd / n_head = {m.n_embd // m.n_head})",
                              "pick n_head so that n_embd / n_head is even")
        return
    field = "model.hf_config" if m.hf_config else "model.hf_weights"
    kind = data.get("model_type")
    if kind is not None and kind != family:
        raise ConfigError(field, config_path(m), f"is a {kind!r} config, not {family!r}",
                          f"use --model hf:{kind}" if f"hf:{kind}" in FAMILIES else
                          "give a gpt2 or llama config.json")
    _check_sizes(cfg, data, family, field)


def _check_sizes(cfg, data: dict, family: str, field: str) -> None:
    """The size flags against the file: a flag given (not the default) must equal the file;
    the sequence must fit the file's positions."""
    from shardwise.config import ModelConfig
    m, default = cfg.model, ModelConfig()
    for ours, theirs in SIZE_KEYS[family].items():
        if ours == "block_size" or theirs not in data:
            continue
        value = getattr(m, ours)
        if value != getattr(default, ours) and value != data[theirs]:
            raise ConfigError(f"model.{ours}", value, f"the config file says {theirs} = "
                              f"{data[theirs]}", f"drop --{ours.replace('_', '-')} (the file "
                              "sets it), or edit the file")
    positions = data.get(SIZE_KEYS[family]["block_size"])
    if isinstance(positions, int) and m.block_size > positions:
        raise ConfigError("model.block_size", m.block_size, f"longer than the model's "
                          f"{positions} positions (the config file)", f"use --block-size "
                          f"{positions} or less")


def _transformers(name: str = "hf:gpt2"):
    """The transformers package, or one line naming the extra."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.name", name, "needs the 'transformers' package, which is "
                          "not installed", "pip install 'shardwise[hf]'") from None
    transformers.logging.set_verbosity_error()    # no notices about unused generation settings
    return transformers


def hf_config(m):
    """The transformers config object for ModelConfig ``m``."""
    transformers = _transformers(m.name)
    family = FAMILIES[m.name]
    cls = transformers.GPT2Config if family == "gpt2" else transformers.LlamaConfig
    data = read_config(m)
    if data is not None:
        return cls.from_dict({**data, "use_cache": False})
    if family == "gpt2":
        return cls(n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, vocab_size=m.vocab_size,
                   n_positions=m.block_size, resid_pdrop=m.dropout, embd_pdrop=m.dropout,
                   attn_pdrop=m.dropout, use_cache=False, bos_token_id=0, eos_token_id=0)
    hidden = 32 * math.ceil(8 * m.n_embd / 3 / 32)       # Llama's 8/3 ratio, multiple of 32
    return cls(hidden_size=m.n_embd, num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
               num_key_value_heads=m.n_head, intermediate_size=hidden, vocab_size=m.vocab_size,
               max_position_embeddings=m.block_size, attention_dropout=m.dropout,
               use_cache=False, tie_word_embeddings=False)


def build(m, load: bool = True) -> nn.Module:
    """The model (random init from the caller's seed), with --hf-weights loaded when given and
    ``load`` (not on the meta device: there is nothing to load into)."""
    transformers = _transformers(m.name)
    config = hf_config(m)
    cls = (transformers.GPT2LMHeadModel if FAMILIES[m.name] == "gpt2"
           else transformers.LlamaForCausalLM)
    model = cls(config)
    if load and m.hf_weights and not next(model.parameters()).is_meta:
        load_weights(model, m.hf_weights)
    return model


def weight_files(folder: str) -> list[str]:
    """model.safetensors, or every shard model.safetensors.index.json names."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError("model.hf_weights", folder, f"its index cannot be read ({exc})",
                              "give a folder saved by save_pretrained") from None
        return [os.path.join(folder, s) for s in shards]
    raise ConfigError("model.hf_weights", folder, "holds no model.safetensors (nor "
                      "model.safetensors.index.json)", "save the model with "
                      "save_pretrained(DIR, safe_serialization=True), or export one")


def _match(model: nn.Module, names: list[str]) -> dict[str, str]:
    """file key -> model key: as saved, or with the model's prefix ('transformer.', 'model.')."""
    ours = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") + "."
    out = {}
    for k in names:
        if k in ours:
            out[k] = k
        elif prefix + k in ours:
            out[k] = prefix + k
    return out


def _plan(model: nn.Module, folder: str, shapes: dict[str, tuple]) -> dict[str, str]:
    """Check the file's tensors against the model; return file key -> model key."""
    state = model.state_dict()
    mapping = _match(model, list(shapes))
    for k, ours in mapping.items():
        if tuple(shapes[k]) != tuple(state[ours].shape):
            raise ConfigError("model.hf_weights", folder, f"{k} has shape {tuple(shapes[k])}, "
                              f"the model's {ours} {tuple(state[ours].shape)}", "build the "
                              "model with the checkpoint's config (its config.json)")
    # a weight tied to a loaded one (GPT-2's lm_head.weight is transformer.wte.weight) is loaded too
    objects = dict(model.named_parameters(remove_duplicate=False))
    objects.update(model.named_buffers(remove_duplicate=False))
    loaded = {id(objects[v]) for v in mapping.values() if v in objects}
    missing = [k for k in state if k not in mapping.values() and id(objects.get(k)) not in loaded]
    if missing:
        raise ConfigError("model.hf_weights", folder, f"{len(missing)} weight(s) of the model "
                          f"are not in the checkpoint (e.g. {missing[0]})", "give the checkpoint"
                          " of this architecture, or build the model from its config.json")
    return mapping


def check_weights(cfg) -> None:
    """Before launch: the checkpoint's tensor names and shapes against the model (built on the
    meta device; only the files' headers are read)."""
    from safetensors import safe_open
    m = cfg.model
    shapes = {}
    for f in weight_files(m.hf_weights):
        with safe_open(f, "pt") as fh:
            shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    import torch
    with torch.device("meta"):
        model = build(m)
    _plan(model, m.hf_weights, shapes)


def load_weights(model: nn.Module, folder: str) -> None:
    import torch
    from safetensors.torch import load_file
    tensors = {}
    for f in weight_files(folder):
        tensors.update(load_file(f))
    mapping = _plan(model, folder, {k: tuple(v.shape) for k, v in tensors.items()})
    state = model.state_dict()
    with torch.no_grad():
        for k, ours in mapping.items():
            state[ours].copy_(tensors[k])


# -- attention routed to shardwise (context parallelism) ------------------------------------------
ATTENTION = "shardwise"


def _routed(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
            **kwargs):
    """transformers' attention interface entry under the name :data:`ATTENTION`: the module's
    own ``shardwise_attend`` (set by :func:`route_attention`). The entry itself holds nothing,
    so one registration serves every model in the process. ``attention_mask``: None (causal),
    or what :func:`_routed_mask` made: the whole sequence's key mask as (B, 1, 1, S)."""
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism: not built; "
                         "fix: set the model's attention dropout to 0 (--dropout 0)")
    keep = None if attention_mask is None else attention_mask[:, 0, 0, :]
    out = module.shardwise_attend(query, key, value, scale=scaling, keep=keep)  # (B, h, T, d)
    return out.transpose(1, 2).contiguous(), None                           # (B, T, h, d)


def _routed_mask(*, attention_mask=None, **kwargs):
    """transformers' mask interface entry under :data:`ATTENTION`: the 2-D padding mask it was
    given (the whole sequence's, context parallelism passes it uncut), as (B, 1, 1, S) keys;
    causality is the routed attention's own."""
    return None if attention_mask is None else attention_mask.bool()[:, None, None, :]


def route_attention(model: nn.Module, modules, attend) -> None:
    """Make the Hugging Face ``model``'s attention ``modules`` run ``attend(q, k, v, scale=,
    keep=)`` (q: (B, h, T, d), k and v: (B, h_kv, T, d), causal; keep: the whole sequence's
    (B, S) key mask or None) in place of their own kernel."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise RuntimeError("context parallelism on a Hugging Face model routes its attention "
                           "through transformers' attention and mask interfaces (5.0 or newer); "
                           "fix: pip install -U transformers, or drop --cp") from None
    AttentionInterface.register(ATTENTION, _routed)
    AttentionMaskInterface.register(ATTENTION, _routed_mask)
    for mod in modules:
        mod.shardwise_attend = attend
    model.config._attn_implementation = ATTENTION
