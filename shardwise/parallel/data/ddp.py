"""Distributed data parallel: one process per replica, bucketed gradient allreduce overlapped
with backward.

Partition: nothing is partitioned. Every rank of the data-parallel group holds the whole model,
its gradients and optimizer state, and trains on its own disjoint rows of each global batch.

Collectives: at start, dp member 0's parameters and buffers broadcast to every member, one flat
per dtype (so every replica starts identical whatever each process initialised). At every forward, the model's buffers
(BatchNorm running statistics) are broadcast from dp member 0, one flat per dtype (torch DDP's
``broadcast_buffers=True``; meter ``ddp_buffers``): every replica normalises with, and ends with,
member 0's statistics, which are those of member 0's rows only (plain BatchNorm, not
SyncBatchNorm). In backward, gradients land in flat buckets
(comm/buckets.py, about ``bucket_mb`` each, last layers first); the moment a bucket's last
gradient is accumulated its allreduce is launched asynchronously (``overlap``), with the
backend's own allreduce, shardwise's ring or, between the ranks of one CPU host, shared memory
(``allreduce = native | ring | shm | auto``; comm/reducer.py, comm/shm.py: the shared-memory one
runs in the hook itself, so it overlaps nothing, but the buckets are allocated in its mapping
(``_grad_storage``), so backward writes the gradients where every rank reads them and the
all-reduce copies nothing in or out). Each reduction averages (mean gradient: the sum divided
by the dp size). ``step()`` waits for every bucket, then runs the optimizer on each replica.
``clip_grad_norm_`` does that waiting first (the gradients are replicated then, so the norm needs
no further collective) and ``step()`` does not repeat it.

Memory per rank: parameters P, gradients P (the bucket buffers are the ``.grad`` storage, no
copy), optimizer states (Adam: 2P), plus a half-size buffer per bucket with gradient compression
and, with the shared-memory allreduce, its (N + 1) x 4 MiB region. With it the gradients are
shared pages, and each rank reads the others' (N - 1 slices of each bucket), so its RSS counts up
to N x 4P of gradient pages of which (N - 1) x 4P are the other ranks' (held once on the host).
Traffic per step: one allreduce of all gradients, 2(N-1)/N * 4P bytes per rank in fp32 (half
with bf16 / fp16 compression), plus the buffers' bytes once per forward.

``no_sync()`` skips the reductions for gradient-accumulation micro-steps (gradients keep summing
in the buckets). ``find_unused`` lets parameters that get no gradient in a step take part: each
rank marks the parameters whose gradient hook ran, one small allreduce (max; meter
``ddp_unused``, one byte-sized float per parameter) tells every rank which got a gradient on
any rank, and those that got none have ``.grad`` None during the optimizer step, so torch.optim
skips them exactly as in single-process training (Adam's moments and weight decay do not move
them). Without ``find_unused`` such a parameter is reported by name (one line,
parallel/data/checks.py UnusedParameters); with one replica (dp = 1) there is nothing to wait
for, so it is left out of the step as in plain PyTorch and ``find_unused`` is not needed.

A user's own loop may drive the optimizer itself. Its ``zero_grad`` sets every ``.grad`` to
None whatever ``set_to_none`` says, as ``step()`` does, and keeps the buckets: the next
backward's gradients are copied into them as they come (one pass, cheaper than zeroing the
buckets and accumulating into them; comm/buckets.py). A ``.grad`` set to None some other way
(``model.zero_grad()``) is handled the same way, so the next backward still lands in the
buckets. Its ``step()`` carries a
step pre-hook (torch.optim's ``register_step_pre_hook``) that finishes the reduction first, so
``engine.optimizer.step()`` equals ``engine.step()`` but for zeroing the gradients.

Replica groups (``--ft-replicas``, parallel/replicas.py): ``_finish_grad_sync`` then averages
the reduced buckets over the live groups through their hook (``self.ft``, once a step), whose
failed vote raises Redo before the optimizer runs; :meth:`zero_grad` drops the step's gradients
and the step is taken again. Under ``find_unused`` (on by itself in one-rank groups) the
used flags go through the same hook, so a parameter that any live group's rows used is
stepped by every group, and one no group used by none, as one process on the whole batch.

Reference: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from shardwise.comm.buckets import Bucket, FlatBroadcast, GradBuckets, broadcast_coalesced
from shardwise.comm.reducer import Reducer
from shardwise.memory.amp import DTYPES
from shardwise.parallel.data.checks import UnusedParameters, unused_fix
from shardwise.parallel.base import OptimizerFactory, Strategy, grad_sq, optimizer_state_bytes, \
    tensor_bytes, trainable



class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self.model = model.to(self.device)
        self.group = self.mesh.grad_group
        self._broadcast_state()
        p = self.cfg.parallel
        # one replica: nothing to wait for, so a parameter without a gradient is left out of
        # the step as in plain PyTorch (find_unused's bookkeeping, with no collective)
        self.overlap, self.find_unused = p.overlap, p.find_unused or self.group.size == 1
        self.compress = DTYPES.get(p.grad_compression)   # None for "none"
        self.reducer = Reducer(self.comm, self.group, p.allreduce, self.device)
        self.buckets = GradBuckets(list(self.model.named_parameters()), p.bucket_mb * 2**20,
                                   self._on_ready, storage=self._grad_storage)
        self.model_buffers = FlatBroadcast(list(self.model.buffers()))
        self.optimizer = optimizer_factory(trainable(self.model))
        self.optimizer.zero_grad = self.zero_grad     # keep the .grad views (module docstring)
        self.optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
        self.optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
        self._sync, self._next, self._synced = True, 0, False

    def _grad_storage(self, nbytes: int) -> torch.Tensor | None:
        """Where the buckets live: in the shared-memory all-reduce's mapping where it serves
        this group (the buckets then all-reduce in place: comm/shm.py), else None (ordinary
        tensors). Asked at the first forward, on every rank alike (a collective)."""
        if self.compress is not None or self.group.size == 1:
            return None                  # compression reduces a low-precision copy instead
        return self.reducer.shared_buffer(nbytes)

    def _broadcast_state(self) -> None:
        """Every replica starts from dp member 0's parameters and buffers (unless they were all
        made from the seed: ``deterministic_start``)."""
        if self.deterministic_start:
            return
        broadcast_coalesced(self.comm, [*self.model.parameters(), *self.model.buffers()], 0,
                            self.group, name="ddp_broadcast")

    # -- backward: launch each bucket's reduction as soon as it is ready ------------------------
    def forward(self, *args, **kwargs):
        self.begin_pass()
        return super().forward(*args, **kwargs)   # autocast; activations measured (ledger.py)

    def begin_pass(self) -> None:
        """Before a forward: re-attach dropped ``.grad`` views, count a new backward, take dp
        member 0's buffers. (A pipeline calls it once per pass; parallel/pipeline/driver.py.)"""
        self.buckets.reattach(lazy=True)     # a replaced .grad copied in; None stays None
        self.restart_count()
        self.model_buffers.run(self.comm, 0, self.group, name="ddp_buffers")

    def restart_count(self) -> None:
        """Count the next backward's gradients afresh (a pipeline: before its last micro-batch's
        backward, the one whose buckets launch)."""
        self.buckets.reset()
        self._next = 0                       # launches go in bucket order on every rank
        for bucket in self.buckets.buckets:  # readiness is per backward (no_sync steps too)
            bucket.extra["ready"] = False

    def before_backward(self, last: bool) -> None:
        """A pipeline's backward: only the step's last one launches the buckets (counted afresh
        for it); the earlier ones accumulate into them."""
        if last:
            self.restart_count()
        self._sync = last

    def _on_ready(self, bucket: Bucket) -> None:
        """Launch ready buckets in index order: every rank must issue its collectives in the
        same order, and which bucket fills first can differ between ranks (data-dependent
        branches under find_unused)."""
        bucket.extra["ready"] = True
        if not (self._sync and self.overlap):
            return
        buckets = self.buckets.buckets
        while self._next < len(buckets) and buckets[self._next].extra.get("ready"):
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        if bucket.work is not None or self.group.size == 1:
            return
        data = bucket.buffer
        if self.compress is not None:  # reduce a low-precision copy; copied back in _finish
            low = bucket.extra.get("low")
            if low is None:
                low = bucket.extra["low"] = torch.empty_like(data, dtype=self.compress)
            low.copy_(data)
            data = low
        name = "ddp_ring_all_reduce" if self.reducer.ring is not None else "ddp_all_reduce"
        # the mean gradient: averaged by the reduction itself (the shared-memory one divides
        # each slice where it sums it: no pass over the whole bucket), except a compressed
        # copy, whose sum is divided in full precision once copied back (_finish_grad_sync)
        op = "sum" if self.compress is not None else "avg"
        bucket.work = self.reducer.all_reduce(data, async_op=True, name=name, op=op)

    def _finish_grad_sync(self) -> None:
        """Launch what backward did not, wait for everything, average (once per step)."""
        if self._synced:
            return
        self.buckets.reattach()
        if not self.find_unused and self.buckets.unready():
            unused = [n for n, u in zip(self.buckets.names, self.buckets.used) if not u]
            field, value = (("parallel.find_unused", False) if self.mesh.pp == 1 else
                            ("parallel.pp", self.mesh.pp))
            raise UnusedParameters("ddp", unused, field, value,
                                   "DDP reduces each bucket once all its gradients arrived",
                                   unused_fix(0, self.group.size, self.mesh.pp))
        n = self.group.size
        for bucket in self.buckets.buckets:   # what backward left, still in index order
            self._launch(bucket)
        for bucket in self.buckets.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
                if self.compress is not None:
                    bucket.buffer.copy_(bucket.extra["low"])
                    bucket.buffer.div_(n)
        used = None
        # which parameters got a gradient on any rank (replica groups that may differ in size
        # all send the flags: a one-rank group has find_unused on by itself)
        if self.find_unused or getattr(self.ft, "resizable", False):
            used = torch.tensor(self.buckets.used, dtype=torch.float32, device=self.device)
            self.comm.all_reduce(used, self.group, op="max", name="ddp_unused")
        if self.ft is not None:          # --ft-replicas: then over the live replica groups,
            # the flags too: a parameter any live group used is stepped by every group
            self.ft.reduce([bucket.buffer for bucket in self.buckets.buckets]
                           + ([used] if used is not None else []))
        if used is not None and self.find_unused:
            self._used = (used > 0).tolist()
        self._synced = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the context reduces them all."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def step(self) -> None:
        if self._overflowed():  # fp16 (parallel/scaling.py): skipped on every rank
            self._after_optimizer_step()
        else:                   # its hooks reduce (unless clipping did) and restore the views
            self.optimizer.step()
        self._end_step()
        self._clear()

    def _before_optimizer_step(self) -> None:
        """Every optimizer.step(), the user's own included: gradients reduced first."""
        self._check_user_step()
        self._finish_grad_sync()
        if self.find_unused:    # no gradient on any rank: the optimizer must skip it
            self.buckets.detach_unused(self._used)

    def _after_optimizer_step(self) -> None:
        self.buckets.reattach()
        self._synced = False    # a later backward (without zero_grad) accumulates, reduced again

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad under DDP: drop this step's gradients (``.grad`` None,
        whatever ``set_to_none`` says), keep the buckets for the next backward to fill."""
        for bucket in self.buckets.buckets:
            if bucket.work is not None:   # a launched reduction still writes into the buffer
                bucket.work.wait()
                bucket.work = None
        self._clear()

    def _clear(self) -> None:
        self.buckets.clear()
        self.buckets.clear_used()
        self._synced = False

    # -- clipping: after the allreduce every replica holds the same mean gradient ----------
    def _local_grad_sq(self) -> torch.Tensor:
        if self.plan is not None:          # tensor parallel: replicated entries counted once
            return super()._local_grad_sq()
        return grad_sq([b.buffer for b in self.buckets.buckets], self.device)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for b in self.buckets.buckets:
            b.buffer.mul_(coef.to(b.buffer.dtype))

    def close(self) -> None:
        self.reducer.close()

    # -- accounting --------------------------------------------------------------------------
    def memory_ledger(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": self.buckets.nbytes(),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,
            "comm_buffers": sum(tensor_bytes([b.extra.get("low")]) for b in self.buckets.buckets)
            + self.model_buffers.nbytes() + self.reducer.nbytes(),
            "activations_peak": self._act_peak,
        }
