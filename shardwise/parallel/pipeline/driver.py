"""The pipeline driver: how one training step runs when the model is cut into stages (pp > 1).

Two contracts make a layout (parallel/base.py): a *driver* runs forward and backward for a step,
a *gradient-sync component* (parallel/data/: DDP or ZeRO 1-3) owns this rank's gradients and
optimizer over the dp axis. Without a pipeline the driver is the component's own loop
(``Strategy.train_step``). With one, it is :class:`PipelineDriver`: it owns the micro-batches
(``num_microbatches``, read once here), the schedule's actions for this rank, the executor
(executor.py), the tied-weight sum and the timeline (timeline.py); every gradient it produces
lands in the component, which the composer (parallel/compose.py) built on this rank's stage
exactly as it builds it on a whole model. So ZeRO-1, -2 and -3 exist once, with or without pp.

Per step: for each of ``grad_accum`` passes, the component counts a new pass (``begin_pass``)
and the executor runs the schedule over m micro-batches; before each action that computes
weight gradients the driver tells the component whether it is the step's last backward
(``before_backward(last)``): only then does the component reduce (DDP's bucket all-reduce,
ZeRO's reduce-scatter), during that backward; the earlier ones accumulate locally, unsharded
(ZeRO-2 / ZeRO-3 keep whole gradient buffers of the stage through the step: their memory
cost under a pipeline; DDP and ZeRO-1 hold whole gradients anyway). An interleaved rank (v > 1
chunks) has no single last backward, nor does a stage with a weight tied to another stage:
there the component reduces after the schedule (``_finish_grad_sync``), once.

Tied weights (GPT-2's wte / lm_head on the first and the last stage, one copy on each): the
copies' whole gradients are summed over pp (``pp_tied_grad``, one all-reduce per tied weight; the
stages without a copy add zeros) before the dp reduction, so both copies take the same step from
the same start (global rank 0's weights) and stay equal.

Partition: rank (pp_rank, dp_rank, tp_rank) holds stage pp_rank's layers (tp-split 1/T), sharded
over dp as the component's stage says, trains on rows dp_rank/D of each global batch, in m
micro-batches. Collectives: the executor's sends and receives over pp (one activation forward,
one gradient back, per micro-batch and stage boundary); the component's over dp, once per step;
the loss broadcast from the last stage (``metrics``). Memory: the component's, for this stage's
parameters, plus the activations of the micro-batches in flight (GPipe m, 1F1B <= p) and the
shared-memory rings between stages of one host.

Loss normalisation: each micro-batch's mean loss is scaled by 1/(m * grad_accum) on the last
stage, gradients are averaged over dp, so the update equals single training on the global
batch's mean loss; ``train_step`` returns that mean on every rank. Only whole steps run: no rank
holds the whole model for ``engine(x)``.

Replica groups (``--ft-replicas``, parallel/replicas.py): the hook set on the driver
(``self.ft``) is the component's, which averages this stage's reduced gradients and the loss
(broadcast from the last stage before the sync) over the live groups once a step, before
clipping and the optimizer; a failed vote raises Redo there, after the flush, and
:meth:`zero_grad` (the component's) drops the step's gradients for the retake.

Reference: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21); torchtitan runs FSDP under pipelines the same way (gradients reduced at the
stage's last backward).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardwise.comm.shm_p2p import neighbours, ring_bytes, transport_for
from shardwise.data import batch as batches
from shardwise.models.plans import plan_of
from shardwise.parallel.base import Strategy
from shardwise.parallel.pipeline import schedule as sched
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.checks import virtual_stages
from shardwise.parallel.pipeline.executor import PipelineExecutor, evaluate_stages
from shardwise.parallel.pipeline.stage import stage_bounds, stage_of, tied_across_stages


@dataclass
class PipelineCut:
    """Step 3 of the composer: this rank's part of the model, and what the driver needs of the
    whole one (the residual stream's width, the weights tied across stages)."""
    stage: nn.Module              # stage.PipelineStage, or VirtualStages (v chunks)
    width: int                    # n_embd: a micro-batch's activation is (b, T, width)
    v: int                        # model chunks per rank (interleaved-1f1b)
    tied: list                    # [(parameter, held by this rank)] tied between first and last


def _width(model: nn.Module) -> int:
    plan = plan_of(model)
    sizes = plan.sizes(model) if plan is not None and plan.sizes is not None else {}
    if "n_embd" not in sizes:
        raise ValueError(f"pipeline parallelism sends the residual stream (B, T, n_embd) between "
                         f"stages; the plan of {type(model).__name__} gives no n_embd; fix: add "
                         "n_embd to its ModelPlan's sizes")
    return sizes["n_embd"]


def cut(model: nn.Module, cfg, mesh) -> PipelineCut:
    """Keep this rank's stage (its v chunks when interleaved) of the whole model, cut by
    parameter count or ``parallel.stage_layers`` (stage.py)."""
    v = virtual_stages(cfg)
    bounds = stage_bounds(model, mesh.pp * v, cfg.parallel.stage_layers)
    width = _width(model)
    ties = tied_across_stages(model, plan_of(model))
    tied = [q for q in (model.get_parameter(f) for f in dict.fromkeys(ties.values()))
            if q.requires_grad]
    stage = stage_of(model, bounds, mesh.pp_rank, mesh.pp)
    mine = {id(q) for q in stage.parameters()}
    return PipelineCut(stage, width, v, [(q, id(q) in mine) for q in tied])


class PipelineDriver(Strategy):
    """Runs a step's schedule on this rank's stage; the gradient-sync component ``grads``
    (already wrapped on ``cut.stage``) reduces, clips, steps and holds the state."""
    name = "3d"

    def __init__(self, cfg, mesh, comm, device, loss_fn, cut: PipelineCut, grads: Strategy):
        super().__init__(cfg, mesh, comm, device, loss_fn)
        p = cfg.parallel
        self.grads, self.cut, self.v = grads, cut, cut.v
        self.model, self.optimizer, self.plan = grads.model, grads.optimizer, grads.plan
        self.scaler = grads.scaler                 # one fp16 loss scale: the component's
        self.microbatches = p.num_microbatches
        self.actions = sched.build(p.schedule, mesh.pp, self.microbatches, self.v)[mesh.pp_rank]
        transport = transport_for(comm, mesh.pp_group, device, p.pp_transport,
                                  pairs=neighbours(mesh.pp), capacity=ring_bytes(
                                      self._message_bytes(cfg, mesh, cut.width)))
        self.executor = PipelineExecutor(self.model, comm, mesh.pp_group, loss_fn, device,
                                         autocast=self.autocast, transport=transport)
        # one backward reduces only when it is the stage's only last one and no tied sum waits
        self.reduce_in_backward = self.v == 1 and not cut.tied
        self.steps_done, self.last_records, self.report = 0, None, None
        self._png = self._png_path()

    def _message_bytes(self, cfg, mesh, width: int) -> int:
        """One boundary activation of the configured batch: (rows, T, width) fp32 values, rows
        a micro-batch's share of this dp rank's batch, T the positions a cp rank holds."""
        rows = max(1, cfg.train.batch_size // (mesh.dp * self.grad_accum * self.microbatches))
        return rows * max(1, cfg.model.block_size // mesh.cp) * width * 4

    @staticmethod
    def batch_view(batch):
        """What this rank's stages read of a step's batch: all of it (compose may set another
        view: context parallelism's cut to this rank's positions)."""
        return batch

    def _png_path(self) -> str | None:
        lg = self.cfg.logging
        if lg.schedule_png == "off":
            return None
        if lg.schedule_png:
            return lg.schedule_png
        # the loop's run directory (train.run_dir): same formula, computed at the same moment
        name = lg.run_name or f"{self.cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        return os.path.join(lg.out_dir, name, "schedule.png")

    # -- only whole train steps (no rank holds the whole model) ---------------------------
    def _no_pipeline(self, what: str) -> None:
        raise RuntimeError(f"{what} cannot run under pipeline parallelism (pp = {self.mesh.pp}):"
                           " no rank holds the whole model; use engine.train_step(x, y)")

    def forward(self, *args, **kwargs):
        self._no_pipeline("engine(x) / forward")

    def backward(self, loss: torch.Tensor) -> None:
        self._no_pipeline("engine.backward(loss)")

    def train_step(self, x, y) -> float:
        """``x``: token ids, or a tuple / dict of the model's inputs (stage.split_batch); ``y``:
        the targets, or None with the model's own loss (labels in ``x``)."""
        m, passes = self.microbatches, self.grad_accum
        x = self.batch_view(x)
        total = torch.zeros((), device=self.device)
        for k, (xa, ya) in enumerate(zip(batches.chunk(x, passes), batches.chunk(y, passes))):
            self.grads.begin_pass()
            hook = functools.partial(self._before_backward, k == passes - 1)
            loss, self.last_records = self.executor.run(
                self.actions, batches.chunk(xa, m), batches.chunk(ya, m), self.cut.width,
                self.scaler.scale / (m * passes), on_backward=hook)
            total += loss / self.scaler.scale
        self._sum_tied_grads()
        # every stage's copy of this dp rank's loss, before the component's gradient sync:
        # --ft-replicas' hook averages it over the groups with the gradients (replicas.py)
        self.local_loss = self._from_last_stage(total)
        self._clip_if_configured()     # a failed --ft-replicas vote raises Redo here or in
        self.grads.step()              # step(): nothing stepped, zero_grad() drops the pass
        self.steps_done += 1
        if self.steps_done == self.cfg.train.steps and self._png:
            self.pipeline_report(self._png, announce=True)
        return self.reduce_mean(self.local_loss)

    def _before_backward(self, last_pass: bool, mb: int, last_mb: bool) -> None:
        """Before each weight-gradient action: the step's last one reduces as it goes."""
        self.grads.before_backward(self.reduce_in_backward and last_pass and last_mb)

    def step(self) -> None:
        self.grads.step()

    # -- --ft-replicas (parallel/replicas.py): the hook lives on the component ---------------
    @property
    def component(self) -> Strategy:
        """The gradient-sync component (DDP or ZeRO over this stage): replica groups of
        different sizes gather, scatter and hand over its state (parallel/replicas.py)."""
        return self.grads

    @property
    def ft(self):
        """The replica groups' hook: the component's, which calls its ``reduce`` once a step in
        its ``_finish_grad_sync``, on this stage's reduced gradients (after the flush and the
        tied-weight sum, before clipping and the optimizer)."""
        return self.grads.ft

    @ft.setter
    def ft(self, hook) -> None:
        self.grads.ft = hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients (a failed --ft-replicas vote): every micro-batch's sends
        and receives finished with the schedule, so only the component holds anything."""
        self.grads.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The component's clipping: its squares summed over dp, then tp and pp (its plan)."""
        return self.grads.clip_grad_norm_(max_norm)

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """Each tied weight's copies get the sum of both stages' whole gradients (module
        docstring); before any dp reduction, which sums as well (the order commutes).
        Traffic: 2(p-1)/p * the weight's bytes per step."""
        for q, held in self.cut.tied:
            g = q.grad if held else torch.zeros(q.shape, dtype=self.grads.grad_dtype(),
                                                device=self.device)
            self.comm.all_reduce(g, self.mesh.pp_group, name="pp_tied_grad")

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        t = value.detach().float().reshape(1).clone()
        self.comm.broadcast(t, self.mesh.pp - 1, self.mesh.pp_group, name="metrics")
        return t[0]

    @torch.no_grad()
    def evaluate(self, x, y):
        self.model.eval()
        out = evaluate_stages(self.executor, self.batch_view(x), self.cut.width)
        self.model.train()
        if self.mesh.is_last_stage:
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
        self.report = timeline.summary(records, p.schedule, self.microbatches, self.v)
        if self.mesh.rank == 0 and png:
            timeline.draw(records, png, timeline.describe(self.report))
            self.report["png"] = png
        if self.mesh.rank == 0 and announce:
            print(timeline.describe(self.report) + (f"; picture: {png}" if png else ""), flush=True)
        self.report["records"] = records
        return self.report

    # -- state: the component's, under single-model names, merged over the stages ---------
    def _merged(self, own: dict) -> dict:
        merged: dict = {}
        for part in self.comm.all_gather_object(own, self.mesh.pp_group):
            merged.update(part)
        return merged

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under its single-model name: the component gathers dp and tp, the
        stages merge (one object all-gather over pp)."""
        name = self.model.global_name
        return self._merged({name(n): t for n, t in self.grads.full_state_dict().items()})

    def full_state_order(self) -> list[tuple[str, tuple[int, ...]]] | None:
        """(name, shape) of every parameter, stage after stage, for the streamed
        final.safetensors (shardwise/run/train._save_final): names and shapes travel as objects
        over pp, no tensor data; under tensor parallelism each shape is the whole one, and
        the component gathers a stage's pieces)."""
        return [item for part in self._stage_shapes() for item in part]

    def full_state_groups(self):
        """The whole model one stage at a time (a collective: every rank iterates it to the
        end): every stage gathers its parameters over dp (the component); in global rank 0's
        pp group stage s sends them to rank 0, which yields them; every other rank yields
        nothing. The memory of one stage's parameters per rank (rank 0: one more, received),
        never the whole model on every rank, as :meth:`full_state_dict`'s object all-gather
        over pp would hold it."""
        group, mine = self.mesh.pp_group, self.mesh.pp_rank
        column = 0 in group.ranks                   # the pp group holding global rank 0
        shapes = self._stage_shapes()
        state = self._stage_state()
        state = {n: state[n] for n, _ in shapes[mine]}      # a tied copy: its first stage's
        for stage in range(self.mesh.pp):
            if not column:
                yield {}
            elif stage == 0:
                yield state if mine == 0 else {}
            elif mine == stage:
                for t in state.values():
                    self.comm.send(t.float().to(self.device).contiguous(), 0, group,
                                   name="final_state")
                yield {}
            elif mine == 0:
                got = {}
                for n, shape in shapes[stage]:
                    buf = torch.empty(shape, dtype=torch.float32, device=self.device)
                    self.comm.recv(buf, stage, group, name="final_state")
                    got[n] = buf.cpu()
                yield got
            else:
                yield {}

    def _stage_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """Every stage's (single-model name, whole shape) of its parameters, a tied copy left to
        its first stage (read off the parameters, which keep their whole shape under every
        data-parallel stage: an object all-gather over pp, no tensor data)."""
        name = self.model.global_name
        own = [(name(n), self.grads.whole_shape(n, p)) for n, p in self.model.named_parameters()]
        return _first_owners(self.comm.all_gather_object(own, self.mesh.pp_group))

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under their single-model names (gathered over dp by the
        component; fp32, on the CPU)."""
        name = self.model.global_name
        return {name(n): t for n, t in self.grads.full_state_dict().items()}

    def state_dict(self) -> dict:
        return self.grads.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.grads.load_state_dict(state)

    def canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        name = self.model.global_name
        return self._merged({name(n): v for n, v in
                             self.grads.canonical_optimizer_state().items()})

    def load_canonical_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        name = self.model.global_name
        self.grads.load_canonical_optimizer_state(
            {n: state[name(n)] for n, _ in self.model.named_parameters() if name(n) in state})

    def close(self) -> None:
        self.grads.close()

    def memory_ledger(self) -> dict[str, int]:
        return self._with_transport(self.grads.memory_ledger())

    def memory_at_peak(self) -> dict[str, int]:
        return self._with_transport(self.grads.memory_at_peak())

    def _with_transport(self, ledger: dict) -> dict[str, int]:
        ledger = dict(ledger)
        ledger.pop("activations_peak", None)  # the executor runs the stage itself: not measured
        transport = self.executor.transport   # the shared-memory rings this stage touches
        ledger["comm_buffers"] += transport.local_bytes if transport is not None else 0
        return ledger


def _first_owners(parts: list[list[tuple[str, tuple]]]) -> list[list[tuple[str, tuple]]]:
    """Each stage's (name, shape) list without the names an earlier stage has (a weight tied
    across stages, GPT-2's lm_head on the last stage: written once, as the single model has
    it)."""
    seen, out = set(), []
    for part in parts:
        out.append([(n, shape) for n, shape in part if n not in seen])
        seen.update(n for n, _ in part)
    return out
