"""The strategy contract: how a model is wrapped, how backward runs, how the step is taken.

Every strategy (single, ddp, dp, zero1-3, tp, pp, 3d, ps) is a subclass of :class:`Strategy`, and
one training loop (shardwise/train.py) and one user-facing engine (shardwise/api.py) drive them
all through these methods:

    wrap(model, optimizer_factory)   take ownership of the model, build the optimizer
    data_shard() -> (index, count)   which slice of each global batch this process trains on
    forward(x) -> output             the (possibly wrapped) model's forward
    backward(loss)                   backward, with whatever gradient traffic the strategy needs
    step()                           finish gradient traffic, optimizer step, zero the gradients
    train_step(x, y) -> float        one optimizer step on this process's shard of a global batch;
                                     returns the global batch's mean loss, the same on every rank
    evaluate(x, y) -> (loss, acc)    global mean loss (and accuracy for classifiers), no update
    full_state_dict() -> dict        the whole model's parameters by name (gathered if sharded)
    state_dict() / load_state_dict() model + optimizer, for checkpoints
    memory_ledger() -> dict          bytes this rank holds, by category

The base class is the plain single-process behaviour, so a subclass overrides only what differs.
Loss normalisation: each rank's loss is the mean over its own rows; gradients are averaged over
the data-parallel group; so the update equals single-process training on the mean over the global
batch when shards are equal (validate() makes them so).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm
from shardwise.config import Config
from shardwise.memory.amp import autocast_context
from shardwise.mesh import Mesh

OptimizerFactory = Callable[[list], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


class Strategy:
    """Plain training on one process; the reference every other strategy must equal."""
    name = "single"

    def __init__(self, cfg: Config, mesh: Mesh, comm: Comm, device: torch.device, loss_fn: LossFn):
        self.cfg, self.mesh, self.comm, self.device, self.loss_fn = cfg, mesh, comm, device, loss_fn
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_accum = cfg.memory.grad_accum

    # -- set-up ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self.model = model.to(self.device)
        self.optimizer = optimizer_factory(list(self.model.parameters()))

    def data_shard(self) -> tuple[int, int]:
        """(index, count): this process trains on rows index/count of each global batch."""
        return self.mesh.dp_rank, self.mesh.dp

    # -- one step -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model(x)

    def autocast(self):
        """The mixed-precision context (memory.mixed_precision) every strategy's forward uses."""
        return autocast_context(self.cfg.memory.mixed_precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient communication inside (accumulation micro-steps); plain: nothing to skip."""
        yield

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward / backward over ``grad_accum`` micro-batches of this rank's rows, then step."""
        xs, ys = x.chunk(self.grad_accum), y.chunk(self.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == len(xs) - 1
            ctx = contextlib.nullcontext() if last else self.no_sync()
            with ctx:
                loss = self.loss_fn(self.forward(xm.to(self.device)).float(), ym.to(self.device))
                self.backward(loss / len(xs))
            total += loss.detach()
        self.step()
        return self.reduce_mean(total / len(xs))

    def reduce_mean(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data shards (metered as 'metrics')."""
        index, count = self.data_shard()
        if count == 1:
            return float(value)
        t = value.detach().float().reshape(1).clone()
        self.comm.all_reduce(t, self.mesh.dp_group, op="avg", name="metrics")
        return float(t)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float | None]:
        """Global mean loss on (x, y) (this rank's rows), and accuracy for classifiers."""
        self.model.eval()
        out = self.forward(x.to(self.device))
        self.model.train()
        y = y.to(self.device)
        loss = self.loss_fn(out.float(), y)
        acc = None
        if out.dim() == 2:  # classifier logits (B, classes)
            acc = self.reduce_mean((out.argmax(-1) == y).float().mean())
        return self.reduce_mean(loss), acc

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, by its original name, on CPU."""
        return {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

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
        }
