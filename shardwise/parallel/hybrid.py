"""3D parallelism: tensor parallel inside a stage, pipeline across stages, data parallel across
replicas, with optional ZeRO-1 over the data-parallel axis. Registered as ``tp``, ``pp`` and
``3d`` (the names only choose the defaults users type; the mesh sizes decide what runs).

Order of application (fixed; DESIGN.md): every rank takes global rank 0's whole model (one
broadcast per parameter and buffer over the world, meter ``init_broadcast``, before any split:
tp slices and pipeline stages are cut from the full weights, so ranks that initialised
differently would otherwise train different models) -> tensor parallel (parallel/tensor.py, over
``mesh.tp_group``) -> pipeline split (parallel/pipeline/stage.py; stage = ``mesh.pp_rank``) ->
data parallel over ``mesh.dp_group`` (gradients live in one flat buffer, averaged with one
allreduce after backward) -> optimizer (plain, or ZeRO-1: the flat gradient reduce-scattered over
dp, each dp rank updating its 1/dp of the flat parameters, then an all-gather of the parameters).
ZeRO-1 keeps the user's parameter groups: the factory is called once on the parameters (a probe)
to learn each one's group, and there is one flat (one reduce-scatter, one all-gather) per group.
Frozen parameters stay out of the flats and the optimizer.

Gradient clipping: after the dp reduction, the squared norm is summed once over the world (one
scalar allreduce, meter ``grad_norm``): each rank counts the entries it owns (ZeRO-1: its dp
shard; otherwise dp rank 0 only), tp-split parameters on every tp rank, tp-replicated ones
(norms, row-parallel biases, pos_emb) on tp rank 0 only, each stage its own layers.
A user's loop may drive the optimizer: its ``zero_grad`` zeroes the flat gradients in place
(torch's default set_to_none=True would drop the views), a ``.grad`` set to None is put back on
its view at the next forward, and step pre / post hooks reduce before and gather after any
``optimizer.step()``, so ``engine.optimizer.step()`` equals ``engine.step()`` but for zeroing.

Partition: rank (pp_rank, dp_rank, tp_rank) holds stage pp_rank's layers, tp-split 1/T, trained on
rows dp_rank/D of each global batch, split into m micro-batches on the pipeline.
Collectives per step: tp as in tensor.py (4 allreduces of b*s*h per layer per micro-batch);
pp: one activation (b/m*s*h) forward and one gradient back per micro-batch per stage boundary
(send/recv); dp: one allreduce of this rank's gradients (2(D-1)/D * P_rank * 4 bytes), or with
ZeRO-1 one reduce-scatter plus one all-gather (the same volume).
Memory per rank: P/(T*S) parameters and gradients (S = stages; plus replicated norms), Adam
states 2P/(T*S), or 2P/(T*S*D) with ZeRO-1; activations of <= p (1F1B) or m (GPipe) micro-batches.

Loss normalisation: each micro-batch's mean loss is scaled by 1/m on the last stage, gradients
are averaged over dp, so the update equals single training on the global batch's mean loss;
``train_step`` returns that mean on every rank (broadcast from the last stage, meter 'metrics').

References: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21); Rajbhandari et al., "ZeRO" (SC'20) for the optimizer-state sharding.
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

from shardwise.comm import p2p
from shardwise.comm.flat import FlatLayout
from shardwise.parallel.base import Strategy, grad_sq, optimizer_like, optimizer_state_bytes, \
    probe_groups, tensor_bytes
from shardwise.parallel.pipeline import schedule as sched
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.executor import PipelineExecutor
from shardwise.parallel.pipeline.stage import PipelineStage, stage_bounds
from shardwise.parallel.tensor import apply_tensor_parallel, gather_tp, tp_loss


class FlatBuffers:
    """Parameters and gradients as views of two flat buffers (comm/flat.py's layout, padded to a
    multiple of ``shards``), so the dp traffic is one collective and ZeRO-1's shards are
    contiguous ranges."""

    def __init__(self, params: list[nn.Parameter], shards: int):
        self.layout = FlatLayout.of(params, shards)
        self.params = self.layout.new_flat(params, params[0].dtype, params[0].device)
        self.grads = torch.zeros_like(self.params)
        self.members, self.grad_views = params, self.layout.views(self.grads)
        for p, pv, gv in zip(params, self.layout.views(self.params), self.grad_views):
            p.data, p.grad = pv, gv                                # backward accumulates into gv

    def shard(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return self.layout.shard(flat, index)

    @torch.no_grad()
    def reattach(self) -> None:
        """A ``.grad`` set to None (or replaced) goes back on its view (zero, or copied in)."""
        for p, view in zip(self.members, self.grad_views):
            if p.grad is not view:
                view.zero_() if p.grad is None else view.copy_(p.grad)
                p.grad = view


class HybridStrategy(Strategy):
    name = "3d"

    # -- set-up ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer_factory) -> None:
        mesh, p = self.mesh, self.cfg.parallel
        is_gpt = all(hasattr(model, a) for a in ("tok_emb", "blocks", "head"))
        if (mesh.tp > 1 or mesh.pp > 1) and not is_gpt:
            raise TypeError(f"tp / pp split shardwise's GPT; {type(model).__name__} can only use "
                            "--dp here (or strategy ddp)")
        bounds = stage_bounds(model, mesh.pp, p.stage_layers) if mesh.pp > 1 else None
        self.n_embd = model.cfg.n_embd if is_gpt else None
        # 0. every rank starts from global rank 0's whole model
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                self.comm.broadcast(t.data, 0, mesh.world, name="init_broadcast")
        # 1. tensor parallel (names unchanged; tp_specs says how to gather each split parameter)
        self.tp_specs = apply_tensor_parallel(model, mesh, self.comm)
        if mesh.tp > 1:
            self.loss_fn = tp_loss(model.cfg.vocab_size, self.comm, mesh.tp_group)
        # 2. pipeline split: keep this stage's layers only
        if mesh.pp > 1:
            model = PipelineStage(model, bounds, mesh.pp_rank)
            self.actions = sched.build(p.schedule, mesh.pp, p.num_microbatches)[mesh.pp_rank]
            self.executor = PipelineExecutor(model, self.comm, mesh.pp_group, self.loss_fn,
                                             self.device, autocast=self.autocast)
        self.model = model.to(self.device)
        # 3. data parallel / ZeRO-1 over dp: flat gradient buffers, optimizer on all or a shard
        self.zero1 = p.zero1_over_dp
        self._build_optimizer(optimizer_factory)
        self.optimizer.zero_grad = self.zero_grad      # keep the .grad views (module docstring)
        self.optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
        self.optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
        self._synced = False
        self.steps_done, self.last_records, self.report = 0, None, None
        self._png = self._png_path()

    def _build_optimizer(self, optimizer_factory) -> None:
        mesh = self.mesh
        named = [(self._full_name(n), q) for n, q in self.model.named_parameters() if q.requires_grad]
        params = [q for _, q in named]
        if not self.zero1:
            self.flats = [FlatBuffers(params, 1)]     # one allreduce for everything
            self.optimizer = optimizer_factory(params)
            self.masters = self.grad_shards = []
        else:
            # fp32 training needs no master copy: the optimizer updates this rank's slice of each
            # group's flat parameters in place (a view), then the slices are all-gathered.
            probe, groups = probe_groups(optimizer_factory, params)
            self.flats = [FlatBuffers(members, mesh.dp) for _, members in groups]
            self.masters = [nn.Parameter(f.shard(f.params, mesh.dp_rank)) for f in self.flats]
            self.grad_shards = [torch.zeros_like(m) for m in self.masters]
            self.optimizer = optimizer_like(probe, [(options, [m]) for (options, _), m
                                                    in zip(groups, self.masters)])
        name_of = {id(q): n for n, q in named}
        self._counted = [self._counted_ranges(f, [name_of[id(q)] for q in f.members])
                         for f in self.flats]

    def _full_name(self, name: str) -> str:
        return self.model.global_name(name) if self.mesh.pp > 1 else name

    def _counted_ranges(self, flat: FlatBuffers, names: list[str]) -> list[tuple[int, int]]:
        """[a, b) ranges of this rank's gradient (ZeRO-1: its shard; else the whole flat) whose
        squares it adds to the global norm, so that every entry is counted once in the world."""
        mesh, layout = self.mesh, flat.layout
        if not self.zero1 and mesh.dp_rank != 0:
            return []                                  # replicated over dp: dp rank 0 counts
        lo, hi = layout.shard_range(mesh.dp_rank) if self.zero1 else (0, layout.padded)
        ranges = []
        for name, offset, shape in zip(names, layout.offsets, layout.shapes):
            if name not in self.tp_specs and mesh.tp_rank != 0:
                continue                               # tp-replicated: tp rank 0 counts
            a, b = max(offset, lo), min(offset + shape.numel(), hi)
            if a >= b:
                continue
            if ranges and ranges[-1][1] == a - lo:
                ranges[-1] = (ranges[-1][0], b - lo)   # merge neighbours: fewer norms
            else:
                ranges.append((a - lo, b - lo))
        return ranges

    def _png_path(self) -> str | None:
        lg = self.cfg.logging
        if self.mesh.pp == 1 or lg.schedule_png == "off":
            return None
        if lg.schedule_png:
            return lg.schedule_png
        # the loop's run directory (train.run_dir): same formula, computed at the same moment
        name = lg.run_name or f"{self.cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        return os.path.join(lg.out_dir, name, "schedule.png")

    # -- forward / backward ---------------------------------------------------------------
    def _no_pipeline(self, what: str) -> None:
        if self.mesh.pp > 1:
            raise RuntimeError(f"{what} cannot run under pipeline parallelism (pp = {self.mesh.pp}):"
                               " no rank holds the whole model; use engine.train_step(x, y)")

    def forward(self, x: torch.Tensor):
        self._no_pipeline("engine(x) / forward")
        for f in self.flats:
            f.reattach()
        with self.autocast():
            return self.model(x)        # tp > 1: this rank's vocabulary columns of the logits

    def backward(self, loss: torch.Tensor) -> None:
        self._no_pipeline("engine.backward(loss)")
        loss.backward()

    def _finish_grad_sync(self) -> None:
        """Average gradients over dp (allreduce, or ZeRO-1's reduce-scatter per group), once."""
        if self._synced:
            return
        for f in self.flats:
            f.reattach()
        dp = self.mesh.dp_group
        if not self.zero1:
            self.comm.all_reduce(self.flats[0].grads, dp, op="avg", name="dp_grad")
        for f, g in zip(self.flats, self.grad_shards):
            self.comm.reduce_scatter(g, f.grads, dp, op="avg", name="zero1_grad")
        self._synced = True

    def step(self) -> None:
        """Average gradients over dp (unless clipping did already), update, zero."""
        self.optimizer.step()        # the hooks below reduce first and gather after
        self.zero_grad()

    def _before_optimizer_step(self) -> None:
        """Every optimizer.step(), a user's own call included: gradients reduced first."""
        self._finish_grad_sync()
        for m, g in zip(self.masters, self.grad_shards):
            m.grad = g

    def _after_optimizer_step(self) -> None:
        for f, m in zip(self.flats, self.masters):
            # the input is this rank's slice of the output: an in-place gather
            self.comm.all_gather(f.params, m.detach(), self.mesh.dp_group, name="zero1_params")
        self._synced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad here: zero the flat gradients in place (the views stay)."""
        for f in self.flats:
            f.reattach()
            f.grads.zero_()
        self._synced = False

    # -- clipping (module docstring): each entry counted once over the world ---------------
    def _owned_grads(self) -> list[torch.Tensor]:
        return self.grad_shards if self.zero1 else [f.grads for f in self.flats]

    def _local_grad_sq(self) -> torch.Tensor:
        return grad_sq([g[a:b] for g, ranges in zip(self._owned_grads(), self._counted)
                        for a, b in ranges], self.device)

    def _sum_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        t = sq.reshape(1).clone()
        self.comm.all_reduce(t, self.mesh.world, name="grad_norm")
        return t[0]

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self._owned_grads():
            g.mul_(coef.to(g.dtype))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.mesh.pp == 1:
            return super().train_step(x, y)
        m, chunks = self.cfg.parallel.num_microbatches, self.grad_accum
        total = torch.zeros((), device=self.device)
        for xa, ya in zip(x.chunk(chunks), y.chunk(chunks)):
            xs, ys = xa.chunk(m), ya.chunk(m)
            shape = (xs[0].shape[0], xs[0].shape[1], self.n_embd)          # (b/m, T, C)
            loss, self.last_records = self.executor.run(self.actions, xs, ys, shape, 1 / (m * chunks))
            total += loss
        self._clip_if_configured()
        self.step()
        self.steps_done += 1
        if self.steps_done == self.cfg.train.steps and self._png:
            self.pipeline_report(self._png, announce=True)
        return self.reduce_mean(self._from_last_stage(total))

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        t = value.detach().float().reshape(1).clone()
        self.comm.broadcast(t, self.mesh.pp - 1, self.mesh.pp_group, name="metrics")
        return t[0]

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor):
        if self.mesh.pp == 1:
            return super().evaluate(x, y)
        mesh, g = self.mesh, self.mesh.pp_group
        self.model.eval()
        h = x.to(self.device)
        if not mesh.is_first_stage:
            h = p2p.recv(self.comm, g, (*x.shape, self.n_embd), mesh.prev_stage,
                         device=self.device, name="pp_eval")
        out = self.model(h)
        self.model.train()
        if mesh.is_last_stage:
            loss = self.loss_fn(out, y.to(self.device))
        else:
            p2p.send(self.comm, g, out, mesh.next_stage, name="pp_eval")
            loss = torch.zeros((), device=self.device)
        return self.reduce_mean(self._from_last_stage(loss)), None

    # -- the measured pipeline ------------------------------------------------------------
    def pipeline_report(self, png: str | None = None, announce: bool = False) -> dict:
        """Every stage's records of the last step (a collective over pp): bubble, peak
        in-flight micro-batches; draws the PNG and prints on global rank 0 when asked."""
        records = self.comm.all_gather_object(self.last_records, self.mesh.pp_group)
        p = self.cfg.parallel
        self.report = timeline.summary(records, p.schedule, p.num_microbatches)
        if self.mesh.rank == 0 and png:
            timeline.draw(records, png, timeline.describe(self.report))
            self.report["png"] = png
        if self.mesh.rank == 0 and announce:
            print(timeline.describe(self.report) + (f"; picture: {png}" if png else ""), flush=True)
        self.report["records"] = records
        return self.report

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its single-model name: tp pieces gathered, stages merged."""
        local = {}
        for name, q in self.model.named_parameters():
            full = self.model.global_name(name) if self.mesh.pp > 1 else name
            t = q.detach()
            if full in self.tp_specs:
                t = gather_tp(t, self.tp_specs[full], self.comm, self.mesh.tp_group)
            local[full] = t.cpu().clone()
        if self.mesh.pp == 1:
            return local
        merged = {}
        for part in self.comm.all_gather_object(local, self.mesh.pp_group):
            merged.update(part)
        return merged

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)    # copies into the flat views (and so the ZeRO-1 slice)

    def memory_ledger(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": tensor_bytes([f.grads for f in self.flats] + self.grad_shards),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,          # ZeRO-1's optimizer works on a view of the parameters
            "comm_buffers": 0,
        }
