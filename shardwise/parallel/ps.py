"""Parameter-server training (TensorFlow's ps / worker jobs; Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014).

Roles: global ranks 0..P-1 are the ps tasks /job:ps/task:i, ranks P..P+W-1 the workers
/job:worker/task:j (between-graph replication: every worker runs the whole model on its own rows).

Partition: the trainable parameter tensors are split over the P ps tasks, balanced by bytes
(greedy by tensor, largest first). Each ps task holds the optimizer for its tensors and applies
the updates; workers hold a full copy of the parameters and no optimizer. Frozen parameters
(requires_grad False) belong to no ps: nothing pushes, steps or decays them.

Start: every rank takes global rank 0's parameters and buffers (one broadcast per tensor over the
world, meter ``ps_init``), so workers that initialised differently compute on the same model.
Buffers (BatchNorm statistics) travel with ps task 0's messages: every worker pushes its own, ps 0
keeps worker 0's (the lowest live worker's, if 0 failed) and every pull returns them, so all
workers start each step with worker 0's statistics, as under DDP (rank 0's per-shard
statistics; not an average). ps 0's replica holds them, so state_dict includes them.

Gradient clipping (``train.grad_clip``, sync mode): each ps task clips the workers' averaged
gradient with the global norm, its shard's squared norm summed over the ps tasks (one scalar
allreduce per step, meter ``ps_grad_norm``), which equals clipping in single-process training.
async / ssp apply each worker's gradient on its own, with no global mean to clip: refused.

fp16 mixed precision (``memory.mixed_precision = "fp16"``, dynamic loss scaling as in
memory/loss_scale.py): workers run forward under fp16 autocast with fp32 parameters and call
backward on loss x S; before pushing, a worker checks its gradients (its whole model) for inf /
nan, divides them by S (so the ps tasks always see true gradients, in fp32) and sends the
verdict in every push's header. Each rank keeps its own LossScaler (``strategy.scaler``):
  sync   if any worker's push for step k is non-finite, every ps task skips step k's update
         (no parameter, no optimizer state, no version moves; no clipping), answers every worker
         with ``skipped`` and the unchanged parameters, and every rank, ps and worker, halves S:
         the same verdict everywhere, as the all-reduced flag gives the other layouts. S doubles
         after 1000 clean steps in a row, on every rank alike. ``scaler.report()`` is the same
         on every rank (train.py's summary reads rank 0's, ps task 0's).
  async  a non-finite push is dropped by every ps task (not applied, not counted as applied,
  / ssp  counted in ``stats()["dropped"]``; its buffers are not kept); only that worker is told
         (``skipped``) and halves its own S; the other workers' pushes go on being applied.
         Each worker's S moves with its own verdicts (halve on a dropped push, double after 1000
         of its own clean pushes), so workers can hold different scales. A ps task keeps a copy
         of every worker's scaler (ps_server.WorkerScalers): its report gives the lowest worker
         scale as ``loss_scale`` and the dropped pushes (over every worker) as ``skipped_steps``.
The verdict is the worker's own check of its own gradients: no collective is added.

Traffic per step (K = model bytes): each worker pushes its gradients (K in all, K/P to each ps)
and pulls the parameters (K); the busiest ps task receives and sends about W*K/P each way, against
2(N-1)/N*K per rank for a ring allreduce. Transport: point-to-point over torch.distributed
(comm/ps_transport.py: why not torch RPC; why gloo on CPU, in a CUDA / NCCL run too), metered as
``ps_push`` / ``ps_pull``. The world collectives here (start, evaluation, gathers): run's device.

Memory per rank: a worker P + G (full parameters and gradients, no optimizer states); a ps task
its share of P, G and the optimizer states (~K/P each), plus the model replica the training loop
built, which it uses only to gather the whole model for evaluation and checkpoints.

Modes (parallel.ps_mode; the ps side is in ps_server.py): sync = one averaged update per step,
equal to single-process training on the global batch; async = each gradient applied on arrival
with weight 1/W; ssp = async with a worker at most ``staleness`` clocks ahead of the slowest.

The training loop calls train_step on every rank every step: a worker computes, pushes and pulls;
a ps task serves until every live worker's push for that step has been applied and answered, so
the loop's collectives (evaluation, logging) meet every rank at the same step. Between two such
collectives (every ``log_every`` / ``eval_every`` steps) async workers run freely. evaluate,
full_state_dict and state_dict are collectives: every ps broadcasts its tensors to the world.
A world of one has no worker: the strategy needs at least one ps and one worker.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from shardwise.comm.ps_transport import HEADER, Links, ServerEnd, WorkerEnd, pack, \
    partition_by_bytes, task_name, unpack
from shardwise.memory.loss_scale import has_nonfinite
from shardwise.config import ConfigError
from shardwise.data import batch as batches
from shardwise.parallel.ps_checks import parse_straggler
from shardwise.parallel.base import OptimizerFactory, Strategy, as_float, optimizer_state_bytes, \
    tensor_bytes
from shardwise.parallel.ps_server import ParamServer, WorkerScalers


class ParameterServerStrategy(Strategy):
    """ps tasks own byte-balanced shards of the parameters and their optimizer; workers compute."""
    name = "ps"

    def __init__(self, cfg, mesh, comm, device, loss_fn):
        super().__init__(cfg, mesh, comm, device, loss_fn)
        p = cfg.parallel
        self.num_ps = p.num_ps
        self.num_workers = p.num_workers or mesh.world_size - p.num_ps
        self.is_ps = mesh.rank < self.num_ps
        self.task = task_name(mesh.rank, self.num_ps)
        self.worker = None if self.is_ps else mesh.rank - self.num_ps
        self.straggle = parse_straggler(p.straggler, self.num_workers).get(self.worker, 1.0)
        self.steps_done = 0
        self.server: ParamServer | None = None

    # -- set-up ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        clip = self.cfg.train.grad_clip
        if clip > 0 and self.cfg.parallel.ps_mode != "sync":
            raise ConfigError("train.grad_clip", clip, f"ps_mode {self.cfg.parallel.ps_mode!r} "
                              "applies each worker's gradient on its own: there is no global "
                              "gradient to clip", "use ps_mode sync, or train.grad_clip 0")
        self.model = model.to(self.device)
        with torch.no_grad():   # every rank starts from rank 0's (ps task 0's) model
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                self.comm.broadcast(t.data, 0, self.mesh.world, name="ps_init")
        self.params = [t for t in self.model.parameters() if t.requires_grad]
        self.buffers = list(self.model.buffers())      # they travel with ps 0's messages
        sizes = [t.numel() * t.element_size() for t in self.params]
        self.shards = [[self.params[i] for i in idx]
                       for idx in partition_by_bytes(sizes, self.num_ps)]
        self.msg_numel = [HEADER + sum(t.numel() for t in s) for s in self.shards]
        self.msg_numel[0] += sum(t.numel() for t in self.buffers)
        timeout = self.cfg.parallel.ps_timeout
        links = Links(self.num_ps, self.num_workers, self.mesh.rank, servers_group=clip > 0,
                      device=self.device)
        self.links = links
        if self.is_ps:
            mine = self.shards[self.mesh.rank]
            self.optimizer = optimizer_factory(mine)
            end = ServerEnd(links, self.comm, self.mesh.rank, self.msg_numel[self.mesh.rank],
                            self.cfg.train.steps, timeout)
            if self.scaler.enabled and self.cfg.parallel.ps_mode != "sync":
                self.scaler = WorkerScalers(self.num_workers)   # one scale per worker (docstring)
            self.server = ParamServer(mine, self.optimizer, end, self.num_workers, self.cfg,
                                      self._extras(self.mesh.rank), links.servers, self.scaler)
        else:
            self.optimizer = None
            # a worker waits longer than a ps, so the ps names a failed worker first
            self.end = WorkerEnd(links, self.comm, self.worker, 2 * timeout)
            self.push_bufs = [links.empty(n) for n in self.msg_numel]
            self.pull_bufs = [links.empty(n) for n in self.msg_numel]
            self.versions = [0] * self.num_ps

    def _extras(self, j: int) -> list[torch.Tensor]:
        """What ps task j's messages carry after its parameters: the buffers for ps 0."""
        return self.buffers if j == 0 else []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        raise RuntimeError("ps: the ps tasks clip (train.grad_clip, sync mode) on the averaged "
                           "gradient; call engine.train_step(x, y)")

    def data_shard(self) -> tuple[int, int]:
        """Worker j trains on rows j/W; a ps task gets worker 0's rows and ignores them."""
        return (0 if self.is_ps else self.worker), self.num_workers

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:  # only ps tasks hold an optimizer
            super().set_lr(lr)

    # -- one step -------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """ps: serve this step; worker: compute, push, pull. Returns the step's mean loss
        (sync: the global batch's, on every rank; async / ssp: the worker's own, the ps the mean
        of what the workers sent)."""
        step, self.steps_done = self.steps_done, self.steps_done + 1
        last = self.steps_done == self.cfg.train.steps
        if self.is_ps:
            return self.server.serve(step, last)
        t0 = time.perf_counter()
        loss = self._compute(x, y)
        if self.straggle > 1:  # injected delay: this worker takes `factor` times its step time
            time.sleep((self.straggle - 1) * (time.perf_counter() - t0))
        mean = self._push_pull(loss)
        if last:
            self.end.close()
        return mean if self.cfg.parallel.ps_mode == "sync" else loss

    def _compute(self, x, y) -> float:
        """Forward / backward over grad_accum micro-batches; gradients left in .grad (fp16:
        times S, see ``_unscale``). ``x``: a tensor, a tuple or a dict of tensors (several
        inputs, shardwise/data/batch.py); ``y``: the targets, or None with ``loss_from``."""
        xs, ys = batches.chunk(x, self.grad_accum), batches.chunk(y, self.grad_accum)
        total = 0.0
        for xm, ym in zip(xs, ys):
            loss = self.batch_loss(xm, ym)
            self.backward(loss / len(xs))     # fp16: backward on loss x S (base.Strategy)
            total += float(loss.detach())
        return total / len(xs)

    @torch.no_grad()
    def _unscale(self) -> float:
        """fp16: 1.0 when any of this worker's gradients is inf / nan, else 0.0; the gradients
        are divided by S either way (an inf stays an inf). fp32 / bf16: 0.0, nothing touched."""
        if not self.scaler.enabled:
            return 0.0
        grads = [t.grad for t in self.params if t.grad is not None]
        nonfinite = float(has_nonfinite(grads, self.device).item())
        for g in grads:
            g.mul_(1.0 / self.scaler.scale)   # S is a power of two: exact
        return nonfinite

    @torch.no_grad()
    def _push_pull(self, loss: float) -> float:
        """Push each ps its gradients, then take its parameters back; the ps 0 header's loss.
        fp16: the pushes carry this worker's verdict, the answers whether the ps skipped."""
        clock = self.steps_done
        nonfinite = self._unscale()
        for j, shard in enumerate(self.shards):
            self.end.wait_pushed(j)
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in shard]
            self.end.push(j, pack((clock, self.versions[j], loss, nonfinite),
                                  grads + self._extras(j), self.push_bufs[j]))
        skipped = False
        for j, shard in enumerate(self.shards):
            self.end.pull(j, self.pull_bufs[j])
            self.versions[j] = int(self.pull_bufs[j][0])
            skipped |= bool(self.pull_bufs[j][2] != 0)   # every ps gives the same verdict
            unpack(self.pull_bufs[j], shard + self._extras(j))
        self.scaler.update(skipped)                     # no-op unless fp16
        for t in self.params:
            t.grad = None
        return float(self.pull_bufs[0][1])

    def step(self) -> None:
        raise NotImplementedError("ps: use train_step (the ps tasks own the optimizer step)")

    # -- whole-model views (collectives over the world) -------------------------------------
    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's model takes the ps tasks' current parameters (one broadcast per ps)."""
        for j, shard in enumerate(self.shards):
            flat = torch.empty(self.msg_numel[j], device=self.device)  # world: not the links
            if self.mesh.rank == j:
                pack((0.0,) * HEADER, shard + self._extras(j), flat)
            self.comm.broadcast(flat, j, self.mesh.world, name="ps_gather")
            unpack(flat, shard + self._extras(j))

    @torch.no_grad()
    def evaluate(self, x, y) -> tuple[float, float | None]:
        """Mean loss (and accuracy) of the current ps parameters over the workers' rows (``x``
        a tensor, tuple or dict; ``y`` None with ``loss_from``)."""
        self.gather_params()
        sums = torch.zeros(3, device=self.device)  # (loss, accuracy, workers) over the world
        acc = False
        if not self.is_ps:
            self.model.eval()
            out = batches.call(self.forward, batches.to(x, self.device))
            self.model.train()
            y = batches.to(y, self.device)
            acc = torch.is_tensor(out) and out.dim() == 2 and torch.is_tensor(y)
            sums[0] = self.loss_fn(as_float(out), y)
            sums[1] = (out.argmax(-1) == y).float().mean() if acc else 0.0
            sums[2] = 1.0
        flag = torch.tensor([float(acc)], device=self.device)
        self.comm.all_reduce(sums, self.mesh.world, name="metrics")
        self.comm.all_reduce(flag, self.mesh.world, op="max", name="metrics")
        return float(sums[0] / sums[2]), (float(sums[1] / sums[2]) if float(flag) else None)

    def full_state_order(self) -> None:
        """None: the whole model comes from the ps tasks at once (:meth:`full_state_dict`)."""
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model from the ps tasks, on every rank (a collective: all ranks call it)."""
        self.gather_params()
        return super().full_state_dict()

    def state_dict(self) -> dict:
        self.gather_params()
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.is_ps else None}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.is_ps and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # -- the layout-free optimizer state (shardwise/checkpoint/: reshard) --------------------
    def canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every ps task's optimizer state by parameter name, on every rank (one object
        all-gather over the world; a worker adds nothing)."""
        mine = super().canonical_optimizer_state() if self.is_ps else {}
        merged: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.comm.all_gather_object(mine, self.mesh.world):
            merged.update(part)
        return merged

    def load_canonical_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """A ps task keeps the entries of the tensors it owns; a worker holds no optimizer."""
        if not self.is_ps:
            return
        mine = {id(t) for t in self.shards[self.mesh.rank]}
        owned = {n for n, t in self.model.named_parameters() if id(t) in mine}
        super().load_canonical_optimizer_state({n: v for n, v in state.items() if n in owned})

    def stats(self) -> dict:
        """ps task: its update records (see ParamServer.stats); worker: its task name only."""
        return self.server.stats() if self.is_ps else {"task": self.task}

    def memory_ledger(self) -> dict[str, int]:
        buffers = sum(self.msg_numel) * 4 * 2
        if self.is_ps:
            mine = self.shards[self.mesh.rank]
            return {"parameters": tensor_bytes(mine), "gradients": tensor_bytes(mine),
                    "optimizer_states": optimizer_state_bytes(self.optimizer),
                    "master_weights": 0,
                    "comm_buffers": self.msg_numel[self.mesh.rank] * 4 * (2 * self.num_workers + 1),
                    "replica_for_gather": tensor_bytes(self.params)}
        return {"parameters": tensor_bytes(self.params), "gradients": tensor_bytes(self.params),
                "optimizer_states": 0, "master_weights": 0, "comm_buffers": buffers}
