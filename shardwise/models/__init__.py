"""Reference models (architecture only)."""
from __future__ import annotations

import torch

from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.models.lenet import LeNet, classification_loss


def build_model(model_cfg, seed: int) -> torch.nn.Module:
    """The model a ModelConfig names, initialised from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    if model_cfg.name == "lenet":
        return LeNet()
    return GPT(GPTConfig(n_layer=model_cfg.n_layer, n_embd=model_cfg.n_embd,
                         n_head=model_cfg.n_head, block_size=model_cfg.block_size,
                         vocab_size=model_cfg.vocab_size, dropout=model_cfg.dropout))


def loss_for(model_cfg):
    """The training loss of the model a ModelConfig names."""
    return classification_loss if model_cfg.name == "lenet" else lm_loss


__all__ = ["GPT", "GPTConfig", "LeNet", "lm_loss", "classification_loss", "build_model", "loss_for"]
