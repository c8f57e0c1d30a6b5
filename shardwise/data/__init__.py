"""Data sources. Each has ``batch(step, global_batch, dp_rank, dp_size, split) -> (x, y)``."""
from __future__ import annotations

from shardwise.data.images import ImageData, load_digits_data, load_idx_dir, read_idx, write_idx
from shardwise.data.text import TokenData, stdlib_corpus, synthetic_tokens


def build_data(cfg):
    """The data source a Config asks for (cfg: shardwise.config.Config)."""
    d, m, seed = cfg.data, cfg.model, cfg.train.seed
    if d.dataset == "stdlib":
        return stdlib_corpus(m.block_size, seed, d.max_bytes, d.val_fraction)
    if d.dataset == "synthetic":
        return synthetic_tokens(m.block_size, seed, m.vocab_size)
    if d.dataset == "digits":
        return load_digits_data(seed)
    return load_idx_dir(d.data_dir, seed)


__all__ = ["build_data", "TokenData", "ImageData", "stdlib_corpus", "synthetic_tokens",
           "load_digits_data", "load_idx_dir", "read_idx", "write_idx"]
