"""What ZeRO stages 1, 2 and 3 share: sharded chunks, the chunked optimizer step, offload,
mixed precision, the gathered state dict and the memory ledger.

A :class:`Chunk` is one flat, padded group of the model's parameters (a gradient bucket in
stages 1-2, a unit such as one transformer block in stage 3; shardwise/comm/flat.py). Rank r of
the N data-parallel ranks owns slice r of every chunk: its working-precision ``shard``, its
reduced gradient ``grad_shard``, and the fp32 ``master`` that the optimizer updates. The
optimizer (any torch.optim, built by the factory on the list of masters) is stepped one chunk
at a time (the other masters' ``.grad`` are None, so torch.optim skips them): the math equals
one step over all of them, the next chunk's all-gather can start while the next chunk steps,
and with disk offload only one chunk's states are resident at a time.

Masters: in fp32 without offload the master *is* the shard (a view, no copy: ZeRO's fp32
figures have no master term). With bf16 / fp16 working copies, or with offload, the master is a
separate fp32 tensor in the :class:`~shardwise.memory.offload.OffloadStore` (device, CPU or
disk), initialised from the fp32 weights before they are cast. fp16 uses dynamic loss scaling
(scale 2^16, halved and the step skipped on inf/nan, doubled after 1000 clean steps).

Collectives go through :class:`~shardwise.comm.collectives.Comm` (backend reduce-scatter and
all-gather) or, with ``parallel.allreduce = ring``, shardwise's p2p ring (shardwise/comm/ring.py)
on one background thread (zero_comm.py) that keeps collectives in launch order. Meter names:
``zero_grad_rs`` and ``zero_param_ag`` (training traffic), ``zero_eval_ag`` (evaluation),
``zero_state_ag`` (gathering the state dict), ``zero_overflow`` (fp16 inf check).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardwise.comm.collectives import Work
from shardwise.comm.flat import FlatLayout, storage_bytes
from shardwise.memory.amp import DTYPES
from shardwise.memory.offload import OffloadStore, prefill_adam_state
from shardwise.parallel.base import Strategy, optimizer_state_bytes
from shardwise.parallel.zero_comm import ShardCollectives



@dataclass(eq=False)
class Chunk:
    """One flat group of parameters and this rank's pieces of it (see the module docstring)."""
    layout: FlatLayout
    params: list[nn.Parameter]
    shard: torch.Tensor                     # (padded/N,) working dtype: this rank's parameters
    master: nn.Parameter                    # (padded/N,) fp32: what the optimizer updates
    full: torch.Tensor | None = None        # (padded,) working dtype: the whole chunk, when held
    grad_shard: torch.Tensor | None = None  # (padded/N,) working dtype: reduced gradient
    grad_full: torch.Tensor | None = None   # (padded,) stage 1 only: the whole gradient
    grad_valid: bool = False                # grad_shard holds this step's gradient already
    pending: int = 0                        # gradients still to arrive in this backward
    trainable: int = 0                      # parameters that receive a gradient
    extra: dict = field(default_factory=dict)


