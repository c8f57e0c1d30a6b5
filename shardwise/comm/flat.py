"""Flat, padded buffers of parameters (or gradients) and their even shards.

A :class:`FlatLayout` lays a list of tensors end to end in one 1-D buffer and pads the end so
that the buffer divides evenly among ``world`` ranks::

    | p0 ........ | p1 .... | p2 .............. | pad |     numel = padded (a multiple of world)
    |  shard 0          |  shard 1          |  ...  |     shard r = [r*s, (r+1)*s), s = padded/world

Shards cut across tensors wherever they fall, so every rank owns exactly ``padded / world``
elements however odd the tensor sizes are (the padding is at most ``world - 1`` elements and
holds zeros, which SGD / Adam / AdamW leave at zero). Reduce-scatter and all-gather then work on
equal pieces, which is what the backend collectives (and a ring) need.

shardwise/comm/buckets.plan_buckets groups tensors into buckets of about ``bucket_bytes`` each; a
strategy keeps one FlatLayout per bucket, so that each bucket's collective can start as soon as its
gradients are ready. Nothing here communicates: this module is pure layout and copying, shared by
ZeRO (stages 1-3) and usable by any strategy that wants flat buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor lives in a flat buffer padded to a multiple of ``world`` elements."""
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int        # sum of the tensors' sizes (no padding)
    padded: int       # buffer length: numel rounded up to a multiple of world
    world: int

    @staticmethod
    def of(tensors, world: int) -> "FlatLayout":
        shapes, offsets, pos = [], [], 0
        for t in tensors:
            shapes.append(t.shape)
            offsets.append(pos)
            pos += t.numel()
        padded = -(-pos // world) * world if pos else world
        return FlatLayout(tuple(shapes), tuple(offsets), pos, padded, world)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of ``flat`` (a view)."""
        start, end = self.shard_range(rank)
        return flat[start:end]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per tensor, shaped like the original, sharing ``flat``'s storage."""
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    @torch.no_grad()
    def flatten_into(self, flat: torch.Tensor, tensors) -> torch.Tensor:
        """Copy ``tensors`` into ``flat`` (casting to its dtype); zero the padding."""
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        flat[self.numel:].zero_()
        return flat

    def new_flat(self, tensors=None, dtype=None, device=None) -> torch.Tensor:
        """A fresh buffer of ``padded`` elements: the tensors copied in, or zeros."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        if tensors is not None:
            self.flatten_into(flat, tensors)
        return flat


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it) usable after
    :func:`alloc_storage`; tensors saved for backward see the refilled memory."""
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give a tensor released by :func:`free_storage` its memory back (contents undefined)."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() != need:
        t.untyped_storage().resize_(need)


def storage_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor's storage holds right now (0 when released)."""
    return 0 if t is None else t.untyped_storage().size()


def shard_runs(layout: FlatLayout, keys: list, rank: int) -> list[tuple[object, int, int]]:
    """(key, lo, hi) for each run of consecutive tensors sharing a key (e.g. an optimizer
    parameter group), cut to rank's shard: [lo, hi) relative to the shard's start. Runs that
    miss the shard are left out; the padding belongs to the last run. Sort the tensors by key
    before building the layout and each key has one run."""
    start, end = layout.shard_range(rank)
    runs: list[list] = []
    for key, offset, shape in zip(keys, layout.offsets, layout.shapes):
        if runs and runs[-1][0] == key:
            runs[-1][2] = offset + shape.numel()
        else:
            runs.append([key, offset, offset + shape.numel()])
    if runs:
        runs[-1][2] = layout.padded
    out = []
    for key, lo, hi in runs:
        lo, hi = max(lo, start), min(hi, end)
        if hi > lo:
            out.append((key, lo - start, hi - start))
    return out
