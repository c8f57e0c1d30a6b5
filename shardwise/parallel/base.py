"""The strategy contract: how a model is wrapped, how backward runs, how the step is taken.

Every strategy (single, ddp, dp, zero1-3, tp, pp, 3d, ps) is a subclass of :class:`Strategy`, and
one training loop (shardwise/run/train.py) and one user-facing engine (shardwise/run/api.py) drive them
all through these methods. A composed layout (parallel/compose.py) is two of them, each a
small contract of its own:

  the driver              how forward and backward run for one step: the plain loop below
                          (``train_step``: grad_accum passes, then clip and step), or a
                          pipeline (parallel/pipeline/driver.py: micro-batches, schedule,
                          executor, timeline)
  the gradient sync       the data-parallel component over dp (parallel/data/: DDP, ZeRO 1-3):
                          ``wrap`` attaches it to parameters and builds the optimizer on what
                          it shards; ``begin_pass`` / ``before_backward(last)`` / ``no_sync``
                          say which backward reduces; ``_finish_grad_sync`` completes the
                          step's reduction; ``step``, the clipping hooks, ``memory_ledger`` and
                          the state dicts finish the contract. Without a pipeline the
                          component is also the driver (it inherits the plain loop).

The whole contract:

    wrap(model, optimizer_factory)   take ownership of the model, build the optimizer
    data_shard() -> (index, count)   which slice of each global batch this process trains on
    forward(*args, **kwargs) -> out  the (possibly wrapped) model's forward
    backward(loss)                   backward, with whatever gradient traffic the strategy needs
    step()                           finish gradient traffic, optimizer step, zero the gradients
    clip_grad_norm_(max_norm)        finish gradient traffic, scale every gradient so that the
                                     whole model's gradient has L2 norm <= max_norm; returns the
                                     norm before clipping (= torch.nn.utils.clip_grad_norm_ on
                                     the single-process model)
    train_step(x, y) -> float        one optimizer step on this process's shard of a global batch;
                                     returns the global batch's mean loss, the same on every rank;
                                     x a tensor, a tuple (positional inputs) or a dict (keyword
                                     inputs) of tensors, rows first (shardwise/data/batch.py);
                                     y the targets, or None when the loss is the model's own
    evaluate(x, y) -> (loss, acc)    global mean loss (and accuracy for classifiers), no update
    full_state_dict() -> dict        the whole model's parameters by name (gathered if sharded)
    state_dict() / load_state_dict() model + optimizer, for checkpoints
    memory_ledger() -> dict          bytes this rank holds, by category (memory_at_peak(): at
                                     the instant its transients peaked; parallel/ledger.py)

The base class is the plain single-process behaviour, so a subclass overrides only what differs.

Model outputs: ``forward`` returns whatever the model returns (a tensor, a dict, a Hugging Face
ModelOutput, a tuple). A plain tensor is cast to fp32 before the loss (mixed precision computes
the loss in fp32); any other structure goes to ``loss_fn`` unchanged: the loss function is the
user's and knows the structure (e.g. ``lambda out, y: F.cross_entropy(out.logits.flatten(0, 1),
y.flatten())``). With ``prepare(..., loss_from="loss")`` the loss function reads the model's own
loss from its output and the target is None (shardwise/data/batch.py: ``loss_from``).

Gradient clipping (``clip_grad_norm_``, and ``train.grad_clip`` > 0 in ``train_step``) is built
from four hooks a strategy overrides where its gradients are reduced or sharded:

    _finish_grad_sync()     wait for every gradient reduction, so the gradients are final and
                            averaged; idempotent until step(), which then does not re-wait
    _local_grad_sq()        fp32 scalar: the sum of squares of the gradient entries this rank
                            owns, each entry of the whole model counted exactly once over the
                            ranks _sum_grad_sq sums over
    _sum_grad_sq(sq)        all-reduce (sum) over the groups that shard gradients; here: identity
    _scale_grads(coef)      multiply every gradient this rank will step with by coef

The coefficient is torch's: ``min(1, max_norm / (norm + 1e-6))``, applied always (x 1.0 is exact).
Loss normalisation: each rank's loss is the mean over its own rows; gradients are averaged over
the data-parallel group; so the update equals single-process training on the mean over the global
batch when shards are equal (validate() makes them so).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm
from shardwise.config import Config
from shardwise.data import batch as batches
from shardwise.memory.amp import autocast_context
from shardwise.mesh import Mesh
from shardwise.parallel.ledger import ActivationLedger
from shardwise.parallel.scaling import LossScaling
from shardwise.parallel.state import StrategyState

OptimizerFactory = Callable[[list], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should see: frozen ones (requires_grad False) are left out, so
    that weight decay never moves them and the user's factory can build its groups from them."""
    return [p for p in model.parameters() if p.requires_grad]


