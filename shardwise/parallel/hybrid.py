"""The pipeline layout: tensor parallel inside a stage, pipeline across stages, data parallel
across replicas (pp > 1; without a pipeline shardwise/parallel/compose.py composes tensor
parallelism with the data-parallel component directly). Presets ``pp`` and ``3d``.

Order of application (compose.py's, steps 2, 3 and 6): every rank takes global rank 0's whole
model (one flat broadcast per dtype over the world, meter ``init_broadcast``, before
any split: tp slices and pipeline stages are cut from the full weights, so ranks that
initialised differently would otherwise train different models) -> tensor parallel
(parallel/tensor.py, over ``mesh.tp_group``) -> pipeline split (parallel/pipeline/stage.py;
stage = ``mesh.pp_rank``) -> data parallel over ``mesh.dp_group``:

  stage 0  the DDP component (parallel/data/ddp.py) on this stage's module: gradients land in
           its buckets; only the step's last micro-batch backward launches them (each bucket's
           allreduce as it fills, native or ring, optionally compressed), the earlier
           micro-batches accumulate (``_on_backward``); clipping sums over tp and pp (its plan)
  stage 1  flat ZeRO-1 (hybrid_zero1.py): one reduce-scatter and one all-gather per group

Partition: rank (pp_rank, dp_rank, tp_rank) holds stage pp_rank's layers, tp-split 1/T, trained on
rows dp_rank/D of each global batch, split into m micro-batches on the pipeline.
Collectives per step: tp as in tensor.py (4 allreduces of b*s*h per layer per micro-batch);
pp: one activation (b/m*s*h) forward and one gradient back per micro-batch per stage boundary
(send/recv); dp: one allreduce of this rank's gradients per step (2(D-1)/D * P_rank * 4 bytes,
bucketed), or with ZeRO-1 one reduce-scatter plus one all-gather (the same volume); a weight
tied between the first and the last stage (GPT-2's wte / lm_head, one copy on each): one
allreduce of its gradient over pp (``pp_tied_grad``, the other stages add zeros).
Memory per rank: P/(T*S) parameters and gradients (S = stages; plus replicated norms), Adam
states 2P/(T*S), or 2P/(T*S*D) with ZeRO-1; activations of <= p (1F1B) or m (GPipe) micro-batches
(schedule.py and interleaved.py / zero_bubble.py give the interleaved and ZB-H1 counts).

Loss normalisation: each micro-batch's mean loss is scaled by 1/m on the last stage, gradients
are averaged over dp, so the update equals single training on the global batch's mean loss;
``train_step`` returns that mean on every rank (broadcast from the last stage, meter 'metrics').
Only whole steps run (``engine.train_step``): no rank holds the whole model for ``engine(x)``.
Several inputs (a dict / tuple batch: attention_mask, position_ids, labels; and
``loss_from="loss"``, the model's own loss computed by the last stage from the labels): every pp
rank loads the same rows, so each stage reads the inputs it needs from its own copy of the
micro-batch (stage.split_batch); only the residual stream crosses stages.

References: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21); Rajbhandari et al., "ZeRO" (SC'20) for the optimizer-state sharding.
"""
from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn as nn

from shardwise.comm.reducer import Reducer
from shardwise.comm.shm_p2p import neighbours, transport_for
from shardwise.data import batch as batches
from shardwise.presets import zero_stage
from shardwise.parallel.base import Strategy
from shardwise.parallel.hybrid_zero1 import PipelineZero1
from shardwise.parallel.state import PipelineState
from shardwise.parallel.pipeline import schedule as sched
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.checks import virtual_stages
from shardwise.parallel.pipeline.executor import PipelineExecutor, evaluate_stages
from shardwise.models.plans import plan_of
from shardwise.parallel.pipeline.stage import stage_bounds, stage_of, tied_across_stages
from shardwise.parallel.data.ddp import DDPStrategy
from shardwise.parallel.tensor import TensorPlan, gather_tp, split_from_rank0


def _width(model: nn.Module) -> int:
    """The residual stream's width, which the stages send each other (the plan's n_embd)."""
    plan = plan_of(model)
    sizes = plan.sizes(model) if plan is not None and plan.sizes is not None else {}
    if "n_embd" not in sizes:
        raise ValueError(f"pipeline parallelism sends the residual stream (B, T, n_embd) between "
                         f"stages; the plan of {type(model).__name__} gives no n_embd; fix: add "
                         "n_embd to its ModelPlan's sizes")
    return sizes["n_embd"]


