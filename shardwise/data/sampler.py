"""Deterministic global batches, cut into disjoint data-parallel shards.

Each step has one global batch, a pure function of (seed, step) — and of the epoch for finite
data sets. Data-parallel rank r of D takes rows [r*B/D, (r+1)*B/D) of it. So the union of the
ranks' shards is exactly the batch that single-process training sees at that step: the basis of
every equivalence test.
"""
from __future__ import annotations

import torch


def shard_rows(global_batch: int, dp_rank: int, dp_size: int) -> slice:
    """The rows of a global batch that data-parallel rank ``dp_rank`` owns."""
    if global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by dp size {dp_size}")
    per = global_batch // dp_size
    return slice(dp_rank * per, (dp_rank + 1) * per)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A generator seeded from (seed, step, stream) alone: no hidden state between steps."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1))
    return g


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of range(n) fixed by (seed, epoch)."""
    return torch.randperm(n, generator=step_generator(seed, epoch, stream=1))


def finite_indices(n: int, seed: int, step: int, global_batch: int) -> torch.Tensor:
    """Indices of a finite data set for ``step``: consecutive slices of per-epoch permutations."""
    pos = step * global_batch + torch.arange(global_batch)
    epochs = pos // n
    out = torch.empty(global_batch, dtype=torch.long)
    for e in epochs.unique().tolist():
        mask = epochs == e
        out[mask] = epoch_permutation(n, seed, e)[pos[mask] % n]
    return out
