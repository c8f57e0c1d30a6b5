"""What ZeRO stages 1, 2 and 3 share: sharded chunks, gradient staging, the chunked optimizer
step, parameter groups, frozen parameters, buffers, clipping, the state dicts and the ledger
(gradient staging, reduction, clipping and loss-scale checks: zero_grads.py; state dicts:
zero_state.py; the memory ledger: zero_ledger.py; all mixins of :class:`ZeroBase`).

A :class:`Chunk` is one flat, padded group of the model's *trainable* parameters (a gradient
bucket in stages 1-2, a unit such as one transformer block in stage 3; shardwise/comm/flat.py).
Rank r of the N data-parallel ranks owns slice r of every chunk: its working-precision
``shard``, its reduced gradient ``grad_shard`` and the fp32 ``master`` that the optimizer updates.

Parameter groups: the user's optimizer factory is called once on the original trainable
parameters (a probe, which allocates no state); each parameter's group is read from
``probe.param_groups``, each chunk lays its parameters out group by group, and the real optimizer
(``type(probe)(groups, **probe.defaults)``) gets, per group, the views of the masters that hold
that group's elements (shardwise/comm/flat.shard_runs). So any per-group option (weight decay,
lr) applies to exactly the elements it applies to in single-process training.

Frozen parameters (requires_grad False) are in no chunk: every rank keeps them whole, they are
never communicated after the start, never stepped and hold no optimizer state (bit-for-bit
unchanged, whatever the weight decay). Stage 3 does not shard them either.

Start: dp rank 0's parameters and buffers are broadcast before anything is sharded, so ranks
that initialised differently train identically; not when every rank made them from the seed (a
meta-device build, models/init.py: ``deterministic_start``), where ZeRO-3 makes one unit at a time,
keeps its shard and drops the rest, so no rank ever holds the whole model. Buffers (e.g. BatchNorm running statistics) are
broadcast from dp rank 0 after every step: they follow rank 0's shard statistics, as torch DDP's
``broadcast_buffers`` does. The optimizer is stepped one chunk at a time (the other masters'
``.grad`` are None, so torch.optim skips them): the math equals one step over all of them, the
next chunk's all-gather can start while the next chunk steps, and with disk offload only the
chunk being stepped and the next one (read ahead on the store's thread) are resident.

Gradients (stages 2-3): on a chunk's first gradient in a backward, a flat staging buffer is
allocated and every parameter's ``.grad`` becomes a view of it, so autograd accumulates the
others in place; when the chunk's last gradient arrives the buffer is reduce-scatter'd into the
gradient shard and freed as soon as that finishes. At most ``MAX_GRAD_BUFFERS`` (2) whole-size
buffers live at once (one filling, one reducing): opening a third waits for the oldest reduction.

Masters: in fp32 without offload the master *is* the shard (a view, no copy), and so it is with
``--offload-params`` (stage 3), where the shard itself lives in the store. With bf16 / fp16
working copies, or with offload of the optimizer only, the master is a separate fp32 tensor in the
:class:`~shardwise.memory.offload.OffloadStore` (device, CPU or disk), initialised from the fp32
weights before they are cast. fp16 uses dynamic loss scaling (2^16, halved and the step skipped
on inf/nan, doubled after 1000 clean steps). Clipping (base.Strategy.clip_grad_norm_): squares of
the gradient shards summed over the dp group; the coefficient is applied in fp32 as each master's
gradient is formed. Meter names: ``zero_grad_rs``, ``zero_param_ag`` (training), ``zero_eval_ag``,
``zero_state_ag``, ``zero_overflow``, ``zero_clip``, ``zero_broadcast`` (start), ``zero_buffers``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from shardwise.comm.buckets import broadcast_coalesced
from shardwise.comm.flat import FlatLayout, shard_runs
from shardwise.comm.reducer import Reducer
from shardwise.memory.amp import DTYPES
from shardwise.memory.offload import OffloadStore, prefill_adam_state
from shardwise.models.init import swap_in
from shardwise.parallel.base import Strategy
from shardwise.parallel.data.zero_grads import ZeroGradients
from shardwise.parallel.data.zero_groups import ParamGroups
from shardwise.parallel.data.zero_ledger import ZeroLedger
from shardwise.parallel.data.zero_state import ZeroStateMixin


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


class ZeroBase(ZeroStateMixin, ZeroGradients, ZeroLedger, Strategy):
    """The parts of ZeRO every stage shares; subclasses build chunks and move gradients."""
    stage = 0
    materializer = None   # ZeRO-3 on a meta-device model: its units are made as they are sharded

    def __init__(self, cfg, mesh, comm, device, loss_fn):
        super().__init__(cfg, mesh, comm, device, loss_fn)
        # HSDP (mesh.build's dp_shard): shard over the shard group, all-reduce the reduced
        # gradient shards over the replica group; else the whole dp axis shards, no replicas
        self.group = mesh.group("dp_shard") if "dp_shard" in mesh.shape else mesh.dp_group
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
        self._syncing = True
        self._ag_name = "zero_param_ag"
        self._init_ledger()                            # transient buffers (zero_ledger.py)
        self._grad_coef = None                         # clipping coefficient of this step
        self._reducing: list[tuple] = []               # (chunk, work, temp, staging, mode, backend)
        self.collectives = Reducer(comm, self.group, cfg.parallel.allreduce, device)
        self._ring = self.collectives.ring
        self._next = 0                                 # stages 1-2: next bucket to launch

    # -- building chunks ------------------------------------------------------------------
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
                                self.mesh.dp_group, name="zero_broadcast")
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
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

    def _on_grad(self, p: nn.Parameter) -> None:
        """Autograd finished accumulating ``p.grad``: count it towards its chunk."""
        c = self.chunks[self._chunk_of[p]]
        c.extra.setdefault("got", set()).add(id(p))     # named when a chunk stays unready
        if self.stage >= 2:
            self._stage_grad(c, p)
        c.pending -= 1
        if c.pending == 0:
            c.pending = c.trainable
            c.extra["readied"] = True
            self._chunk_ready(self._chunk_of[p])

    def _chunk_ready(self, index: int) -> None:
        raise NotImplementedError

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

    # -- collectives ---------------------------------------------------------------------
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

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                    name: str | None = None):
        return self.collectives.all_gather(out, inp, async_op, name or self._ag_name)

    # -- one step -------------------------------------------------------------------------
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

    # -- the gradient-sync contract for a driver of its own (parallel/pipeline/driver.py) ----
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

    def grad_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def scale(self) -> float:
        """fp16's loss scale S (1.0 otherwise); the shards are unscaled in _master_grad."""
        return self.scaler.scale

    def _overflowed(self) -> bool:
        """ZeRO takes the fp16 verdict in its own step, on the gradient shards (_grads_finite)."""
        return False

    def _after_backward(self) -> None:
        """Launch what the hooks left (overlap off), or finish it (inside no_sync)."""

    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def close(self) -> None:
        self.collectives.close()
        self.store.close()

    def step(self) -> None:
        self._finish_grad_sync()
        if self._grads_finite():
            self._optimizer_step()
        for c in self.chunks:
            c.grad_valid = False
        self._grad_coef = None
        self._zero_grads()
        self._sync_buffers()

    def _user_step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{self.name}: optimizer.step(closure) is not supported (the step "
                             "runs chunk by chunk); fix: call backward yourself, then step()")
        self.step()

    def _after_chunk_step(self, index: int) -> None:
        """Stages 1-2 launch the chunk's all-gather here."""

    def _chunk_state(self, c: Chunk) -> list[torch.Tensor]:
        """The chunk's tensors the step writes: master, shard and every optimizer state of
        its master views (what the disk tier reads ahead, then writes back and drops)."""
        out = [c.master, c.shard]
        for _, _, _, view in c.masters:
            out += [v for v in self.optimizer.state.get(view, {}).values()
                    if torch.is_tensor(v) and v.dim() > 0]
        return out

    def _read_ahead(self, c: Chunk) -> None:
        """Disk offload: the chunk's state (overwritten by its step) and gradient shard (read)."""
        self.store.prefetch(self._chunk_state(c), write=True)
        self.store.prefetch([c.grad_shard])

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        """Phase 2 of 3: update each chunk's masters, copy into the shard, start its gather.
        With disk offload the next chunk's state is read in on the store's thread while this
        chunk steps, and each stepped chunk is written back there (memory/offload.py)."""
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
            self._after_chunk_step(i)
        self.store.wait_copies()        # the masters may be written again (offload.py)

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

    def evaluate(self, x, y):
        self._ag_name = "zero_eval_ag"
        try:
            return super().evaluate(x, y)
        finally:
            self._ag_name = "zero_param_ag"


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
