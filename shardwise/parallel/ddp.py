"""Distributed data parallel: one process per replica, bucketed gradient allreduce overlapped
with backward.

Partition: nothing is partitioned. Every rank of the data-parallel group holds the whole model,
its gradients and optimizer state, and trains on its own disjoint rows of each global batch.

Collectives: at start, one broadcast per parameter and buffer from dp member 0 (so every replica
starts identical whatever each process initialised). In backward, gradients land in flat buckets
(comm/buckets.py, about ``bucket_mb`` each, last layers first); the moment a bucket's last
gradient is accumulated its allreduce is launched asynchronously (``overlap``), with the
backend's own allreduce or shardwise's ring (``allreduce = native | ring``). ``step()`` waits for
every bucket, divides by the dp size (mean gradient), then runs the optimizer on each replica.

Memory per rank: parameters P, gradients P (the bucket buffers are the ``.grad`` storage, no
copy), optimizer states (Adam: 2P), plus a half-size buffer per bucket with gradient compression.
Traffic per step: one allreduce of all gradients, 2(N-1)/N * 4P bytes per rank in fp32 (half
with bf16 / fp16 compression).

``no_sync()`` skips the reductions for gradient-accumulation micro-steps (gradients keep summing
in the buckets); ``find_unused`` lets parameters that get no gradient in a step take part (their
gradient is zero); without it such a parameter is reported by name.

Reference: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020; seed 003.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from shardwise.comm.buckets import Bucket, GradBuckets
from shardwise.comm.ring import RingRunner
from shardwise.memory.amp import DTYPES
from shardwise.parallel.base import OptimizerFactory, Strategy, optimizer_state_bytes, tensor_bytes



class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self.model = model.to(self.device)
        self.group = self.mesh.dp_group
        self._broadcast_state()
        p = self.cfg.parallel
        self.overlap, self.find_unused = p.overlap, p.find_unused
        self.compress = DTYPES.get(p.grad_compression)   # None for "none"
        self.ring = RingRunner(self.comm) if p.allreduce == "ring" and self.group.size > 1 else None
        self.buckets = GradBuckets(list(self.model.named_parameters()), p.bucket_mb * 2**20,
                                   self._on_ready)
        self.optimizer = optimizer_factory([q for q in self.model.parameters() if q.requires_grad])
        self._sync, self._next = True, 0

    def _broadcast_state(self) -> None:
        """Every replica starts from dp member 0's parameters and buffers."""
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                self.comm.broadcast(t.data, 0, self.group, name="ddp_broadcast")

    # -- backward: launch each bucket's reduction as soon as it is ready ------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buckets.reset()
        self._next = 0                       # launches go in bucket order on every rank
        for bucket in self.buckets.buckets:  # readiness is per backward (no_sync steps too)
            bucket.extra["ready"] = False
        with self.autocast():
            return self.model(x)

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
        if self.ring is not None:
            bucket.work = self.ring.all_reduce(data, self.group, name="ddp_ring_all_reduce")
        else:
            bucket.work = self.comm.all_reduce(data, self.group, async_op=True, name="ddp_all_reduce")

    def _finish(self) -> None:
        """Launch what backward did not, wait for everything, average."""
        if self.overlap and not self.find_unused:
            missing = self.buckets.unready()
            if missing:
                names = [n for b in missing for n, q in zip(b.names, b.params)][:5]
                raise RuntimeError(
                    f"ddp: some parameters got no gradient in this step (in buckets with {names}); "
                    "fix: pass --find-unused (find_unused=True) or use every parameter in forward")
        n = self.group.size
        for bucket in self.buckets.buckets:   # what backward left, still in index order
            self._launch(bucket)
        for bucket in self.buckets.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
                if self.compress is not None:
                    bucket.buffer.copy_(bucket.extra["low"])
            if n > 1:
                bucket.buffer.div_(n)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the context reduces them all."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def step(self) -> None:
        self._finish()
        self.optimizer.step()
        self.buckets.zero()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()

    # -- accounting --------------------------------------------------------------------------
    def memory_ledger(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": self.buckets.nbytes(),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,
            "comm_buffers": sum(tensor_bytes([b.extra.get("low")]) for b in self.buckets.buckets),
        }
