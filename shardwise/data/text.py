"""Token corpora: the Python standard library's own source (bytes), synthetic tokens, and a
person's text files (``--dataset text``: tokenized once into a memory-mapped cache by
shardwise/data/token_cache.py, read here by :class:`MemmapTokenData`; validation is the last
val_fraction of the tokens, :func:`split_sizes`).

The stdlib corpus is read at run time from the running interpreter's ``stdlib`` directory, so it
is on every machine with no download. Files are taken in sorted path order (site-packages left
out); every ``round(1/val_fraction)``-th file goes to validation, the rest to training, until
``max_bytes`` are read — deterministic on a given Python version.
"""
from __future__ import annotations

import math
import os
import sysconfig

import numpy as np
import torch

from shardwise.data.sampler import shard_rows, step_generator


def stdlib_files() -> list[str]:
    """Sorted .py files of the interpreter's standard library, without site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def read_stdlib(max_bytes: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 token tensors from the standard library's source."""
    every = max(2, round(1 / val_fraction))
    train, val, n_train = [], [], 0
    val_budget = int(max_bytes * val_fraction) + 1
    n_val = 0
    for i, path in enumerate(stdlib_files()):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        if i % every == 0:
            if n_val < val_budget:
                val.append(data)
                n_val += len(data)
        elif n_train < max_bytes:
            train.append(data)
            n_train += len(data)
        if n_train >= max_bytes and n_val >= val_budget:
            break
    as_tensor = lambda parts: torch.from_numpy(np.frombuffer(b"".join(parts), dtype=np.uint8).copy())
    return as_tensor(train)[:max_bytes], as_tensor(val)[:val_budget]


class TokenData:
    """Random windows of a token stream: x = tokens[i:i+T], y = tokens[i+1:i+T+1]."""
    kind = "tokens"

    def __init__(self, train: torch.Tensor, val: torch.Tensor, block_size: int, seed: int):
        for name, t in (("train", train), ("val", val)):
            if len(t) <= block_size + 1:
                raise ValueError(f"{name} split has {len(t)} tokens, fewer than block_size+1")
        self.splits = {"train": train, "val": val}
        self.block_size, self.seed = block_size, seed

    def global_indices(self, step: int, global_batch: int, split: str = "train") -> torch.Tensor:
        n = len(self.splits[split]) - self.block_size - 1
        g = step_generator(self.seed, step, stream=0 if split == "train" else 2)
        return torch.randint(0, n, (global_batch,), generator=g)

    def fetch(self, starts: torch.Tensor, split: str = "train"):
        data, T = self.splits[split], self.block_size
        offsets = starts[:, None] + torch.arange(T + 1)          # (b, T+1)
        chunk = data[offsets].long()
        return chunk[:, :-1], chunk[:, 1:]                       # x, y: (b, T)

    def batch(self, step, global_batch, dp_rank=0, dp_size=1, split="train"):
        """This rank's shard of the global batch at ``step``: (x, y), each (B/dp, T)."""
        idx = self.global_indices(step, global_batch, split)[shard_rows(global_batch, dp_rank, dp_size)]
        return self.fetch(idx, split)


def stdlib_corpus(block_size: int, seed: int, max_bytes: int, val_fraction: float) -> TokenData:
    train, val = read_stdlib(max_bytes, val_fraction)
    return TokenData(train, val, block_size, seed)


def synthetic_tokens(block_size: int, seed: int, vocab_size: int, n_tokens: int = 1 << 20) -> TokenData:
    """Uniform random tokens (for benchmarks: the loss cannot fall below ln(vocab))."""
    g = step_generator(seed, 0, stream=3)
    data = torch.randint(0, vocab_size, (n_tokens,), generator=g, dtype=torch.long)
    return TokenData(data[: n_tokens * 9 // 10], data[n_tokens * 9 // 10:], block_size, seed)


class MemmapTokenData(TokenData):
    """TokenData over memory-mapped numpy arrays (any unsigned dtype): a batch reads only its
    own B x (T + 1) tokens from the file."""

    def fetch(self, starts: torch.Tensor, split: str = "train"):
        data, T = self.splits[split], self.block_size
        offsets = starts.numpy()[:, None] + np.arange(T + 1)      # (b, T+1)
        chunk = torch.from_numpy(data[offsets].astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]                       # x, y: (b, T)


def split_sizes(n_tokens: int, block_size: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts of a text corpus: validation is the last
    ceil(val_fraction x n) tokens, at least block_size + 2 (one window and its target); the
    rest, before it, is training. The two never overlap (a window never crosses the cut)."""
    n_val = max(math.ceil(n_tokens * val_fraction), block_size + 2)
    return n_tokens - n_val, n_val


def text_corpus(corpus, block_size: int, seed: int, val_fraction: float) -> MemmapTokenData:
    """A tokenized corpus (shardwise.data.token_cache.Corpus) as train / val windows."""
    tokens = corpus.tokens()
    n_train, _ = split_sizes(len(tokens), block_size, val_fraction)
    return MemmapTokenData(tokens[:n_train], tokens[n_train:], block_size, seed)
