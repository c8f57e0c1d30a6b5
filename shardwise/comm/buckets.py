"""Flat gradient buckets: gradients written straight into a few large buffers, reduced per bucket.

Parameters are grouped into buckets of about ``bucket_bytes`` in REVERSE order of registration:
backward produces the last layers' gradients first, so the first bucket fills first and its
reduction can start while backward is still computing earlier layers (overlap). Each trainable
parameter's ``.grad`` is set to a view into its bucket's flat buffer, so autograd accumulates
into the buffer in place and the reduction needs no copy. (Consequence: gradients must be zeroed
with :meth:`GradBuckets.zero`, never set to None.)

A post-accumulate-grad hook counts, per bucket, the parameters whose gradient is complete in this
backward; when the count reaches the bucket's size the bucket is *ready* and ``on_ready`` is
called with it (DDP launches the bucket's allreduce there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Bucket:
    index: int
    params: list            # the parameters whose gradients live in ``buffer``
    names: list             # their names, for error messages
    buffer: torch.Tensor    # flat gradient storage (1-D)
    pending: int = 0        # parameters not yet ready in the current backward
    work: object = None     # the launched reduction, if any
    extra: dict = field(default_factory=dict)   # per-strategy scratch (e.g. a compression buffer)


def plan_buckets(sizes_bytes: list[int], bucket_bytes: float) -> list[list[int]]:
    """Group parameter indices (given in registration order) into buckets, last parameters first.

    A bucket is closed once it holds at least ``bucket_bytes``; a single large parameter gets a
    bucket of its own. ``bucket_bytes`` <= 0 puts every parameter in one bucket.
    """
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        size += sizes_bytes[i]
        if bucket_bytes > 0 and size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradBuckets:
    """Flat gradient buffers over ``named_params`` with readiness hooks."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: float,
                 on_ready: Callable[[Bucket], None]):
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        sizes = [p.numel() * p.element_size() for _, p in named_params]
        self.buckets: list[Bucket] = []
        self.on_ready = on_ready
        self._handles = []
        for b, indices in enumerate(plan_buckets(sizes, bucket_bytes)):
            params = [named_params[i][1] for i in indices]
            names = [named_params[i][0] for i in indices]
            dtype, device = params[0].dtype, params[0].device
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
            offset = 0
            for p in params:
                p.grad = buffer[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            bucket = Bucket(b, params, names, buffer)
            self.buckets.append(bucket)
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))
        self.reset()

    def _hook(self, bucket: Bucket):
        def hook(_param):
            bucket.pending -= 1
            if bucket.pending == 0:
                self.on_ready(bucket)
        return hook

    def reset(self) -> None:
        """Start counting a new backward pass."""
        for b in self.buckets:
            b.pending = len(b.params)

    def zero(self) -> None:
        """Zero every gradient in place (the views stay attached to the buffers)."""
        for b in self.buckets:
            b.buffer.zero_()

    def unready(self) -> list[Bucket]:
        """Buckets some of whose parameters got no gradient in this backward."""
        return [b for b in self.buckets if b.pending > 0]

    def nbytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
