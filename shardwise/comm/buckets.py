"""Flat gradient buckets: gradients written straight into a few large buffers, reduced per bucket.

Parameters are grouped into buckets of about ``bucket_bytes`` in REVERSE order of registration:
backward produces the last layers' gradients first, so the first bucket fills first and its
reduction can start while backward is still computing earlier layers (overlap). Each trainable
parameter's gradient lives in a view into its bucket's flat buffer, so the reduction needs no
copy. Between steps the gradients are dropped (:meth:`GradBuckets.clear` sets every ``.grad``
to None; the buffers stay), and so is any ``.grad`` a loop set to None or replaced (a user's
``optimizer.zero_grad()`` or ``model.zero_grad()``): the hook copies autograd's fresh gradient
into its view and makes the view ``.grad`` before the bucket counts it (one pass, where zeroing
the buffers and adding into them in place took three), later micro-batches add into the view
in place, and :meth:`GradBuckets.reattach` zeroes the view of a gradient that is still None
when the reduction starts. So the buckets always hold every gradient, whatever the loop did to
``.grad``.

The buffers are allocated when the first pass starts (:meth:`GradBuckets.reattach`, which a
strategy calls before each forward) or, for a backward that came without it, in the first hook
(a gradient autograd already made is copied into its view): never at construction, so setting a
model up holds no gradient memory (prepare's peak is the model's share; issue 30).

A post-accumulate-grad hook counts, per bucket, the parameters whose gradient is complete in this
backward; when the count reaches the bucket's size the bucket is *ready* and ``on_ready`` is
called with it (DDP launches the bucket's allreduce there). The same hook marks the parameter
*used* until :meth:`GradBuckets.clear_used` (DDP's find_unused learns from it which parameters
got no gradient on any rank).

:class:`FlatBroadcast` copies a list of tensors into one reused flat buffer per dtype, broadcasts
each flat and copies back: a model's buffers (BatchNorm statistics) in one call per dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from shardwise.comm.flat import FlatLayout


@dataclass
class Bucket:
    index: int
    params: list            # the parameters whose gradients live in ``buffer``
    names: list             # their names, for error messages
    buffer: torch.Tensor | None   # flat gradient storage (1-D); None until the first pass
    pending: int = 0        # parameters not yet ready in the current backward
    work: object = None     # the launched reduction, if any
    extra: dict = field(default_factory=dict)   # per-strategy scratch (e.g. a compression buffer)


def plan_buckets(sizes_bytes: list[int], bucket_bytes: float) -> list[list[int]]:
    """Group parameter indices (given in registration order) into buckets, last parameters first.
    The one bucket planner of every data-parallel stage (DDP's GradBuckets, ZeRO-1/2's chunks).

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
                 on_ready: Callable[[Bucket], None],
                 storage: Callable[[int], torch.Tensor | None] | None = None):
        """``storage(nbytes)``: where the buffers live (uint8 bytes every bucket is carved from,
        64-byte aligned, in bucket order; a shared mapping the reducer all-reduces in place),
        asked once at allocation; None from it, or no ``storage``: ordinary tensors."""
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.storage = storage
        sizes = [p.numel() * p.element_size() for _, p in named_params]
        self.buckets: list[Bucket] = []
        self.on_ready = on_ready
        self._handles = []
        self.params = [p for _, p in named_params]        # registration order
        self.names = [n for n, _ in named_params]
        self.views: list[torch.Tensor] = [None] * len(self.params)   # index -> its .grad view
        self.used = [False] * len(self.params)            # got a gradient since clear_used()
        self._plans: list[tuple[list[int], FlatLayout]] = []   # per bucket: indices, layout
        for b, indices in enumerate(plan_buckets(sizes, bucket_bytes)):
            params = [named_params[i][1] for i in indices]
            names = [named_params[i][0] for i in indices]
            self._plans.append((indices, FlatLayout.of(params, 1)))   # comm/flat.py's layout
            bucket = Bucket(b, params, names, None)       # its buffer: at the first pass
            self.buckets.append(bucket)
            for i in indices:
                self._handles.append(self.params[i].register_post_accumulate_grad_hook(
                    self._hook(bucket, i)))
        self.reset()

    @torch.no_grad()
    def allocate(self) -> None:
        """The flat buffers (zeros) and every ``.grad`` as a view into them, once (module
        docstring); a gradient already there is copied into its view."""
        if self.buckets and self.buckets[0].buffer is not None:
            return
        sizes = [-(-layout.padded * b.params[0].element_size() // 64) * 64
                 for b, (_, layout) in zip(self.buckets, self._plans)]
        where = self.storage(sum(sizes)) if self.storage is not None and self.buckets else None
        offset = 0
        for bucket, (indices, layout), size in zip(self.buckets, self._plans, sizes):
            first = bucket.params[0]
            if where is None:
                bucket.buffer = layout.new_flat(dtype=first.dtype, device=first.device)
            else:          # zeroed already (a fresh mapping)
                nbytes = layout.padded * first.element_size()
                bucket.buffer = where[offset:offset + nbytes].view(first.dtype)
                offset += size
            for i, p, view in zip(indices, bucket.params, layout.views(bucket.buffer)):
                if p.grad is not None:
                    view.copy_(p.grad)
                self.views[i] = p.grad = view

    def _hook(self, bucket: Bucket, i: int):
        def hook(param):
            self.allocate()             # a backward without reattach() first: made now
            view = self.views[i]
            if param.grad is not view:  # .grad was set to None (or replaced) since the last zero
                with torch.no_grad():
                    view.copy_(param.grad)
                param.grad = view
            self.used[i] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self.on_ready(bucket)
        return hook

    @torch.no_grad()
    def reattach(self, lazy: bool = False) -> None:
        """Put every parameter's ``.grad`` back on its view: a None gradient becomes a zero view
        (it got no gradient since it was cleared), a replaced one is copied in. The first
        call allocates the buffers. ``lazy`` (before a forward): a None gradient stays None,
        so autograd hands the hook a fresh gradient to copy into the view (:meth:`clear`);
        the view is zeroed only if no gradient comes (the next full reattach)."""
        self.allocate()
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is view or (lazy and g is None):
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view

    def detach_unused(self, used: list[bool]) -> None:
        """Set ``.grad`` to None for parameters not ``used`` (an optimizer then skips them, as
        torch.optim skips a gradient that is None); :meth:`reattach` undoes it."""
        for p, u in zip(self.params, used):
            if not u:
                p.grad = None

    def clear_used(self) -> None:
        self.used = [False] * len(self.params)

    def reset(self) -> None:
        """Start counting a new backward pass."""
        for b in self.buckets:
            b.pending = len(b.params)

    def clear(self) -> None:
        """Drop every gradient: each ``.grad`` set to None, its view kept (stale until the next
        backward). That backward's first gradient of a parameter is then autograd's own fresh
        tensor, which the hook copies into the view: one pass over the gradient, where zeroing
        the buffers and accumulating into them in place took three (a fill, then a read of
        both and a write). A parameter that gets no gradient has its view zeroed by the
        reattach before the reduction."""
        for p in self.params:
            p.grad = None

    def unready(self) -> list[Bucket]:
        """Buckets some of whose parameters got no gradient in this backward."""
        return [b for b in self.buckets if b.pending > 0]

    def nbytes(self) -> int:
        """The buffers' bytes (allocated or not: what the first pass makes)."""
        return sum(layout.padded * b.params[0].element_size()
                   for b, (_, layout) in zip(self.buckets, self._plans))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class FlatBroadcast:
    """Broadcast a fixed list of tensors as one flat buffer per dtype (buffers reused)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            self.groups.setdefault(t.dtype, []).append(t)
        self.flats = {dt: torch.empty(sum(t.numel() for t in ts), dtype=dt, device=ts[0].device)
                      for dt, ts in self.groups.items()}

    @torch.no_grad()
    def run(self, comm, src: int, group, name: str) -> None:
        """Every member's tensors take member ``src``'s values (nothing when the group is 1)."""
        if group.size == 1:
            return
        for dt, ts in self.groups.items():
            flat = self.flats[dt]
            if group.rank == src:
                torch.cat([t.reshape(-1) for t in ts], out=flat)
            comm.broadcast(flat, src, group, name=name)
            if group.rank != src:
                offset = 0
                for t in ts:
                    t.copy_(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())


def broadcast_coalesced(comm, tensors: list[torch.Tensor], src: int, group, name: str) -> None:
    """Every member's ``tensors`` take member ``src``'s values (a model's start from one rank's
    weights): one broadcast per dtype through a flat temporary, as torch DDP's
    ``_sync_module_states`` does, instead of one call per tensor. The temporary (the tensors'
    bytes once more) is freed on return; nothing happens in a group of one."""
    if group.size == 1 or not tensors:
        return
    FlatBroadcast([t.data for t in tensors]).run(comm, src, group, name=name)

