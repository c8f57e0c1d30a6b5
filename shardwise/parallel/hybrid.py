"""3D parallelism: tensor parallel inside a stage, pipeline across stages, data parallel across
replicas, with optional ZeRO-1 over the data-parallel axis. Registered as ``tp``, ``pp`` and
``3d`` (the names only choose the defaults users type; the mesh sizes decide what runs).

Order of application (fixed; DESIGN.md): tensor parallel (parallel/tensor.py, over
``mesh.tp_group``) -> pipeline split (parallel/pipeline/stage.py; stage = ``mesh.pp_rank``) ->
data parallel over ``mesh.dp_group`` (gradients live in one flat buffer, averaged with one
allreduce after backward) -> optimizer (plain, or ZeRO-1: the flat gradient reduce-scattered over
dp, each dp rank updating its 1/dp of the flat parameters, then an all-gather of the parameters).

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
from shardwise.parallel.base import Strategy, optimizer_state_bytes, tensor_bytes
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
        for p, pv, gv in zip(params, self.layout.views(self.params), self.layout.views(self.grads)):
            p.data, p.grad = pv, gv                                # backward accumulates into gv

    def shard(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return self.layout.shard(flat, index)


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
        # 3. data parallel / ZeRO-1 over dp: flat gradient buffer, optimizer on all or a shard
        self.zero1 = p.zero1_over_dp
        params = [q for q in self.model.parameters() if q.requires_grad]
        self.flat = FlatBuffers(params, mesh.dp if self.zero1 else 1)
        if self.zero1:
            # fp32 training needs no master copy: the optimizer updates this rank's slice of the
            # flat parameters in place (a view), then the slices are all-gathered.
            self.master = nn.Parameter(self.flat.shard(self.flat.params, mesh.dp_rank))
            self.optimizer = optimizer_factory([self.master])
        else:
            self.optimizer = optimizer_factory(params)
        self.steps_done, self.last_records, self.report = 0, None, None
        self._png = self._png_path()

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._no_pipeline("engine(x) / forward")
        with self.autocast():
            return self.model(x)        # tp > 1: this rank's vocabulary columns of the logits

    def backward(self, loss: torch.Tensor) -> None:
        self._no_pipeline("engine.backward(loss)")
        loss.backward()

    def step(self) -> None:
        """Average gradients over dp (allreduce, or ZeRO-1's reduce-scatter), update, zero."""
        dp, flat = self.mesh.dp_group, self.flat
        if not self.zero1:
            self.comm.all_reduce(flat.grads, dp, op="avg", name="dp_grad")
            self.optimizer.step()
        else:
            grad = torch.empty_like(self.master)
            self.comm.reduce_scatter(grad, flat.grads, dp, op="avg", name="zero1_grad")
            self.master.grad = grad
            self.optimizer.step()
            # the input is this rank's slice of the output: an in-place gather
            self.comm.all_gather(flat.params, self.master.detach(), dp, name="zero1_params")
        flat.grads.zero_()

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
            "gradients": tensor_bytes([self.flat.grads]),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,          # ZeRO-1's optimizer works on a view of the parameters
            "comm_buffers": 0,
        }