class HybridStrategy(PipelineState, PipelineZero1, Strategy):
    name = "3d"

    # -- set-up ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer_factory) -> None:
        mesh, p = self.mesh, self.cfg.parallel
        if mesh.pp == 1:
            raise ValueError("HybridStrategy is the pipeline layout (pp > 1); without a pipeline "
                             "shardwise/parallel/compose.py composes tp with the data-parallel "
                             "component")
        self.v = virtual_stages(self.cfg)     # model chunks per rank (interleaved-1f1b)
        bounds = stage_bounds(model, mesh.pp * self.v, p.stage_layers)
        self.n_embd = _width(model)
        # 0-1. rank 0's whole model everywhere, then tensor parallel (tp_specs: how to gather)
        model, self.tp_specs, self.loss_fn = split_from_rank0(model, mesh, self.comm,
                                                              self.device, self.loss_fn)
        self.tp_plan = TensorPlan(self.tp_specs, self.comm, mesh.tp_group)  # by global name
        # weights tied between the first and the last stage: (this rank's piece, held here?)
        ties = tied_across_stages(model, plan_of(model)) if mesh.pp > 1 else {}
        tied = [model.get_parameter(first) for first in dict.fromkeys(ties.values())]
        tied = [q for q in tied if q.requires_grad]
        # 2. pipeline split: keep this stage's layers only (its v chunks when interleaved)
        model = stage_of(model, bounds, mesh.pp_rank, mesh.pp)
        mine = {id(q) for q in model.parameters()}
        self.tied = [(q, id(q) in mine) for q in tied]
        copies = {n for n, _ in model.named_parameters() if model.is_tied_copy(n)}
        self._uncounted = {model.global_name(n) for n in copies}   # the first stage counts them
        self.actions = sched.build(p.schedule, mesh.pp, p.num_microbatches,
                                   self.v)[mesh.pp_rank]
        transport = transport_for(self.comm, mesh.pp_group, self.device, p.pp_transport,
                                  pairs=neighbours(mesh.pp))
        self.executor = PipelineExecutor(model, self.comm, mesh.pp_group, self.loss_fn,
                                         self.device, autocast=self.autocast,
                                         transport=transport)
        self.model = model.to(self.device)
        # 3. data parallel over dp: stage 0 is the DDP component (buckets, overlap with the
        # last micro-batch's backward, ring, compression); stage 1 the flat ZeRO-1 below
        self.zero1 = zero_stage(self.cfg) == 1
        self.reducer = Reducer(self.comm, mesh.dp_group, p.allreduce, self.device)
        self.dp = None
        if not self.zero1:
            stage_model = self.model
            local = {n: self.tp_specs[self._full_name(n)] for n, _ in stage_model.named_parameters()
                     if self._full_name(n) in self.tp_specs}
            self.dp = DDPStrategy(self.cfg, mesh, self.comm, self.device, self.loss_fn)
            self.dp.plan = TensorPlan(local, self.comm, mesh.tp_group, stages=mesh.pp_group,
                                      uncounted=frozenset(copies))
            self.dp.wrap(stage_model, optimizer_factory)
            self.dp.scaler = self.scaler       # one fp16 loss scale (parallel/scaling.py)
            self.optimizer = self.dp.optimizer
        else:
            self._build_optimizer(optimizer_factory)
            self.optimizer.zero_grad = self.zero_grad  # keep the .grad views (module docstring)
            self.optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
            self.optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
        self._synced = False
        self.steps_done, self.last_records, self.report = 0, None, None
        self._png = self._png_path()

    def _full_name(self, name: str) -> str:
        return self.model.global_name(name)

    def _png_path(self) -> str | None:
        lg = self.cfg.logging
        if self.mesh.pp == 1 or lg.schedule_png == "off":
            return None
        if lg.schedule_png:
            return lg.schedule_png
        # the loop's run directory (train.run_dir): same formula, computed at the same moment
        name = lg.run_name or f"{self.cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        return os.path.join(lg.out_dir, name, "schedule.png")

    # -- forward / backward: only whole train steps (no rank holds the whole model) ---------
    def _no_pipeline(self, what: str) -> None:
        raise RuntimeError(f"{what} cannot run under pipeline parallelism (pp = {self.mesh.pp}):"
                           " no rank holds the whole model; use engine.train_step(x, y)")

    def forward(self, x: torch.Tensor):
        self._no_pipeline("engine(x) / forward")

    def backward(self, loss: torch.Tensor) -> None:
        self._no_pipeline("engine.backward(loss)")

    def step(self) -> None:
        """Average gradients over dp (unless clipping did already), update, zero."""
        if self.dp is not None:
            self.dp.step()
            return
        if not self._overflowed():   # fp16: skipped on every rank (parallel/scaling.py)
            self.optimizer.step()    # the hooks below reduce first and gather after
        self._end_step()
        self.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.dp is not None:      # DDP's clipping, summed over tp and the stages (its plan)
            return self.dp.clip_grad_norm_(max_norm)
        return super().clip_grad_norm_(max_norm)

    def _on_backward(self, last_chunk: bool, mb: int, last_mb: bool) -> None:
        """Before each micro-batch's backward: only the step's last one reduces (its buckets
        launch as they fill); the earlier ones accumulate into the buckets."""
        sync = last_chunk and last_mb
        if sync:
            self.dp.restart_count()
        self.dp._sync = sync

    def train_step(self, x, y) -> float:
        """``x``: token ids, or a tuple / dict of the model's inputs (stage.split_batch); ``y``:
        the targets, or None with the model's own loss (labels in ``x``)."""
        m, chunks = self.cfg.parallel.num_microbatches, self.grad_accum
        total = torch.zeros((), device=self.device)
        for k, (xa, ya) in enumerate(zip(batches.chunk(x, chunks), batches.chunk(y, chunks))):
            xs, ys = batches.chunk(xa, m), batches.chunk(ya, m)
            hook = None
            if self.dp is not None:
                self.dp.begin_pass()
                hook = functools.partial(self._on_backward, k == chunks - 1)
            loss, self.last_records = self.executor.run(self.actions, xs, ys, self.n_embd,
                                                        self.scaler.scale / (m * chunks),
                                                        on_backward=hook)
            loss = loss / self.scaler.scale
            total += loss
        self._sum_tied_grads()
        self._clip_if_configured()
        self.step()
        self.steps_done += 1
        if self.steps_done == self.cfg.train.steps and self._png:
            self.pipeline_report(self._png, announce=True)
        return self.reduce_mean(self._from_last_stage(total))

    def _sum_tied_grads(self) -> None:
        """Each tied weight's two copies (first and last stage) get the sum of both stages'
        gradients, as the single model's one weight does: one all-reduce per tied weight over
        pp, after the dp reduction (sums commute; the other stages add zeros). Both copies then
        take the same optimizer steps from the same start (rank 0's weights), so they stay
        equal. Traffic: 2(p-1)/p * the weight's bytes per step."""
        if not self.tied:
            return
        if self.dp is not None:
            self.dp._finish_grad_sync()        # the buckets' dp allreduce is written first
        else:
            for f in self.flats:
                f.reattach()                   # .grad: views of the flat gradients
        for q, held in self.tied:
            if held and q.grad is None:
                q.grad = torch.zeros_like(q)
            g = q.grad if held else torch.zeros(q.shape, dtype=q.dtype, device=self.device)
            self.comm.all_reduce(g, self.mesh.pp_group, name="pp_tied_grad")

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        t = value.detach().float().reshape(1).clone()
        self.comm.broadcast(t, self.mesh.pp - 1, self.mesh.pp_group, name="metrics")
        return t[0]

    @torch.no_grad()
    def evaluate(self, x, y):
        mesh = self.mesh
        self.model.eval()
        out = evaluate_stages(self.executor, x, self.n_embd)
        self.model.train()
        if mesh.is_last_stage:
            loss = self.loss_fn(out, batches.to(y, self.device))
        else:
            loss = torch.zeros((), device=self.device)
        return self.reduce_mean(self._from_last_stage(loss)), None

    # -- the measured pipeline ------------------------------------------------------------
    def pipeline_report(self, png: str | None = None, announce: bool = False) -> dict:
        """Every stage's records of the last step (a collective over pp): bubble, peak
        in-flight micro-batches; draws the PNG and prints on global rank 0 when asked."""
        records = self.comm.all_gather_object(self.last_records, self.mesh.pp_group)
        p = self.cfg.parallel
        self.report = timeline.summary(records, p.schedule, p.num_microbatches, self.v)
        if self.mesh.rank == 0 and png:
            timeline.draw(records, png, timeline.describe(self.report))
            self.report["png"] = png
        if self.mesh.rank == 0 and announce:
            print(timeline.describe(self.report) + (f"; picture: {png}" if png else ""), flush=True)
        self.report["records"] = records
        return self.report

    # -- state ----------------------------------------------------------------------------
    def close(self) -> None:
        self.reducer.close()
        if self.dp is not None:
            self.dp.close()

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
        ledger = self._zero1_ledger() if self.dp is None else self.dp.memory_ledger()
        ledger.pop("activations_peak", None)  # the executor runs the stage itself: not measured
        transport = self.executor.transport  # the shared-memory rings this stage touches
        ledger["comm_buffers"] += transport.local_bytes if transport is not None else 0
        return ledger