def probe_groups(optimizer_factory: OptimizerFactory, params: list[nn.Parameter]):
    """Call the user's factory once on the original ``params`` to learn their parameter groups.

    Returns (probe, groups): groups = [(options, [params of that group, in ``params`` order])]
    for every non-empty group, in the probe's order. A strategy that optimises flat buffers
    builds one flat per group and then ``optimizer_like(probe, ...)`` over the flats. Raises
    when the factory left a parameter out (a flat cannot hold a parameter no group steps)."""
    probe = optimizer_factory(params)
    group_of = {}
    for g, group in enumerate(probe.param_groups):
        for p in group["params"]:
            group_of[id(p)] = g
    missing = [i for i, p in enumerate(params) if id(p) not in group_of]
    if missing:
        raise ValueError(f"optimizer_factory left {len(missing)} of the {len(params)} trainable "
                         "parameters it was given out of every parameter group; fix: put each "
                         "one in a group (or freeze it with requires_grad_(False) before prepare)")
    groups = []
    for g, group in enumerate(probe.param_groups):
        members = [p for p in params if group_of[id(p)] == g]
        if members:
            groups.append(({k: v for k, v in group.items() if k != "params"}, members))
    return probe, groups


def optimizer_like(probe: torch.optim.Optimizer, groups: list[tuple[dict, list]]):
    """An optimizer of the probe's type and options over new tensors, one group per
    (options, tensors). ``type(probe)(groups, **probe.defaults)``, with the defaults restricted
    to what the constructor accepts (AdamW's defaults carry ``decoupled_weight_decay``, which
    AdamW's constructor refuses; the group options keep it)."""
    return type(probe)([{**options, "params": list(tensors)} for options, tensors in groups],
                       **constructor_defaults(probe))


def constructor_defaults(probe: torch.optim.Optimizer) -> dict:
    """The probe's defaults that its constructor accepts (AdamW's defaults also hold
    ``decoupled_weight_decay``, which its constructor refuses; every group keeps its options)."""
    accepted = inspect.signature(type(probe).__init__).parameters
    return {k: v for k, v in probe.defaults.items() if k in accepted}


def as_float(out):
    """A tensor output cast to fp32 (the loss runs in fp32); any other structure unchanged."""
    return out.float() if torch.is_tensor(out) else out


