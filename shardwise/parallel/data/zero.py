"""ZeRO: data parallelism that shards the training state over the N data-parallel ranks instead
of replicating it. Stages 1 and 2 are :class:`ZeroStrategy` (this file; the stage is a value,
``self.stage``); stage 3 is :class:`~shardwise.parallel.data.zero_stage3.Zero3Strategy`, the same
class with buckets replaced by units gathered just in time. Owned pieces: the transient-memory
book (zero_memory.py: ``self.memory``), the state dicts (zero_state.py, functions of the
strategy) and the user's parameter groups (zero_groups.py).

Reference: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020. P = parameter count; bytes per rank for Adam (two fp32 moments):

    stage   shards                         mixed precision (bf16/fp16)   fp32 (no master copy)
    DDP     nothing                        16P                           16P
    1       optimizer states (+ masters)   4P + 12P/N                    8P + 8P/N
    2       + gradients                    2P + 14P/N                    4P + 12P/N
    3       + parameters                   16P/N                         16P/N

Traffic per step (K = bytes of the flat parameters, padded): stages 1 and 2 reduce-scatter the
gradients ((N-1)/N K) and all-gather the updated parameters ((N-1)/N K): 2(N-1)/N K, the volume
of one DDP allreduce. Stage 3 all-gathers each unit before its forward and again before its
backward, and reduce-scatters its gradients: 3(N-1)/N K, 1.5x DDP. Padding: each chunk is
rounded up to a multiple of N elements (at most N-1 extra per chunk). The collectives go
through the data-parallel reducer (comm/reducer.py, ``parallel.allreduce``): the backend's, the
ring, or, between the polling ranks of one CPU host (``auto``'s choice there), shared memory
(comm/shm.py), which copies nothing whole and runs on the calling thread.

Chunks. A :class:`Chunk` is one flat, padded group of the model's *trainable* parameters (a
gradient bucket in stages 1-2, about ``parallel.bucket_mb`` each, parameters in reverse order
since backward produces the last layers' gradients first; a unit such as one transformer block
in stage 3; shardwise/comm/flat.py). Rank r of the N data-parallel ranks owns slice r of every
chunk: its working-precision ``shard``, its reduced gradient ``grad_shard`` and the fp32
``master`` that the optimizer updates.

Parameter groups: the user's optimizer factory is called once on the original trainable
parameters (a probe, which allocates no state; zero_groups.py); each chunk lays its parameters
out group by group, and the real optimizer (``type(probe)(groups, **probe.defaults)``) gets, per
group, the views of the masters that hold that group's elements (shardwise/comm/flat.shard_runs).
So any per-group option (weight decay, lr) applies to exactly the elements it applies to in
single-process training. Frozen parameters (requires_grad False) are in no chunk: every rank
keeps them whole, they are never communicated after the start, never stepped and hold no
optimizer state (bit-for-bit unchanged, whatever the weight decay). Stage 3 does not shard them.

Start: dp rank 0's parameters and buffers are broadcast before anything is sharded, so ranks
that initialised differently train identically; not when every rank made them from the seed (a
meta-device build, models/init.py: ``deterministic_start``), where ZeRO-3 makes one unit at a
time, keeps its shard and drops the rest, so no rank ever holds the whole model. Buffers (e.g.
BatchNorm running statistics) are broadcast from dp rank 0 after every step: they follow rank
0's shard statistics, as torch DDP's ``broadcast_buffers`` does.

Gradients. Stage 1 keeps whole gradients in one flat buffer per bucket: a step's first gradient
of each parameter, autograd's own fresh tensor, is copied into its view of the bucket, which
then becomes ``p.grad`` (later micro-batches accumulate into it in place); after the step the
views are dropped, not zeroed, so the next copy is the only pass over them. When a bucket's last
gradient arrives (post-accumulate-grad hooks; during backward with ``overlap``, after it
without) its reduce-scatter starts; inside ``no_sync`` nothing is sent and gradients accumulate.
Stages 2-3 give a chunk a staging buffer (not zeroed: only its padding) on its first gradient in
a backward; each parameter's gradient is copied into its view of it as it comes, and the view
becomes its ``.grad``. When its last gradient arrives, they reduce-scatter it into the 1/N
gradient shard and free it as soon as that finishes. At most ``MAX_GRAD_BUFFERS`` (2) whole-size
buffers live at once (one filling, one reducing): opening a third waits for the oldest
reduction. Inside ``no_sync`` stage 2 still reduce-scatters each micro-step, into the
accumulating shard; with ``overlap`` off the reduce-scatter blocks, but still runs when the
bucket is ready. Gradient shards live from their reduce-scatter to the
step. Buckets launch in index order on every rank.

The step, in three phases (nanoGPT's shape; one rank runs it unchanged): (1) wait for the
reduce-scatters; (2) for each chunk, step the optimizer on its fp32 master shard (the other
masters' ``.grad`` are None, so torch.optim skips them: the math equals one step over all of
them), copy the result into the working shard and start the bucket's all-gather (stages 1-2);
(3) wait for the all-gathers. With disk offload only the chunk being stepped and the next one
(read ahead on the store's thread) are resident. World size 1: every collective is a copy and
the result is plain training.

Masters: in fp32 without offload the master *is* the shard (a view, no copy), and so it is with
``--offload-params`` (stage 3), where the shard itself lives in the store. With bf16 / fp16
working copies, or with offload of the optimizer only, the master is a separate fp32 tensor in the
:class:`~shardwise.memory.offload.OffloadStore` (device, CPU or disk), initialised from the fp32
weights before they are cast. fp16 uses dynamic loss scaling (2^16, halved and the step skipped
on inf/nan, doubled after 1000 clean steps). Clipping (base.Strategy.clip_grad_norm_): squares of
the gradient shards summed over the dp group; the coefficient is applied in fp32 as each master's
gradient is formed. Meter names: ``zero_grad_rs``, ``zero_param_ag`` (training), ``zero_eval_ag``,
``zero_state_ag``, ``zero_overflow``, ``zero_clip``, ``zero_broadcast`` (start), ``zero_buffers``.

Replica groups (``--ft-replicas``, parallel/replicas.py; its hook is ``self.ft``, apart from
HSDP's ``self.replicas`` group): phase 1 ends by averaging this rank's gradient shards over the
same in-group rank of every live group (once a step; 4K/N bytes through one allreduce), and a
failed vote there raises Redo before anything else read them: :meth:`zero_grad` drops the step's
gradients and the step is taken again. The join's state copy is :meth:`state_dict`, shard by
shard (in-group rank r to in-group rank r). Groups of different sizes (``--ft-rejoin-nproc``):
the hook has the strategy gather its gradient shards into whole chunks on the group's leader
and scatter the sum back (:meth:`gather_grad_shards`, :meth:`scatter_grad_shards`; clipping then takes the
whole gradient's squares), and a joiner loads :meth:`layout_free_state` (zero_resize.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from shardwise.comm.buckets import broadcast_coalesced, plan_buckets
from shardwise.comm.flat import (FlatLayout, alloc_storage, free_storage, shard_runs,
                                 storage_bytes)
from shardwise.comm.reducer import Reducer
from shardwise.memory.amp import DTYPES
from shardwise.memory.loss_scale import has_nonfinite
from shardwise.memory.offload import OffloadStore, prefill_adam_state
from shardwise.models.init import swap_in
from shardwise.parallel.base import Strategy, grad_sq, optimizer_state_bytes, tensor_bytes
from shardwise.parallel.data import zero_resize, zero_state
from shardwise.parallel.data.checks import UnusedParameters, unused_fix
from shardwise.parallel.data.zero_groups import ParamGroups
from shardwise.parallel.data.zero_memory import ZeroMemory
from shardwise.parallel.presets import zero_stage


@dataclass(eq=False)
class Chunk:
    """One flat group of parameters and this rank's pieces of it (see the module docstring)."""
    layout: FlatLayout
    params: list[nn.Parameter]
    shard: torch.Tensor                     # (padded/N,) working dtype: this rank's parameters
    master: torch.Tensor                    # (padded/N,) fp32: what the optimizer updates
    masters: list = field(default_factory=list)   # (group, lo, hi, Parameter view of master)
    full: torch.Tensor | None = None        # (padded,) working dtype: the whole chunk, when held
    grad_shard: torch.Tensor | None = None  # (padded/N,) working dtype: reduced gradient
    grad_full: torch.Tensor | None = None   # (padded,) stage 1 only: the whole gradient
    grad_valid: bool = False                # grad_shard holds (or receives) this step's gradient
    pending: int = 0                        # gradients still to arrive in this backward
    trainable: int = 0                      # parameters that receive a gradient
    extra: dict = field(default_factory=dict)


