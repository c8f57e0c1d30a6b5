"""The Python API for users who keep their own training script.

    import shardwise
    engine = shardwise.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                               shardwise.Config(), loss_fn=F.cross_entropy)
    x, y = engine.shard(x_global, y_global)      # this rank's rows of the global batch
    loss = engine.loss_fn(engine(x), y)
    engine.backward(loss)
    engine.clip_grad_norm_(1.0)                  # optional: the global norm, every shard counted
    engine.step()                                # also zeroes the gradients

or, equivalently (and the only form pipeline parallelism supports, since no single rank runs
the whole forward), ``loss = engine.train_step(x, y)``. Run the script with torchrun; without a
launcher it is a world of one and equals plain PyTorch.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.config import Config
from shardwise.data.sampler import shard_rows
from shardwise.layout import resolve
from shardwise.memory.optim8bit import make_adamw8bit
from shardwise.parallel.compose import parallelize
from shardwise.parallel.base import LossFn, OptimizerFactory, Strategy
from shardwise.runtime import Runtime, init_runtime
from shardwise.validate import validate


def optimizer_factory(cfg: Config) -> OptimizerFactory:
    """The optimizer a TrainConfig names, as a factory of parameter lists."""
    t = cfg.train

    def make(params):
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
        if t.optimizer == "adamw8bit":       # both moments in 8 bits (memory/optim8bit.py)
            return make_adamw8bit(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
        cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    return make


class Engine:
    """A model and optimizer under one strategy; mirrors the plain PyTorch loop's verbs."""

    def __init__(self, strategy: Strategy, runtime: Runtime):
        self.strategy, self.runtime = strategy, runtime

    @property
    def model(self) -> nn.Module:
        return self.strategy.model

    @property
    def optimizer(self):
        return self.strategy.optimizer

    @property
    def loss_fn(self) -> LossFn:
        return self.strategy.loss_fn

    @property
    def mesh(self):
        return self.runtime.mesh

    @property
    def meter(self):
        return self.runtime.comm.meter

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.strategy.forward(x)

    def shard(self, *tensors: torch.Tensor):
        """This process's rows of each global-batch tensor (what it must train on)."""
        index, count = self.strategy.data_shard()
        rows = shard_rows(tensors[0].shape[0], index, count)
        out = tuple(t[rows].to(self.runtime.device) for t in tensors)
        return out if len(out) > 1 else out[0]

    def backward(self, loss: torch.Tensor) -> None:
        self.strategy.backward(loss)

    def step(self) -> None:
        self.strategy.step()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a global L2 norm of ``max_norm`` (after they are reduced, over
        every shard and parallel axis); returns the norm before clipping, as
        torch.nn.utils.clip_grad_norm_ does. Call it between backward and step, on every rank."""
        return self.strategy.clip_grad_norm_(max_norm)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.strategy.no_sync()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.strategy.train_step(x, y)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor):
        return self.strategy.evaluate(x, y)

    def state_dict(self) -> dict:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state)

    def full_state_dict(self) -> dict:
        return self.strategy.full_state_dict()

    def close(self) -> None:
        """Release the strategy's threads and files (after the last step)."""
        self.strategy.close()


def prepare(model: nn.Module, optimizer_factory: OptimizerFactory, config: Config | None = None,
            *, loss_fn: LossFn | None = None, runtime: Runtime | None = None) -> Engine:
    """Wrap ``model`` for the config's layout in the launcher's world; build the optimizer.

    The layout is ``config.parallel``'s strategy preset, axis sizes and ``zero_stage``
    (shardwise/layout.py); shardwise/parallel/compose.py applies it in its documented order.

    optimizer_factory: called with the list of the model's trainable parameters (requires_grad;
    frozen ones are never given to an optimizer, so weight decay cannot move them) and returns a
    torch.optim.Optimizer, which may have several parameter groups (per-group lr, weight decay).
    Strategies that optimise flat buffers or shards call it once on the original parameters to
    learn each one's group, then build the same optimizer type over one flat per group.
    loss_fn: (output, target) -> scalar mean loss; default cross-entropy.
    """
    cfg = resolve(config or Config())
    rt = runtime or init_runtime(cfg)
    validate(cfg, rt.world_size)
    strategy = parallelize(model, optimizer_factory, cfg, rt.mesh, rt.comm, rt.device,
                           loss_fn or _default_loss)
    return Engine(strategy, rt)


def _default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
