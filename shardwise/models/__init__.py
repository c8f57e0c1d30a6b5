"""Models: shardwise's own (architecture only), Hugging Face GPT-2 / Llama built from a config
(models/hf.py), and a person's own ``package.module:function`` (models/user.py).

The names below come from models/build.py on first use: the launcher reads models/hf.py and
models/user.py to check names and sizes, and must not pay torch's import for that.
"""
from __future__ import annotations


def configured_vocab(model_cfg) -> int | None:
    """The vocabulary size a config file fixes (hf models with --hf-config / --hf-weights'
    config.json), or None when the flags set it."""
    from shardwise.models import hf
    return hf.file_vocab(model_cfg) if hf.is_hf(model_cfg.name) else None


__all__ = ["GPT", "GPTConfig", "LeNet", "lm_loss", "classification_loss", "output_loss",
           "logits_of", "build_model", "loss_for", "configured_vocab"]


def __getattr__(name: str):
    if name in __all__ and name != "configured_vocab":
        from shardwise.models import build
        return getattr(build, name)
    raise AttributeError(f"module 'shardwise.models' has no attribute {name!r}")