class ZeroStrategy(Strategy):
    """ZeRO-1 and ZeRO-2 (``stage`` 1 or 2, from the config): whole parameters on every rank,
    flat buckets, sharded optimizer; at stage 2 sharded gradients too.

    Partition: rank r owns slice r of each bucket's optimizer state and fp32 masters (stage 2:
    and of its reduced gradients). Collectives: reduce-scatter of each bucket's gradients as it
    fills (stage 1 during backward with overlap; stage 2 always as soon as it is ready, from a
    staging buffer freed when that finishes), then all-gather of the updated parameters after
    the step. Memory per rank (Adam): stage 1 mixed precision 4P + 12P/N, fp32 8P + 8P/N; stage
    2 mixed precision 2P + 14P/N, fp32 4P + 12P/N, plus at most two whole-size bucket buffers
    (``comm_buffers``, the high-water mark). Traffic per step: 2(N-1)/N K, as DDP. Reference:
    ZeRO (SC 2020), "P_os" and "P_os+g".

    Reads top to bottom: set-up (chunks, optimizer), backward (hooks, staging, reduce-scatter),
    the step's three phases, then state and memory.
    """
    stages = (1, 2)       # the stages this class runs (Zero3Strategy: 3)
    materializer = None   # ZeRO-3 on a meta-device model: its units are made as they are sharded
    MAX_GRAD_BUFFERS = 2  # whole-size gradient buffers alive at once (filling + reducing)
    MAX_GATHERS = 2       # all-gathers in flight at once after the step (each holds a backend copy)

    def __init__(self, cfg, mesh, comm, device, loss_fn):
        super().__init__(cfg, mesh, comm, device, loss_fn)
        self.stage = zero_stage(cfg)
        if self.stage not in self.stages:
            raise ValueError(f"{type(self).__name__} runs ZeRO stages {self.stages}, not "
                             f"{self.stage}; fix: shardwise.parallel.data.stage_class({self.stage})")
        self.name = f"zero{self.stage}"
        # HSDP (mesh.build's dp_shard): shard over the shard group, all-reduce the reduced
        # gradient shards over the replica group; else the whole dp axis shards, no replicas
        self.group = mesh.group("dp_shard") if "dp_shard" in mesh.shape else mesh.grad_group
        self.replicas = mesh.group("dp_replicate")
        self.dtype = DTYPES.get(cfg.memory.mixed_precision, torch.float32)   # "no": fp32
        self.overlap = cfg.parallel.overlap
        self.chunks: list[Chunk] = []
        self.store = OffloadStore(cfg.memory.offload, device, cfg.memory.offload_dir,
                                  tag=f"rank{mesh.rank}")
        # --offload-params (stage 3): parameter shards live in the store; reduced gradients
        # too, unless the store is this CPU run's own memory (then they stay transient)
        self.params_offloaded = (self.stage == 3 and cfg.memory.offload_params
                                 and self.store.place != "none")
        self.grads_offloaded = self.params_offloaded and (self.store.place == "disk"
                                                          or device.type != "cpu")
        self.collectives = Reducer(comm, self.group, cfg.parallel.allreduce, device)
        self._ring = self.collectives.ring
        # transient buffers (zero_memory.py): gloo's native collectives copy their whole buffer
        self.memory = ZeroMemory(self._note_instant, backend_copies=self._backend_copies)
        self._region_counted = False                   # the shared-memory region, once
        self._syncing = True
        self._ag_name = "zero_param_ag"
        self._grad_coef = None                         # clipping coefficient of this step
        self._reducing: list[tuple] = []               # (chunk, work, temp, staging, mode, backend)
        self._gathers: list[tuple] = []                # stages 1-2: (work, backend) after the step
        self._next = 0                                 # stages 1-2: next bucket to launch
        self._ft_reduced = False                       # --ft-replicas: shards averaged
        self._whole_sq = None       # --ft-rejoin-nproc: the summed whole gradient's squares

    # -- set-up: chunks and the optimizer -------------------------------------------------
    def wrap(self, model, optimizer_factory) -> None:
        """Buckets of about ``parallel.bucket_mb`` (last parameters first), each a chunk whose
        whole parameters every rank keeps; then the optimizer over the master shards."""
        params = self._adopt(model, optimizer_factory)          # registration order
        sizes = [p.numel() * self.dtype.itemsize for p in params]  # working-precision bytes
        for idx in plan_buckets(sizes, self.cfg.parallel.bucket_mb * 2**20):   # last first
            c = self._make_chunk([params[i] for i in idx], full_sharded=False)
            self._init_grads(c)
            self.chunks.append(c)
        self._build_optimizer()

    def _plan_disk_writes(self, elements: int) -> None:
        """Disk offload: sync written chunks at once or leave them to the kernel
        (``memory.offload_sync``), from what this machine's ranks offload: ``elements``
        trainable elements x the bytes each keeps on disk / the shard group x the ranks here
        (torchrun's LOCAL_WORLD_SIZE, else the whole world)."""
        import os
        from shardwise.memory.checks import offload_bytes_per_element
        here = int(os.environ.get("LOCAL_WORLD_SIZE", self.mesh.world_size))
        per_rank = elements * offload_bytes_per_element(self.cfg) // self.group.size
        self.store.plan_writes(self.cfg.memory.offload_sync, per_rank * here)

    def _adopt(self, model: nn.Module, optimizer_factory) -> list[nn.Parameter]:
        """Take the model, start every rank from dp rank 0's state (unless every rank made it
        from the seed: ``deterministic_start``), learn the user's parameter groups; return the
        trainable parameters (frozen ones stay plain, whole tensors). ZeRO-3 on a meta-device
        model (``materializer``): buffers and frozen weights, kept whole, are made now; the
        trainable ones stay on the meta device until their unit is sharded (zero_stage3.py)."""
        if self.materializer is not None:
            self.materializer.fill([*model.buffers(),
                                    *(p for p in model.parameters() if not p.requires_grad)])
        self.model = model._apply(lambda t: t if t.is_meta else t.to(self.device))
        if not self.deterministic_start:
            broadcast_coalesced(self.comm, [*self.model.parameters(), *self.model.buffers()], 0,
                                self.mesh.grad_group, name="zero_broadcast")
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._plan_disk_writes(sum(p.numel() for _, p in named))
        self._groups = ParamGroups.probe(optimizer_factory, named)
        self.frozen = [p for p in self.model.parameters() if not p.requires_grad]
        if self.dtype != torch.float32:        # frozen weights and float buffers join the
            for t in [*self.frozen, *self.model.buffers()]:   # working precision (module.to)
                if t.is_floating_point():
                    t.data = t.data.to(self.dtype)
        return [p for _, p in named]

    def _make_chunk(self, params: list[nn.Parameter], full_sharded: bool) -> Chunk:
        """Flatten ``params`` group by group; keep the whole chunk (stages 1-2) or only this
        rank's shard (3)."""
        params = sorted(params, key=self._groups.index.__getitem__)   # stable: one run a group
        layout = FlatLayout.of(params, self.group.size)
        rank = self.group.rank
        if full_sharded:   # stage 3: own a copy of the shard; the whole chunk is gathered on use
            own = _own_slice(layout, params, rank, self.device,   # not the whole flat copy
                             self.materializer)
            full = torch.empty(layout.padded, dtype=self.dtype, device=self.device)
            if self.params_offloaded:              # in the store (pinned host memory on CUDA)
                shard = self.store.zeros(layout.shard_numel, self.dtype, pin=True)
                shard.copy_(own)
            else:
                shard = own if self.dtype == torch.float32 else own.to(self.dtype)
        else:
            fp32 = layout.new_flat([p.detach() for p in params], torch.float32, self.device)
            own = layout.shard(fp32, rank)
            full = fp32 if self.dtype == torch.float32 else fp32.to(self.dtype)
            shard = layout.shard(full, rank)
        for p, view in zip(params, layout.views(full)):
            if p.is_meta:   # ZeRO-3 on a meta-device model (its values are in ``own``): off
                swap_in(p, view.new_empty(0))   # meta first; not swapped for the view itself,
            p.data = view       # whose version counter (full's) gathers bump under autograd
        if self.dtype == torch.float32 and (self.store.place == "none" or self.params_offloaded):
            master = shard                               # the shard itself: no copy in fp32
        else:
            master = self.store.zeros(layout.shard_numel, pin=True)   # copied each step
            master.copy_(own)                            # from fp32 weights, before any cast
        groups = [self._groups.index[p] for p in params]
        masters = [(g, lo, hi, nn.Parameter(master[lo:hi]))
                   for g, lo, hi in shard_runs(layout, groups, rank)]
        return Chunk(layout, params, shard, master, masters, full=full,
                     trainable=len(params), pending=len(params))

    def _init_grads(self, c: Chunk) -> None:
        """Stage 1: a whole gradient bucket, ``p.grad`` views of it (dropped after each step
        and copied into by the next backward: _bucket_grad) and the shard a slice of it.
        Stage 2: a gradient shard, its storage freed (alive from its reduce-scatter to the
        step)."""
        if self.stage == 1:
            c.grad_full = c.layout.new_flat(dtype=self.dtype, device=self.device)
            c.grad_shard = c.layout.shard(c.grad_full, self.group.rank)
            c.extra["grad_views"] = dict(zip(c.params, c.layout.views(c.grad_full)))
            for p, view in c.extra["grad_views"].items():
                p.grad = view
        else:
            c.grad_shard = c.shard.new_zeros(c.shard.shape)
            free_storage(c.grad_shard)

    def _build_optimizer(self) -> None:
        groups = [{**options, "params": []} for options in self._groups.options]
        for c in self.chunks:
            for g, _, _, view in c.masters:
                groups[g]["params"].append(view)
        self.optimizer = self._groups.cls(groups, **self._groups.defaults)
        prefill_adam_state(self.optimizer, self.store)
        # a user's loop: optimizer.step() is the strategy's step (reduce, update each chunk,
        # gather; gradients dropped), and zero_grad has nothing left to drop; inside, the
        # chunked step calls the class's own step (_optimizer_step)
        self.optimizer.step = lambda closure=None: self._user_step(closure)
        self.optimizer.zero_grad = lambda set_to_none=True: None
        self._chunk_of = {p: i for i, c in enumerate(self.chunks) for p in c.params}
        for p in self._chunk_of:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # -- forward and backward -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The model's forward; floating inputs are cast to the working dtype (as FSDP's
        ``cast_forward_inputs``) and floating outputs back to fp32, in any nested structure."""
        low = self.dtype != torch.float32
        if low:
            args, kwargs = tree_map(lambda t: _cast(t, self.dtype), (args, kwargs))
        if not torch.is_grad_enabled():
            out = self.model(*args, **kwargs)
        else:
            self.begin_pass()            # a new backward: count every chunk's gradients afresh
            with self._measure_activations():
                out = self.model(*args, **kwargs)
        return tree_map(lambda t: _cast(t, torch.float32), out) if low else out

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scaled(loss).backward()        # fp16: times S (memory/loss_scale.py)
        self._after_backward()

    # the gradient-sync contract for a driver of its own (parallel/pipeline/driver.py)
    def begin_pass(self) -> None:
        """Count every chunk's gradients afresh; no bucket is ready or launched yet."""
        for c in self.chunks:
            c.pending, c.extra["readied"], c.extra["got"] = c.trainable, False, set()
            c.extra["ready"] = False
        self._next = 0

    def before_backward(self, last: bool) -> None:
        """Only the step's last backward reduces as its chunks fill; with
        ``accumulate_unsharded`` the earlier ones keep whole gradients (stage 1: its buckets;
        stages 2-3: their staging buffers) and ``_finish_grad_sync`` reduces what is left."""
        self._syncing = last

    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def grad_dtype(self) -> torch.dtype:
        return self.dtype

    def _on_grad(self, p: nn.Parameter) -> None:
        """Autograd finished accumulating ``p.grad``: count it towards its chunk."""
        c = self.chunks[self._chunk_of[p]]
        c.extra.setdefault("got", set()).add(id(p))     # named when a chunk stays unready
        if self.stage >= 2:
            self._stage_grad(c, p)
        else:
            self._bucket_grad(c, p)
        c.pending -= 1
        if c.pending == 0:
            c.pending = c.trainable
            c.extra["readied"] = True
            self._chunk_ready(self._chunk_of[p])

    @torch.no_grad()
    def _bucket_grad(self, c: Chunk, p: nn.Parameter) -> None:
        """Stage 1: ``p``'s gradient into its view of the bucket. Between steps the ``.grad``
        views are dropped (_zero_grads), so a step's first gradient is autograd's own fresh
        tensor, copied in once; later micro-batches accumulate into the view in place."""
        view = c.extra["grad_views"][p]
        if p.grad is not view:
            view.copy_(p.grad)
            p.grad = view

    def _stage_grad(self, c: Chunk, p: nn.Parameter) -> None:
        """Stages 2-3: make sure ``p``'s gradient lives in its chunk's staging buffer."""
        views = c.extra.get("views")
        if views is None:                  # the chunk's first gradient in this backward
            self._make_room()
            # not zeroed: every parameter's first gradient is copied into its view (below, as
            # its hook runs), so only the padding needs zeros (one pass, not a fill and an
            # in-place add)
            staging = torch.empty(c.layout.padded, dtype=self.dtype, device=self.device)
            staging[c.layout.numel:].zero_()
            self.memory.alloc("staging", storage_bytes(staging))
            views = dict(zip(c.params, c.layout.views(staging)))
            for q, view in views.items():
                if q is not p and q.grad is not None:   # from before this backward
                    view.copy_(q.grad)
                    q.grad = view          # autograd adds to it in place
            c.extra.update(staging=staging, views=views)
        if p.grad.data_ptr() != views[p].data_ptr():   # autograd's own fresh gradient
            views[p].copy_(p.grad)
            p.grad = views[p]

    def _make_room(self) -> None:
        """Before a new staging buffer: wait for the oldest reductions until one slot is free."""
        filling = sum("views" in c.extra for c in self.chunks)
        while self._reducing and len(self._reducing) + filling >= self.MAX_GRAD_BUFFERS:
            self._retire(self._reducing.pop(0))

    def _chunk_ready(self, index: int) -> None:
        """A bucket's gradients are all in: mark it ready and launch the ready buckets in index
        order (the same on every rank). Stage 1 sends nothing inside ``no_sync`` (its buckets
        keep accumulating) and, with ``overlap`` off, leaves the launch to _after_backward.
        Stage 2 launches now even with overlap off (the collective then blocks): a ready
        bucket's staging buffer is freed at once instead of waiting for the end of backward;
        under a pipeline (``accumulate_unsharded``) only the step's last backward launches, the
        earlier micro-batches accumulating into the whole staging buffer."""
        if not self._syncing and (self.stage == 1 or self.accumulate_unsharded):
            return
        self.chunks[index].extra["ready"] = True
        if self.overlap or self.stage == 2:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.chunks) and self.chunks[self._next].extra.get("ready"):
            c = self.chunks[self._next]
            c.extra["ready"] = False
            self._next += 1
            self._launch(c)

    def _launch(self, c: Chunk) -> None:
        """Start the bucket's reduce-scatter: stage 2 from its staging buffer; stage 1 from its
        whole gradient bucket, which stays (the ring reduces it in place, its own slice being
        the answer; the backend may not write its input, so it reduces into a temporary)."""
        if self.stage == 2:
            self._reduce_staged(c)
            return
        c.grad_valid = True                    # launched this step (_reduce_held skips it)
        if self._ring is not None:
            work = self._reduce_scatter(c.grad_shard, c.grad_full, async_op=True)
            self._reducing.append((c, work, None, None, "into", 0))
        else:
            temp = c.grad_shard.new_empty(c.grad_shard.shape)
            self.memory.alloc("staging", storage_bytes(temp))
            backend = self.memory.backend_bytes(storage_bytes(c.grad_full))
            self.memory.alloc("backend", backend)
            work = self._reduce_scatter(temp, c.grad_full, async_op=self.overlap)
            self._reducing.append((c, work, temp, None, "copy", backend))

    def _reduce_staged(self, c: Chunk, async_op: bool | None = None) -> None:
        """Stages 2-3: the chunk's gradients are all in its staging buffer: drop the ``.grad``
        views and reduce-scatter into ``grad_shard`` (or, when it already holds an accumulation
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
            self.memory.alloc("staging", storage_bytes(temp))
        backend = self.memory.backend_bytes(storage_bytes(staging))
        self.memory.alloc("backend", backend)
        work = self._reduce_scatter(temp if temp is not None else c.grad_shard, staging,
                                    async_op=async_op)
        c.grad_valid = True
        self._reducing.append((c, work, temp, staging, mode, backend))
        if not async_op:
            self._retire(self._reducing.pop())      # already done: free the staging now

    def _backend_copies(self) -> bool:
        """Whether this group's reduce-scatters and all-gathers go through gloo's native
        collectives, which copy the whole buffer; the ring, shared memory (comm/shm.py) and a
        group of one do not. The first call decides the shared-memory path (a collective: every
        rank asks before its first reduce-scatter or all-gather) and accounts its region, which
        lives as long as the strategy."""
        if self._ring is not None or self.group.size == 1 or self.device.type != "cpu":
            return False
        if not self.collectives.shared_memory():
            return True
        if not self._region_counted:
            self._region_counted = True
            self.memory.alloc("shared", self.collectives.nbytes())
        return False

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool):
        """out = the dp axis's average of slice ``rank`` of ``inp`` (inp may be overwritten):
        the shard group's reduce-scatter, then, under HSDP, an all-reduce of the shard over the
        replica group (1/S of the bucket, on the waiter's thread once the first is done)."""
        work = self.collectives.reduce_scatter(out, inp, async_op, "zero_grad_rs")
        if self.replicas.size == 1:
            return work

        def across_replicas() -> None:
            self.comm.all_reduce(out, self.replicas, op="avg", name="hsdp_grad_ar")
        if not async_op:
            work.wait()
            across_replicas()
            return work
        return _Then(work, across_replicas)

    def _retire(self, entry: tuple) -> None:
        """Wait for one reduce-scatter, fold its temporary in, free its buffers."""
        c, work, temp, staging, mode, backend = entry
        work.wait()
        self.memory.release("backend", backend)
        if temp is not None:
            src = temp.to(c.grad_shard.device)            # a GPU's shard to the host store
            c.grad_shard.add_(src) if mode == "add" else c.grad_shard.copy_(src)
            self.memory.release("staging", storage_bytes(temp))
        if staging is not None:
            self.memory.release("staging", storage_bytes(staging))
        c.grad_valid = True
        if self.grads_offloaded:
            self.store.release([c.grad_shard])    # streams out: written back, dropped from RAM

    def _after_backward(self) -> None:
        """Launch what the hooks left (stage 1 with overlap off: every bucket); inside
        ``no_sync`` stages 2-3 finish this micro-step's reductions into the shard now."""
        self._launch_ready()
        self._next = 0
        if not self._syncing and self.stage >= 2:
            self._finish_reductions()

    # -- the step: three phases ---------------------------------------------------------
    def step(self) -> None:
        """(1) wait for the reduce-scatters; (2) update each chunk's masters, copy them into
        its shard and launch its all-gather; gradients dropped, buffers synced; (3) wait for
        the all-gathers (stages 1-2; stage 3 gathers on use)."""
        self._finish_grad_sync()                   # 1 (also clip_grad_norm_'s first move)
        if self._grads_finite():                   # fp16: every rank skips on inf / nan
            self._optimizer_step()                 # 2
        for c in self.chunks:
            c.grad_valid = False
        self._grad_coef = None
        self._ft_reduced, self._whole_sq = False, None
        self._zero_grads()
        self._sync_buffers()
        self._finish_gathers()                     # 3

    def _user_step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{self.name}: optimizer.step(closure) is not supported (the step "
                             "runs chunk by chunk); fix: call backward yourself, then step()")
        self.step()

    # phase 1: every gradient shard reduced
    def _finish_grad_sync(self) -> None:
        """Every reduce-scatter finished; under ``--ft-replicas`` the shards then averaged over
        the live replica groups (once a step, before clipping, the fp16 verdict and the
        optimizer read them: parallel/replicas.py), which raises Redo when a member failed."""
        self._check_all_ready()
        self._reduce_held()
        self._finish_reductions()             # idempotent: nothing left to wait for the 2nd time
        if self.ft is not None and not self._ft_reduced:
            self.ft.reduce([c.grad_shard for c in self.chunks])   # in-group rank r's shards
            self._ft_reduced = True

    # --ft-rejoin-nproc: replica groups of different sizes (zero_resize.py)
    def gather_grad_shards(self) -> list[torch.Tensor] | None:
        """On the gradient group's rank 0, each chunk's whole reduced gradient, unpadded (the
        shard group's ranks send it theirs); None elsewhere."""
        return zero_resize.gather_grads(self)

    def scatter_grad_shards(self, wholes: list[torch.Tensor] | None) -> None:
        """Every rank's slices of the summed ``wholes`` (given on rank 0) into its gradient
        shards; clipping then uses the whole gradient's squares (the same norm in groups of
        any size)."""
        self._whole_sq = zero_resize.scatter_grads(self, wholes)

    def layout_free_state(self, keep: bool = True) -> dict:
        return zero_resize.layout_free_state(self, keep)

    def load_layout_free_state(self, state: dict) -> None:
        zero_resize.load_layout_free_state(self, state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients before the optimizer saw them (``--ft-replicas``' Redo:
        the same step is then taken again): reductions waited, staging buffers and gradient
        shards dropped, no optimizer state or parameter touched. (``set_to_none`` is
        accepted and ignored; ``optimizer.zero_grad`` stays the no-op of _build_optimizer.)"""
        self._finish_reductions()
        for c in self.chunks:
            staging = c.extra.pop("staging", None)
            if staging is not None:               # stages 2-3: the .grad views go with it
                self.memory.release("staging", storage_bytes(staging))
                for p in c.params:
                    p.grad = None
            c.extra.pop("views", None)
            c.grad_valid = False
        self._grad_coef, self._ft_reduced, self._next = None, False, 0
        self._whole_sq = None
        self._zero_grads()

    def _check_all_ready(self) -> None:
        """ZeRO reduces a chunk only when all its gradients arrived: a parameter that got none
        would leave its chunk unreduced (and the update silently wrong), so stop instead."""
        missing = [c for c in self.chunks if c.trainable and not c.extra.get("readied", True)]
        if missing:
            got = set().union(*(c.extra.get("got", set()) for c in missing))
            unused = [n for n, p in self.model.named_parameters() if p.requires_grad and
                      id(p) not in got and any(p is q for c in missing for q in c.params)]
            raise UnusedParameters(self.name, unused, "parallel.zero_stage", self.stage,
                                   "ZeRO reduces a unit once all its gradients arrived, so it "
                                   "needs every parameter used in each forward",
                                   unused_fix(self.stage, self.group.size, 1))

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

    def _finish_reductions(self) -> None:
        """Wait for every reduce-scatter, oldest first."""
        while self._reducing:
            self._retire(self._reducing.pop(0))

    # between phases 1 and 2: clipping (base.Strategy.clip_grad_norm_) and the fp16 verdict
    def _local_grad_sq(self) -> torch.Tensor:
        """Squares of this rank's gradient shards (disjoint over the dp group; padding is 0);
        offloaded shards are read one at a time and dropped again. Replica groups of
        different sizes: the whole gradient's squares (scatter_grad_shards), already global."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        chunks = self.chunks
        if self._whole_sq is not None:        # every shard's entries in it already
            sq, chunks = sq + self._whole_sq, []
        for c in chunks:
            if self.plan is None:
                sq += grad_sq([c.grad_shard], self.device)
            else:   # tensor parallel: tp-replicated entries are counted on tp rank 0 only
                sq += grad_sq([c.grad_shard[a:b] for a, b in self._counted(c)], self.device)
            if self.grads_offloaded:
                self.store.release([c.grad_shard], written=False)   # only read here
        return sq / (self.scale * self.scale) if self.scale != 1.0 else sq

    def _counted(self, c: Chunk) -> list[tuple[int, int]]:
        """[a, b) ranges of this rank's shard of ``c`` whose squares it adds to the global norm
        under tensor parallelism (self.plan: split parameters always, replicated on tp rank 0)."""
        if "counted" not in c.extra:
            names = {p: n for n, p in self.model.named_parameters()}
            lo, hi = c.layout.shard_range(self.group.rank)
            ranges = []
            for p, offset in zip(c.params, c.layout.offsets):
                a, b = max(offset, lo), min(offset + p.numel(), hi)
                if a < b and self.plan.counts(names[p]):
                    ranges.append((a - lo, b - lo))
            c.extra["counted"] = ranges
        return c.extra["counted"]

    def _sum_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        if self._whole_sq is None:         # (the whole gradient's: nothing to sum over dp)
            self.comm.all_reduce(sq, self.group, op="sum", name="zero_clip")
        return sq if self.plan is None else self.plan.sum_sq(sq)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        self._grad_coef = coef if self._grad_coef is None else self._grad_coef * coef

    @property
    def scale(self) -> float:
        """fp16's loss scale S (1.0 otherwise); the shards are unscaled in _master_grad."""
        return self.scaler.scale

    def _overflowed(self) -> bool:
        """ZeRO takes the fp16 verdict in its own step, on the gradient shards (_grads_finite)."""
        return False

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

    # phase 2: each chunk stepped, its gather launched
    @torch.no_grad()
    def _optimizer_step(self) -> None:
        """Update each chunk's masters, copy into the shard, start its gather. With disk
        offload the next chunk's state is read in on the store's thread while this chunk
        steps, and each stepped chunk is written back there (memory/offload.py)."""
        if self.chunks:
            self._read_ahead(self.chunks[0])
        for i, c in enumerate(self.chunks):
            if i + 1 < len(self.chunks):
                self._read_ahead(self.chunks[i + 1])
            g = self._master_grad(c)
            for _, lo, hi, view in c.masters:
                view.grad = g[lo:hi]
            type(self.optimizer).step(self.optimizer)      # only this chunk's masters have .grad
            states = []
            for _, _, _, view in c.masters:
                view.grad = None
                state = self.optimizer.state.get(view, {})
                self.store.adopt_state(state)
                states += [v for v in state.values() if torch.is_tensor(v)]
            if c.master.data_ptr() != c.shard.data_ptr():   # fp32 -> working dtype / device
                self.store.to_device(c.shard, c.master)       # non-blocking on CUDA
            self.store.release([c.master, c.shard, *states])
            self.store.release([c.grad_shard], written=False)   # spent: the next backward
            self._launch_gather(i)
        self.store.wait_copies()        # the masters may be written again (offload.py)

    def _read_ahead(self, c: Chunk) -> None:
        """Disk offload: the chunk's state (overwritten by its step) and gradient shard (read)."""
        self.store.prefetch(self._chunk_state(c), write=True)
        self.store.prefetch([c.grad_shard])

    def _chunk_state(self, c: Chunk) -> list[torch.Tensor]:
        """The chunk's tensors the step writes: master, shard and every optimizer state of
        its master views (what the disk tier reads ahead, then writes back and drops)."""
        out = [c.master, c.shard]
        for _, _, _, view in c.masters:
            out += [v for v in self.optimizer.state.get(view, {}).values()
                    if torch.is_tensor(v) and v.dim() > 0]
        return out

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

    def _launch_gather(self, index: int) -> None:
        """Start the bucket's all-gather; with the oldest waited first when ``MAX_GATHERS`` are
        in flight, since gloo keeps a whole-bucket temporary alive until each is waited."""
        c = self.chunks[index]
        while len(self._gathers) >= self.MAX_GATHERS:
            self._wait_oldest_gather()
        backend = self.memory.backend_bytes(storage_bytes(c.full))
        self.memory.alloc("backend", backend)
        self._gathers.append((self._all_gather(c.full, c.shard, async_op=self.overlap), backend))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                    name: str | None = None):
        return self.collectives.all_gather(out, inp, async_op, name or self._ag_name)

    def _zero_grads(self) -> None:
        """Stage 1 drops its ``.grad`` views (the buckets stay; the next backward copies its
        fresh gradients in: one pass, where zeroing the buckets and accumulating into them in
        place took three); stages 2-3 free the gradient shards until the next backward fills
        them (so they do not sit beside the activations at the start of backward), unless they
        live in the store, out of RAM between uses."""
        if self.stage == 1:
            for c in self.chunks:
                for p in c.params:
                    p.grad = None
        elif not self.grads_offloaded:
            for c in self.chunks:
                free_storage(c.grad_shard)

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Every rank takes dp rank 0's buffers (one broadcast per dtype)."""
        buffers = list(self.model.buffers())
        if not buffers or self.group.size == 1:
            return
        for dtype in {b.dtype for b in buffers}:
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            self.comm.broadcast(flat, 0, self.group, name="zero_buffers")
            for b, piece in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(piece.view_as(b))

    # phase 3: every rank holds the whole updated parameters again
    def _finish_gathers(self) -> None:
        while self._gathers:
            self._wait_oldest_gather()

    def _wait_oldest_gather(self) -> None:
        work, backend = self._gathers.pop(0)
        work.wait()
        self.memory.release("backend", backend)

    # -- evaluation, close ----------------------------------------------------------------
    def evaluate(self, x, y):
        self._ag_name = "zero_eval_ag"
        try:
            return super().evaluate(x, y)
        finally:
            self._ag_name = "zero_param_ag"

    def close(self) -> None:
        self.collectives.close()
        self.store.close()

    # -- state (zero_state.py; shardwise/checkpoint/ and the pipeline driver call these) ---
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return zero_state.full_state_dict(self)

    def full_state_order(self) -> list[tuple[str, tuple[int, ...]]] | None:
        return zero_state.full_state_order(self)

    def full_state_groups(self):
        return zero_state.full_state_groups(self)

    def state_dict(self) -> dict:
        return zero_state.state_dict(self)

    def load_state_dict(self, state: dict, read_parts=None) -> None:
        zero_state.load_state_dict(self, state, read_parts)

    def checkpoint_parts(self) -> dict | None:
        return zero_state.checkpoint_parts(self)

    def canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return zero_state.canonical_optimizer_state(self)

    def load_canonical_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        zero_state.load_canonical_optimizer_state(self, state)

    # -- memory: the ledger (transient buffers: self.memory, zero_memory.py) ---------------
    def memory_ledger(self) -> dict[str, int]:
        """Bytes this rank holds by category. ``comm_buffers`` is the high-water mark of every
        transient buffer together (zero_memory.py); :meth:`transient_peaks` splits it. The
        categories count memory (the device's, and for ``offload cpu`` on a GPU the host's
        too, as masters and states always were); ``on_disk`` counts, apart, what disk offload
        keeps in memory-mapped files: masters, optimizer states, and with ``--offload-params``
        the parameter and gradient shards (each tensor once; the pages a step has read in are
        transient and dropped again, memory/offload.py)."""
        masters = [c.master for c in self.chunks if c.master.data_ptr() != c.shard.data_ptr()]
        master_bytes = tensor_bytes(masters)
        state_bytes = optimizer_state_bytes(self.optimizer)
        on_disk = 0
        if self.store.place == "disk":
            on_disk, master_bytes, state_bytes = master_bytes + state_bytes, 0, 0
            on_disk += self._stored_bytes()
        return {"parameters": self._param_bytes() + tensor_bytes(self.frozen),
                "gradients": self._grad_bytes(), "optimizer_states": state_bytes,
                "master_weights": master_bytes, "comm_buffers": self.memory.peak["total"],
                "activations_peak": self._act_peak, "on_disk": on_disk}

    def transient_peaks(self) -> dict[str, int]:
        """High-water marks by kind and ``total`` (zero_memory.ZeroMemory.peaks)."""
        return self.memory.peaks()

    def _param_bytes(self) -> int:
        """Whole parameters: every bucket's working-precision copy."""
        return sum(storage_bytes(c.full) for c in self.chunks)

    def _grad_bytes(self) -> int:
        """Stage 1: the whole gradient buckets. Stages 2-3: every gradient shard while it lives
        (from the reduce-scatter to the step; always, in host memory, when offloaded from a
        GPU); 0 on disk (``on_disk`` has them)."""
        if self.stage == 1:
            return sum(storage_bytes(c.grad_full) for c in self.chunks)
        if self.grads_offloaded and self.store.place == "disk":
            return 0
        return sum(c.layout.shard_numel * c.shard.element_size() for c in self.chunks)

    def _stored_bytes(self) -> int:
        """Parameter and gradient shards that ``--offload-params`` keeps in the store."""
        shards = [c.shard for c in self.chunks] if self.params_offloaded else []
        grads = [c.grad_shard for c in self.chunks] if self.grads_offloaded else []
        return tensor_bytes(shards + grads)

    # the peak instant (parallel/ledger.py samples these)
    def _transient_live(self) -> int:
        return self.memory.live_total()

    def _transients_sampled(self) -> bool:
        return True

    def _grads_live(self) -> int | None:
        """Stages 2-3: the gradient shards' bytes alive now (stage 1's are bucket views)."""
        if self.stage < 2 or self.grads_offloaded:
            return None                        # offloaded: in the store for the whole run
        return sum(storage_bytes(c.grad_shard) for c in self.chunks)


@torch.no_grad()
def _own_slice(layout: FlatLayout, params: list, rank: int, device, mat=None) -> torch.Tensor:
    """Rank's slice of the chunk's flat fp32 layout (padding 0), copied from the parameters
    that overlap it: equal to ``layout.shard(layout.new_flat(params, fp32), rank)`` without
    the whole flat copy (ZeRO-3's set-up then holds one unit, not two). Meta parameters take
    their ranges from the Materializer ``mat`` (made from the seed, or read from a checkpoint:
    only the rows this rank keeps)."""
    lo, hi = layout.shard_range(rank)
    out = torch.zeros(hi - lo, dtype=torch.float32, device=device)
    spans = [(p, max(offset, lo), min(offset + p.numel(), hi), offset)
             for p, offset in zip(params, layout.offsets)]
    spans = [s for s in spans if s[1] < s[2]]
    meta = [(p, a - offset, b - offset) for p, a, b, offset in spans if p.is_meta]
    made = iter(mat.flat(meta)) if meta else iter(())
    for p, a, b, offset in spans:
        value = next(made) if p.is_meta else p.detach().reshape(-1)[a - offset:b - offset]
        out[a - lo:b - lo].copy_(value)
    return out


class _Then:
    """A launched collective, then another once it is done (in ``wait``)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            self.then()
            self.then = None


def _cast(t, dtype: torch.dtype):
    return t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t
