"""Build a model a ModelConfig names, and its loss (re-exported by shardwise.models)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.models.lenet import LeNet, classification_loss


def build_model(model_cfg, seed: int) -> torch.nn.Module:
    """The model a ModelConfig names, initialised from ``seed`` (same on every rank)."""
    from shardwise.models import hf, user
    torch.manual_seed(seed)
    if model_cfg.name == "lenet":
        return LeNet()
    if hf.is_hf(model_cfg.name):
        return hf.build(model_cfg)
    if user.is_user(model_cfg.name):
        return user.build(model_cfg)
    return GPT(GPTConfig(n_layer=model_cfg.n_layer, n_embd=model_cfg.n_embd,
                         n_head=model_cfg.n_head, block_size=model_cfg.block_size,
                         vocab_size=model_cfg.vocab_size, dropout=model_cfg.dropout))


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