class ZeroBase(Strategy):
    """The parts of ZeRO every stage shares; subclasses build chunks and move gradients."""
    stage = 0

    def __init__(self, cfg, mesh, comm, device, loss_fn):
        super().__init__(cfg, mesh, comm, device, loss_fn)
        self.group = mesh.dp_group
        self.dtype = DTYPES.get(cfg.memory.mixed_precision, torch.float32)   # "no": fp32
        self.overlap = cfg.parallel.overlap
        self.chunks: list[Chunk] = []
        self.store = OffloadStore(cfg.memory.offload, device, cfg.memory.offload_dir,
                                  tag=f"rank{mesh.rank}")
        self.scale = 2.0 ** 16 if self.dtype == torch.float16 else 1.0
        self._clean_steps = 0
        self._syncing = True
        self._ag_name = "zero_param_ag"
        self._comm_live = self._comm_peak = 0
        self._act_peak = 0
        self.collectives = ShardCollectives(comm, self.group, cfg.parallel.allreduce == "ring")
        self._ring = self.collectives.ring

    # -- building chunks ------------------------------------------------------------------
    def _make_chunk(self, params: list[nn.Parameter], full_sharded: bool) -> Chunk:
        """Flatten ``params``; keep the whole chunk (stages 1-2) or only this rank's shard (3)."""
        layout = FlatLayout.of(params, self.group.size)
        rank = self.group.rank
        fp32 = layout.new_flat([p.detach() for p in params], torch.float32, self.device)
        if full_sharded:   # stage 3: own a copy of the shard; the whole chunk is gathered on use
            full = torch.empty(layout.padded, dtype=self.dtype, device=self.device)
            shard = layout.shard(fp32, rank).to(self.dtype, copy=True)
        else:
            full = fp32 if self.dtype == torch.float32 else fp32.to(self.dtype)
            shard = layout.shard(full, rank)
        for p, view in zip(params, layout.views(full)):
            p.data = view
        if self.dtype == torch.float32 and self.store.place == "none":
            master = nn.Parameter(shard)                 # the shard itself: no copy in fp32
        else:
            master = nn.Parameter(self.store.zeros(layout.shard_numel))
            with torch.no_grad():
                master.copy_(layout.shard(fp32, rank))   # from fp32 weights, before any cast
        trainable = sum(p.requires_grad for p in params)
        return Chunk(layout, params, shard, master, full=full, trainable=trainable,
                     pending=trainable)

    def _build_optimizer(self, optimizer_factory) -> None:
        self.optimizer = optimizer_factory([c.master for c in self.chunks])
        prefill_adam_state(self.optimizer, self.store)
        self._chunk_of = {p: i for i, c in enumerate(self.chunks) for p in c.params}
        for p in self._chunk_of:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        """Autograd finished accumulating ``p.grad``: count it towards its chunk."""
        c = self.chunks[self._chunk_of[p]]
        c.pending -= 1
        if c.pending == 0:
            c.pending = c.trainable
            c.extra["readied"] = True
            self._chunk_ready(self._chunk_of[p])

    def _chunk_ready(self, index: int) -> None:
        raise NotImplementedError

    # -- collectives ---------------------------------------------------------------------
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        """out = the group's average of slice ``rank`` of ``inp`` (inp may be overwritten)."""
        return self.collectives.reduce_scatter(out, inp, async_op, "zero_grad_rs")

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                    name: str | None = None) -> Work:
        return self.collectives.all_gather(out, inp, async_op, name or self._ag_name)

    def _comm_alloc(self, nbytes: int) -> None:
        """Account a transient communication buffer (the ledger reports the high-water mark)."""
        self._comm_live += nbytes
        self._comm_peak = max(self._comm_peak, self._comm_live)

    def _stage_and_reduce(self, c: Chunk) -> None:
        """Copy the chunk's whole gradients into a flat staging buffer (dropping them), then
        reduce-scatter it into ``grad_shard`` (or a temporary to add later, when this step's
        shard already holds an accumulation micro-step's gradient). Stages 2 and 3."""
        staging = c.layout.new_flat(dtype=self.dtype, device=self.device)
        self._comm_alloc(storage_bytes(staging))
        for p, view in zip(c.params, c.layout.views(staging)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None                  # the whole gradient is not kept
        fresh = not c.grad_valid
        temp = None if fresh else c.grad_shard.new_empty(c.grad_shard.shape)
        if temp is not None:
            self._comm_alloc(storage_bytes(temp))
        work = self._reduce_scatter(c.grad_shard if fresh else temp, staging, async_op=self.overlap)
        self._reducing.append((c, work, temp, staging))

    # -- one step -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            out = self.model(x)
        else:
            for c in self.chunks:        # a new backward: count every chunk's gradients afresh
                c.pending, c.extra["readied"] = c.trainable, False
            with self._measure_activations():
                out = self.model(x)
        return out if self.dtype == torch.float32 else out.float()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale if self.scale != 1.0 else loss).backward()
        self._after_backward()

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

    def _check_all_ready(self) -> None:
        """ZeRO reduces a chunk only when all its gradients arrived: a parameter that got none
        would leave its chunk unreduced (and the update silently wrong), so stop instead."""
        missing = [c for c in self.chunks if c.trainable and not c.extra.get("readied", True)]
        if missing:
            names = [n for n, p in self.model.named_parameters()
                     if any(p is q for c in missing for q in c.params) and p.grad is None][:5]
            raise RuntimeError(f"{self.name}: some parameters got no gradient in this step "
                               f"({names or 'in a partly used unit'}); ZeRO needs every parameter "
                               "used in each forward; fix: use them all, or train with --strategy ddp "
                               "--find-unused")

    def step(self) -> None:
        self._check_all_ready()
        self._finish_reductions()
        if self._grads_finite():
            self._optimizer_step()
        for c in self.chunks:
            c.grad_valid = False
        self._zero_grads()

    def _finish_reductions(self) -> None:
        raise NotImplementedError

    def _zero_grads(self) -> None:
        """Stage 1 zeroes its whole-gradient buffers; stages 2-3 mark grad_shard stale."""

    def _after_chunk_step(self, index: int) -> None:
        """Stages 1-2 launch the chunk's all-gather here."""

    def _master_grad(self, c: Chunk) -> torch.Tensor:
        g = c.grad_shard
        if g.dtype == torch.float32 and g.device == c.master.device and self.scale == 1.0:
            return g                                       # fp32, no offload: a view
        g = g.to(c.master.device, torch.float32, copy=True)
        return g.div_(self.scale) if self.scale != 1.0 else g

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        """Phase 2 of 3: update each chunk's master, copy it into the shard, start its gather."""
        for i, c in enumerate(self.chunks):
            c.master.grad = self._master_grad(c)
            self.optimizer.step()                          # only this master has a .grad
            c.master.grad = None
            if c.master.data_ptr() != c.shard.data_ptr():
                c.shard.copy_(c.master)                    # fp32 -> working dtype / device
            state = self.optimizer.state.get(c.master, {})
            self.store.adopt_state(state)
            self.store.release([c.master, *[v for v in state.values() if torch.is_tensor(v)]])
            self._after_chunk_step(i)

    def _grads_finite(self) -> bool:
        """fp16 only: skip the step (and halve the scale) when any rank saw inf / nan."""
        if self.scale == 1.0 and self.dtype != torch.float16:
            return True
        bad = torch.zeros(1, device=self.device)
        for c in self.chunks:
            bad += (~torch.isfinite(c.grad_shard)).any().float()
        self.comm.all_reduce(bad, self.group, op="max", name="zero_overflow")
        if bad.item() > 0:
            self.scale /= 2
            self._clean_steps = 0
            return False
        self._clean_steps += 1
        if self._clean_steps % 1000 == 0:
            self.scale *= 2
        return True

    def evaluate(self, x, y):
        self._ag_name = "zero_eval_ag"
        try:
            return super().evaluate(x, y)
        finally:
            self._ag_name = "zero_param_ag"

    # -- activations ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _measure_activations(self):
        """Sum the distinct storages autograd saves for backward (parameters excluded)."""
        seen: dict[int, int] = {}

        def pack(t):
            if not (t.is_leaf and t.requires_grad):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._act_peak = max(self._act_peak, sum(seen.values()))

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, in fp32, gathered from the masters (a collective)."""
        names = {p: n for n, p in self.model.named_parameters()}
        out = {}
        for c in self.chunks:
            full = torch.empty(c.layout.padded, dtype=torch.float32, device=c.master.device)
            self._all_gather(full, c.master.detach(), async_op=False, name="zero_state_ag")
            for p, view in zip(c.params, c.layout.views(full)):
                out[names[p]] = view.detach().cpu().clone()
        return {n: out[n] for n, _ in self.model.named_parameters()}

    def state_dict(self) -> dict:
        """This rank's shards: masters, working shards and the optimizer (a per-rank file)."""
        return {"stage": self.stage, "rank": self.group.rank, "world": self.group.size,
                "masters": [c.master.detach().cpu().clone() for c in self.chunks],
                "optimizer": self.optimizer.state_dict(), "scale": self.scale}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if (state["stage"], state["world"]) != (self.stage, self.group.size):
            raise ValueError(f"checkpoint of ZeRO-{state['stage']} at dp={state['world']} cannot "
                             f"load into ZeRO-{self.stage} at dp={self.group.size}; fix: load "
                             "the gathered full_state_dict instead")
        for c, m in zip(self.chunks, state["masters"]):
            c.master.copy_(m)
            c.shard.copy_(c.master)
        self.optimizer.load_state_dict(state["optimizer"])
        for c in self.chunks:
            self.store.adopt_state(self.optimizer.state.get(c.master, {}))
            self._after_chunk_step(self.chunks.index(c))
        self._finish_gathers()
        self.scale = state.get("scale", self.scale)

    def _finish_gathers(self) -> None:
        """Stages 1-2 wait for the all-gathers started in _after_chunk_step."""

    # -- memory ledger --------------------------------------------------------------------
    def memory_ledger(self) -> dict[str, int]:
        """Bytes this rank holds by category; ``on_disk`` is what disk offload keeps off RAM."""
        masters = [c.master for c in self.chunks if c.master.data_ptr() != c.shard.data_ptr()]
        master_bytes = sum(m.numel() * m.element_size() for m in masters)
        state_bytes = optimizer_state_bytes(self.optimizer)
        on_disk = 0
        if self.store.place == "disk":
            on_disk, master_bytes, state_bytes = master_bytes + state_bytes, 0, 0
        return {"parameters": self._param_bytes(), "gradients": self._grad_bytes(),
                "optimizer_states": state_bytes, "master_weights": master_bytes,
                "comm_buffers": self._comm_peak, "activations_peak": self._act_peak,
                "on_disk": on_disk}

    def _param_bytes(self) -> int:
        raise NotImplementedError

    def _grad_bytes(self) -> int:
        raise NotImplementedError
