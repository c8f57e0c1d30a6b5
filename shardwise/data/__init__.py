"""Data sources. Each has ``batch(step, global_batch, dp_rank, dp_size, split) -> (x, y)``."""
from __future__ import annotations

from dataclasses import replace

from shardwise.config import ConfigError

# The sources (images.py, text.py) import torch; they load on first use (``__getattr__`` below),
# so the launcher's checks of --dataset text (files.py, tokenize.py, token_cache.py) run without it.
_LAZY = {"images": ("ImageData", "load_digits_data", "load_idx_dir", "read_idx", "write_idx"),
         "text": ("MemmapTokenData", "TokenData", "split_sizes", "stdlib_corpus",
                  "synthetic_tokens", "text_corpus")}


def __getattr__(name: str):
    import importlib
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(f"shardwise.data.{module}"), name)
    raise AttributeError(f"module 'shardwise.data' has no attribute {name!r}")


def build_data(cfg):
    """The data source a Config asks for (cfg: shardwise.config.Config)."""
    from shardwise.data.images import load_digits_data, load_idx_dir
    from shardwise.data.text import stdlib_corpus, synthetic_tokens, text_corpus
    d, m, seed = cfg.data, cfg.model, cfg.train.seed
    if d.dataset == "stdlib":
        return stdlib_corpus(m.block_size, seed, d.max_bytes, d.val_fraction)
    if d.dataset == "synthetic":
        return synthetic_tokens(m.block_size, seed, m.vocab_size)
    if d.dataset == "text":
        corpus = load_text(cfg)
        check_corpus(cfg, corpus)
        return text_corpus(corpus, m.block_size, seed, d.val_fraction)
    if d.dataset == "digits":
        return load_digits_data(seed)
    return load_idx_dir(d.data_dir, seed)


def load_text(cfg, max_vocab: int | None = None):
    """The tokenized corpus of ``--dataset text`` (shardwise/data/token_cache.py): found in the
    cache, or tokenized now (once); ``max_vocab``: refuse a larger tokenizer before tokenizing."""
    from shardwise.data import token_cache
    d = cfg.data
    return token_cache.prepare(d.data_path, d.tokenizer, d.token_cache,
                               cfg.train.collective_timeout, max_vocab, d.text_column)


def check_corpus(cfg, corpus, check_vocab: bool | None = None) -> None:
    """Refuse a corpus too short for two splits of one window each, and (unless the model's
    architecture comes from a file: --hf-config / --hf-weights) a model vocabulary smaller
    than the tokenizer's."""
    from shardwise.data.text import split_sizes
    m, d = cfg.model, cfg.data
    n_train, n_val = split_sizes(corpus.n_tokens, m.block_size, d.val_fraction)
    if n_train < m.block_size + 2:
        raise ConfigError("data.data_path", d.data_path, f"the corpus is {corpus.n_tokens:,} "
                          f"tokens ({d.tokenizer}): too short for block_size {m.block_size} "
                          f"(training and validation need block_size + 2 = {m.block_size + 2} "
                          "tokens each)", "give more text, or a shorter --block-size")
    if check_vocab is None:
        check_vocab = not (getattr(m, "hf_config", "") or getattr(m, "hf_weights", ""))
    if check_vocab and m.vocab_size < corpus.vocab_size:
        raise ConfigError("model.vocab_size", m.vocab_size, f"smaller than the tokenizer's "
                          f"vocabulary ({corpus.vocab_size:,} tokens, {d.tokenizer})",
                          f"use --vocab-size {corpus.vocab_size} or more, or leave --vocab-size "
                          "out (it is then set to the tokenizer's; with --hf-config / "
                          "--hf-weights, the file's vocab_size)")


def resolve_text(cfg, vocab_given: bool):
    """``shardwise train`` before launch: tokenize the corpus (or find it in the cache), set
    model.vocab_size to the tokenizer's when the person did not give one, refuse a corpus or
    vocabulary that cannot work. Returns (config, corpus)."""
    corpus = load_text(cfg, cfg.model.vocab_size if vocab_given else None)
    if not vocab_given:
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=corpus.vocab_size))
    check_corpus(cfg, corpus, check_vocab=True)
    return cfg, corpus


def tokenizer_files(cfg) -> list[str]:
    """The file(s) of --dataset text's tokenizer worth keeping with a run: the trained BPE's
    tokenizer.json (in the token cache), or a tokenizer path's own; none for bytes."""
    from shardwise.data import tokenize
    if cfg.data.dataset != "text" or cfg.data.tokenizer == "bytes":
        return []
    kind, arg = tokenize.parse_spec(cfg.data.tokenizer)
    if kind == "path":
        return tokenize.tokenizer_file(arg)
    trained = load_text(cfg).tokenizer_path
    return [trained] if trained else []


__all__ = ["build_data", "load_text", "tokenizer_files", "check_corpus", "resolve_text", "TokenData",
           "MemmapTokenData", "ImageData", "stdlib_corpus", "synthetic_tokens", "text_corpus",
           "load_digits_data", "load_idx_dir", "read_idx", "write_idx"]