def grad_sq(grads, device) -> torch.Tensor:
    """Sum of squares of every entry of ``grads``, accumulated in fp32 (a scalar on ``device``)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32).square()
    return total


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


class Strategy(ActivationLedger, LossScaling, StrategyState):
    """Plain training on one process; the reference every other strategy must equal."""
    name = "single"
    # every rank's parameters were made from the seed, identically (a meta-device build,
    # models/init.py): a data-parallel component skips its start-up broadcast (compose.py)
    deterministic_start = False
    # --ft-replicas: the replica groups (parallel/replicas.py) whose reduce() a component's
    # _finish_grad_sync calls once a step on its reduced gradients; None without. Not named
    # ``replicas``: ZeRO's HSDP replica group and dp's model copies have that name
    ft = None

    def __init__(self, cfg: Config, mesh: Mesh, comm: Comm, device: torch.device, loss_fn: LossFn):
        self.cfg, self.mesh, self.comm, self.device, self.loss_fn = cfg, mesh, comm, device, loss_fn
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_accum = cfg.memory.grad_accum
        self.plan = None      # a TensorPlan when the model is tensor-parallel (compose.py)
        self._init_activation_ledger()   # parallel/ledger.py
        self._init_loss_scaling()        # parallel/scaling.py (fp16)

    # -- set-up ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self.model = model.to(self.device)
        self.optimizer = optimizer_factory(trainable(self.model))

    def data_shard(self) -> tuple[int, int]:
        """(index, count): this process trains on rows index/count of each global batch."""
        return self.mesh.dp_rank, self.mesh.dp

    # -- one step -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The model's forward on its inputs, as ``model(*args, **kwargs)``."""
        if not torch.is_grad_enabled():
            with self.autocast():
                return self.model(*args, **kwargs)
        with self.autocast(), self._measure_activations():
            return self.model(*args, **kwargs)

    def batch_loss(self, x, y):
        """Forward on a batch (a tensor, a tuple of positional inputs or a dict of keyword
        inputs: shardwise/data/batch.py) and the loss on it; ``y`` is None when the loss is
        the model's own (``prepare(..., loss_from=...)``)."""
        out = batches.call(self.forward, batches.to(x, self.device))
        return self.loss_fn(as_float(out), batches.to(y, self.device))

    def autocast(self):
        """The mixed-precision context (memory.mixed_precision) every strategy's forward uses."""
        return autocast_context(self.cfg.memory.mixed_precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        self._scaled(loss).backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient communication inside (accumulation micro-steps); plain: nothing to skip."""
        yield

    # -- the gradient-sync contract as a driver other than train_step uses it ----------------
    accumulate_unsharded = False   # a pipeline's request: keep gradients whole until reduced

    def begin_pass(self) -> None:
        """A driver starts a step's pass of forwards and backwards that it runs itself (the
        pipeline: one per grad_accum pass): count gradients afresh. Plain: nothing to count."""

    def before_backward(self, last: bool) -> None:
        """Before each backward a driver runs itself: ``last`` when it is the step's final one,
        which may reduce as gradients arrive; the others accumulate locally. Plain: nothing."""

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradients this rank accumulates (a driver's placeholders match)."""
        return next((q.dtype for q in self.model.parameters() if q.requires_grad), torch.float32)

    def step(self) -> None:
        if not self._overflowed():       # fp16: skipped on every rank when any overflowed
            self.optimizer.step()
        self._end_step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- gradient clipping (see the module docstring for the hooks) ------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the
        norm before clipping (fp32 scalar, the same on every rank). Call between backward and
        step; collectives: whatever ``_finish_grad_sync`` and ``_sum_grad_sq`` need."""
        self._finish_grad_sync()
        if self._overflowed():           # fp16: this step is skipped; nothing to clip
            return torch.tensor(float("inf"), device=self.device)
        total = self._sum_grad_sq(self._local_grad_sq()).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._scale_grads(coef)
        return total

    def _clip_if_configured(self) -> None:
        """``train.grad_clip`` > 0: clip before the step (every train_step calls this)."""
        if self.cfg.train.grad_clip > 0:
            self.clip_grad_norm_(self.cfg.train.grad_clip)

    def _finish_grad_sync(self) -> None:
        """Plain training: the gradients are final when backward returns."""

    def _grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps with (trainable parameters that have one)."""
        return [p.grad for p in self.model.parameters() if p.requires_grad and p.grad is not None]

    def _local_grad_sq(self) -> torch.Tensor:
        if self.plan is None:
            return grad_sq(self._grads(), self.device)
        return grad_sq([p.grad for n, p in self.model.named_parameters() if p.requires_grad
                        and p.grad is not None and self.plan.counts(n)], self.device)

    def _sum_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """Over the tensor-parallel group when the model is split (each entry counted once)."""
        return sq if self.plan is None else self.plan.sum_sq(sq)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self._grads():
            g.mul_(coef.to(g.dtype))

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, x, y) -> float:
        """Forward / backward over ``grad_accum`` micro-batches of this rank's rows, then step.
        ``x``: a tensor, tuple or dict of tensors (rows first); ``y``: targets or None."""
        xs, ys = batches.chunk(x, self.grad_accum), batches.chunk(y, self.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == len(xs) - 1
            ctx = contextlib.nullcontext() if last else self.no_sync()
            with ctx:
                loss = self.batch_loss(xm, ym)
                total += loss.detach()
                if last:   # the loss is known: average it while backward and step run
                    self.local_loss = total / len(xs)    # this rank's own (--ft-replicas)
                    mean = self.launch_mean(self.local_loss)
                self.backward(loss / len(xs))
        self._clip_if_configured()
        self.step()
        return mean()

    def launch_mean(self, value: torch.Tensor):
        """Start averaging a per-rank scalar over the data shards (metered as 'metrics'); the
        returned callable waits and gives the float. Launched asynchronously right after the
        last forward, so the ranks meet in the backend's thread while backward computes instead
        of in a blocking collective after the step (one sync point a step, not two). Every rank
        launches it at the same point, before backward's collectives, so the order matches."""
        t = value.detach().float().reshape(1).clone()
        if self._averaged_over() == 1:
            return lambda: float(t)
        work = self.comm.all_reduce(t, self.mesh.grad_group, op="avg", async_op=True,
                                    name="metrics")

        def wait() -> float:
            work.wait()
            return float(t)
        return wait

    def _averaged_over(self) -> int:
        """How many ranks a per-rank metric is averaged over: the data shards, and under
        context parallelism their sequence parts too (each rank's loss covers its part)."""
        return self.data_shard()[1] * self.mesh.cp

    def reduce_mean(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data shards (metered as 'metrics')."""
        if self._averaged_over() == 1:
            return float(value)
        t = value.detach().float().reshape(1).clone()
        self.comm.all_reduce(t, self.mesh.grad_group, op="avg", name="metrics")
        return float(t)

    @torch.no_grad()
    def evaluate(self, x, y) -> tuple[float, float | None]:
        """Global mean loss on (x, y) (this rank's rows), and accuracy for classifiers."""
        self.model.eval()
        out = batches.call(self.forward, batches.to(x, self.device))
        self.model.train()
        y = batches.to(y, self.device)
        loss = self.loss_fn(as_float(out), y)
        acc = None
        if torch.is_tensor(out) and out.dim() == 2 and torch.is_tensor(y):  # classifier (B, C)
            acc = self.reduce_mean((out.argmax(-1) == y).float().mean())
        return self.reduce_mean(loss), acc

    def close(self) -> None:
        """Release threads, files and buffers the strategy holds (the model stays usable)."""

    def memory_ledger(self) -> dict[str, int]:
        """Bytes this rank holds, by the categories the planner predicts."""
        params = list(self.model.parameters())
        return {
            "parameters": tensor_bytes(params),
            # gradients are held from backward to step: one per trainable parameter at the peak
            "gradients": tensor_bytes(p for p in params if p.requires_grad),
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,
            "comm_buffers": 0,
            "activations_peak": self._act_peak,
        }
