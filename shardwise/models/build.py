"""Build a model a ModelConfig names, and its loss (re-exported by shardwise.models)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.models.lenet import LeNet, classification_loss


def build_model(model_cfg, seed: int, init: str = "eager") -> torch.nn.Module:
    """The model a ModelConfig names, the same on every rank for one ``seed``.

    ``init="meta"``: built on the meta device (no memory, no values); the composer
    (parallel/compose.py) materialises each rank's own part from ``seed`` (models/init.py).
    ``init="eager"``: built whole on the CPU and initialised from ``seed`` unit by unit exactly as
    the meta path materialises it, so both give bit-identical weights under every layout (a
    person's model whose modules lack ``reset_parameters`` keeps its constructor's weights, drawn
    after ``torch.manual_seed(seed)``; ``--hf-weights`` are loaded instead of initialising). Both
    paths leave the global generator seeded with ``seed``."""
    from shardwise.models import hf, user
    from shardwise.models.init import build_on_meta, initialize
    torch.manual_seed(seed)
    if init == "meta":
        model = build_on_meta(lambda: _construct(model_cfg), model_cfg.name)
    else:
        model = _construct(model_cfg)
        if hf.is_hf(model_cfg.name) and model_cfg.hf_weights:
            hf.load_weights(model, model_cfg.hf_weights)
        elif not user.is_user(model_cfg.name) or _meets_contract(model):
            initialize(model, seed)
    torch.manual_seed(seed)
    return model


def _construct(model_cfg) -> torch.nn.Module:
    """The model's constructor alone (no weights loaded)."""
    from shardwise.models import hf, user
    if model_cfg.name == "lenet":
        return LeNet()
    if hf.is_hf(model_cfg.name):
        return hf.build(model_cfg, load=False)
    if user.is_user(model_cfg.name):
        return user.build(model_cfg)
    return GPT(GPTConfig(n_layer=model_cfg.n_layer, n_embd=model_cfg.n_embd,
                         n_head=model_cfg.n_head, block_size=model_cfg.block_size,
                         vocab_size=model_cfg.vocab_size, dropout=model_cfg.dropout))


def _meets_contract(model: torch.nn.Module) -> bool:
    """Whether every module of a person's model has an initialiser (models/init.py)."""
    from shardwise.config import ConfigError
    from shardwise.models.init import check_initialisable
    try:
        check_initialisable(model)
    except ConfigError:
        return False
    return True


def logits_of(out) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``out["logits"]`` of a dict or
    ModelOutput, or the first item of a tuple / list."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"the model returned a {type(out).__name__} without logits; return a "
                    "tensor, a dict / ModelOutput with 'logits', or a tuple starting with them")


def output_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits of any output (tokens (B, T, V) or classes (B, C)), in fp32."""
    return lm_loss(logits_of(out).float(), targets)


output_loss.cross_entropy = True  # plain cross-entropy: tp runs it vocab-parallel (tensor_loss.py)


def loss_for(model_cfg):
    """The training loss of the model a ModelConfig names."""
    if model_cfg.name == "lenet":
        return classification_loss
    return lm_loss if model_cfg.name == "gpt" else output_loss


__all__ = ["GPT", "GPTConfig", "LeNet", "lm_loss", "classification_loss", "output_loss",
           "logits_of", "build_model", "loss_for"]
