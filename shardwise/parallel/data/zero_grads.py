"""ZeRO's gradients, shared by stages 1-3: staging buffers and their reduce-scatters, the
high-water marks of transient memory, the clipping hooks, fp16 loss-scale checks and the fp32
gradient each master steps with. A mixin of :class:`~shardwise.parallel.data.zero_base.ZeroBase`
(whose docstring states the rules: at most ``MAX_GRAD_BUFFERS`` whole-size buffers alive, a
staging buffer freed as soon as its reduce-scatter finishes, gradient shards alive only from
their reduce-scatter to the step).

Collectives: ``zero_grad_rs`` (reduce-scatter over the dp group, through the strategy's
Reducer, shardwise/comm/reducer.py), ``zero_clip`` (all-reduce of the squared norm), ``zero_overflow`` (fp16).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.flat import alloc_storage, free_storage, storage_bytes
from shardwise.memory.loss_scale import has_nonfinite
from shardwise.parallel.base import grad_sq
from shardwise.parallel.data.checks import UnusedParameters, unused_fix


class ZeroGradients:
    """Gradient staging, reduction, clipping and loss-scale checks for ZeroBase."""
    MAX_GRAD_BUFFERS = 2      # whole-size gradient buffers alive at once (filling + reducing)

    # -- gradients: staging and reduce-scatter (stages 2-3) -------------------------------
    def _stage_grad(self, c: Chunk, p: nn.Parameter) -> None:
        """Make sure ``p``'s gradient lives in its chunk's staging buffer (see the docstring)."""
        views = c.extra.get("views")
        if views is None:                  # the chunk's first gradient in this backward
            self._make_room()
            staging = c.layout.new_flat(dtype=self.dtype, device=self.device)
            self._alloc("staging", storage_bytes(staging))
            views = dict(zip(c.params, c.layout.views(staging)))
            for q, view in views.items():
                if q.grad is not None:
                    view.copy_(q.grad)
                q.grad = view              # autograd adds the rest in place
            c.extra.update(staging=staging, views=views)
        elif p.grad.data_ptr() != views[p].data_ptr():   # autograd replaced the view
            views[p].copy_(p.grad)
            p.grad = views[p]

    def _make_room(self) -> None:
        """Before a new staging buffer: wait for the oldest reductions until one slot is free."""
        filling = sum("views" in c.extra for c in self.chunks)
        while self._reducing and len(self._reducing) + filling >= self.MAX_GRAD_BUFFERS:
            self._retire(self._reducing.pop(0))

    def _reduce_staged(self, c: Chunk, async_op: bool | None = None) -> None:
        """The chunk's gradients are all in its staging buffer: drop the ``.grad`` views and
        reduce-scatter into ``grad_shard`` (or, when it already holds an accumulation
        micro-step's gradient, into a temporary added on completion). ``async_op`` None:
        ``overlap``; a blocking call frees the staging buffer (and the backend's copy) at once."""
        async_op = self.overlap if async_op is None else async_op
        staging = c.extra.pop("staging")
        c.extra.pop("views")
        for p in c.params:
            p.grad = None
        temp, mode = None, "add"
        away = c.grad_shard.device != staging.device     # offloaded from a GPU: host memory
        if not c.grad_valid and not self.grads_offloaded:   # the shard comes to life
            alloc_storage(c.grad_shard)
        if c.grad_valid or away:           # into a temporary, added (or copied) on completion
            temp = staging.new_empty(c.grad_shard.shape)
            mode = "add" if c.grad_valid else "into"
            self._alloc("staging", storage_bytes(temp))
        backend = self._backend_bytes(storage_bytes(staging))
        self._alloc("backend", backend)
        work = self._reduce_scatter(temp if temp is not None else c.grad_shard, staging,
                                    async_op=async_op)
        c.grad_valid = True
        self._reducing.append((c, work, temp, staging, mode, backend))
        if not async_op:
            self._retire(self._reducing.pop())      # already done: free the staging now

    def _retire(self, entry: tuple) -> None:
        """Wait for one reduce-scatter, fold its temporary in, free its buffers."""
        c, work, temp, staging, mode, backend = entry
        work.wait()
        self._release("backend", backend)
        if temp is not None:
            src = temp.to(c.grad_shard.device)            # a GPU's shard to the host store
            c.grad_shard.add_(src) if mode == "add" else c.grad_shard.copy_(src)
            self._release("staging", storage_bytes(temp))
        if staging is not None:
            self._release("staging", storage_bytes(staging))
        c.grad_valid = True
        if self.grads_offloaded:
            self.store.release([c.grad_shard])    # streams out: written back, dropped from RAM

    def _finish_reductions(self) -> None:
        """Phase 1: wait for every reduce-scatter, oldest first."""
        while self._reducing:
            self._retire(self._reducing.pop(0))

    def _check_all_ready(self) -> None:
        """ZeRO reduces a chunk only when all its gradients arrived: a parameter that got none
        would leave its chunk unreduced (and the update silently wrong), so stop instead."""
        missing = [c for c in self.chunks if c.trainable and not c.extra.get("readied", True)]
        if missing:
            got = set().union(*(c.extra.get("got", set()) for c in missing))
            unused = [n for n, p in self.model.named_parameters() if p.requires_grad and
                      id(p) not in got and any(p is q for c in missing for q in c.params)]
            raise UnusedParameters(self.name, unused, "parallel.zero_stage", self.stage, "ZeRO reduces a unit once all its "
                                   "gradients arrived, so it needs every parameter used in "
                                   "each forward", unused_fix(self.stage, self.group.size, 1))

    # -- clipping hooks (base.Strategy.clip_grad_norm_) -----------------------------------
    def _finish_grad_sync(self) -> None:
        self._check_all_ready()
        self._reduce_held()
        self._finish_reductions()             # idempotent: nothing left to wait for the 2nd time

    def _reduce_held(self) -> None:
        """Reduce what backward left whole, in chunk order on every rank: stages 2-3, a staging
        buffer kept under ``accumulate_unsharded`` (a pipeline's micro-batches); stage 1, a
        bucket no syncing backward launched (overlap off, or a driver that reduces after its
        backwards: interleaved chunks, tied weights)."""
        for c in self.chunks:
            if "staging" in c.extra:
                self._reduce_staged(c)
            elif self.stage == 1 and not c.grad_valid:
                self._launch(c)

    def _local_grad_sq(self) -> torch.Tensor:
        """Squares of this rank's gradient shards (disjoint over the dp group; padding is 0);
        offloaded shards are read one at a time and dropped again."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for c in self.chunks:
            if self.plan is None:
                sq += grad_sq([c.grad_shard], self.device)
            else:   # tensor parallel: tp-replicated entries are counted on tp rank 0 only
                sq += grad_sq([c.grad_shard[a:b] for a, b in self._counted(c)], self.device)
            if self.grads_offloaded:
                self.store.release([c.grad_shard], written=False)   # only read here
        return sq / (self.scale * self.scale) if self.scale != 1.0 else sq

    def _sum_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce(sq, self.group, op="sum", name="zero_clip")
        return sq if self.plan is None else self.plan.sum_sq(sq)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        self._grad_coef = coef if self._grad_coef is None else self._grad_coef * coef

    def _zero_grads(self) -> None:
        """Stages 2-3 free the gradient shards until the next backward fills them (so they do
        not sit beside the activations at the start of backward); stage 1 zeroes its buckets."""
        if self.grads_offloaded:
            return                          # they live in the store, out of RAM between uses
        for c in self.chunks:
            free_storage(c.grad_shard)

    def _grad_shard_bytes(self) -> int:
        """Bytes of every gradient shard while it lives (from the reduce-scatter to the step;
        always, in host memory, when offloaded from a GPU); 0 on disk (``on_disk`` has them)."""
        if self.grads_offloaded and self.store.place == "disk":
            return 0
        return sum(c.layout.shard_numel * c.shard.element_size() for c in self.chunks)

    def _master_grad(self, c: Chunk) -> torch.Tensor:
        """The chunk's fp32 gradient shard, unscaled (fp16) and clipped."""
        g = c.grad_shard
        if g.dtype != torch.float32 or g.device != c.master.device or self.scale != 1.0:
            g = g.to(c.master.device, torch.float32, copy=True)
            if self.scale != 1.0:
                g.div_(self.scale)
        if self._grad_coef is not None:
            g.mul_(self._grad_coef.to(g.device))   # grad_shard is stale after the step anyway
        return g

    def _grads_finite(self) -> bool:
        """fp16 only: skip the step (and halve the scale) when any rank saw inf / nan; one
        all-reduce over the whole world, so tensor-parallel peers agree too."""
        if not self.scaler.enabled:
            return True
        bad = has_nonfinite([c.grad_shard for c in self.chunks], self.device)
        self.comm.all_reduce(bad, self.mesh.world, op="max", name="zero_overflow")
        overflow = bad.item() > 0
        self.scaler.update(overflow)
        return not overflow
