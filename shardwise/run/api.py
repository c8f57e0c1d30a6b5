"""The Python API for users who keep their own training script.

    import shardwise
    engine = shardwise.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                               shardwise.Config(), loss_fn=F.cross_entropy)
    x, y = engine.shard(x_global, y_global)      # this rank's rows of the global batch
    loss = engine.loss_fn(engine(x), y)          # engine(x): what model(x) returns, any layout
    engine.backward(loss)
    engine.clip_grad_norm_(1.0)                  # optional: the global norm, every shard counted
    engine.step()                                # also zeroes the gradients

or, equivalently (and the only form pipeline parallelism supports, since no single rank runs
the whole forward), ``loss = engine.train_step(x, y)``. Under tensor parallelism ``engine(x)``
gathers the whole logits (B*T*V per rank); ``engine.loss(x, y)`` and ``train_step`` keep the
vocab-parallel cross-entropy (no rank holds them all), and ``engine.local_logits(x)`` gives
this rank's vocabulary columns. Run the script with torchrun; without a
launcher it is a world of one and equals plain PyTorch.

Models with several inputs: a batch is a tensor, a tuple (positional inputs) or a dict (keyword
inputs) of tensors, rows first (shardwise/data/batch.py). With ``loss_from="loss"`` the engine
trains on the model's own loss (a Hugging Face model given ``labels``):

    engine = shardwise.prepare(hf_model, make_opt, cfg, loss_from="loss")
    batch = engine.shard({"input_ids": ids, "attention_mask": mask, "labels": labels})
    loss = engine.train_step(batch)              # or: engine.backward(engine.loss(batch)); step()
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.config import Config
from shardwise.data import batch as batches
from shardwise.data.sampler import shard_rows
from shardwise.parallel.layout import resolve
from shardwise.memory.optim8bit import make_adamw8bit
from shardwise.parallel.compose import parallelize
from shardwise.parallel.base import LossFn, OptimizerFactory, Strategy
from shardwise.run.runtime import Runtime, init_runtime
from shardwise.run.validate import validate


def optimizer_factory(cfg: Config) -> OptimizerFactory:
    """The optimizer a TrainConfig names, as a factory of parameter lists."""
    t = cfg.train

    def make(params):
        if t.optimizer == "adamw8bit":       # both moments in 8 bits (memory/optim8bit.py)
            return make_adamw8bit(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
        params = list(params)
        kernel = optimizer_kernel(params, t.optimizer_kernel)
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay, **kernel)
        cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95), **kernel)
    return make


def optimizer_kernel(params: list, kernel: str) -> dict:
    """The keyword that picks torch's implementation of the step (train.optimizer_kernel).

    ``fused``: one kernel for every tensor (``fused=True``) when all parameters are floating
    tensors on a device torch has fused kernels for (cpu and cuda among them), else ``foreach``;
    with DTensor parameters (a PyTorch peer's tensor parallelism) the per-tensor loop.
    Fused and loop agree to float rounding (the same formula, element by element); on this
    CPU fused AdamW stepped the 57M GPT in 41 ms against 370 ms for the loop (torch's CPU
    default). ``foreach``: one op per kind over all tensors. ``loop``: a tensor at a time.
    A meta tensor counts as fusable: it is a parameter not made yet (ZeRO-3 probes the factory on
    a meta-device model's parameters, then builds the optimizer on its CPU or CUDA masters)."""
    if kernel == "loop":
        return {"foreach": False}
    if kernel == "foreach":
        return {"foreach": True}
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    dtensor = sys.modules.get("torch.distributed.tensor")     # loaded when any DTensor exists
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in tensors):
        return {"foreach": False}      # neither fused nor foreach takes DTensors mixed with
    fusable = bool(tensors) and all(   # tensors (torch's own default there is this loop too)
        isinstance(p, torch.Tensor) and p.is_floating_point() and not p.is_sparse
        and (p.is_meta or p.device.type in _get_fused_kernels_supported_devices())
        for p in tensors)
    return {"fused": True} if fusable else {"foreach": True}


class Engine:
    """A model and optimizer under one strategy; mirrors the plain PyTorch loop's verbs."""

    def __init__(self, strategy: Strategy, runtime: Runtime, loss_from: str | int | None = None):
        self.strategy, self.runtime, self.loss_from = strategy, runtime, loss_from

    @property
    def model(self) -> nn.Module:
        return self.strategy.model

    @property
    def optimizer(self):
        return self.strategy.optimizer

    @property
    def loss_fn(self) -> LossFn:
        """The loss on what ``engine(x)`` returns: the one given to prepare (or the default
        cross-entropy), under every layout. (Under tensor parallelism the strategy's own loss,
        which train_step and engine.loss use, is the vocab-parallel one on this rank's logit
        columns: shardwise/parallel/tensor_loss.py.)"""
        return getattr(self.strategy.loss_fn, "on_whole", self.strategy.loss_fn)

    @property
    def mesh(self):
        return self.runtime.mesh

    @property
    def meter(self):
        return self.runtime.comm.meter

    def __call__(self, *args, **kwargs):
        """The model's forward, as ``model(*args, **kwargs)`` (e.g. ``engine(ids,
        attention_mask=mask)``): what the model returns on one process, under every layout.
        Under tensor parallelism with the head split on the vocabulary, the logits are the
        whole (B, T, V), all-gathered over tp inside autograd (B*T*V per rank; a loss on them
        backpropagates to each rank's columns); for the fast path use ``engine.loss(x, y)`` /
        ``engine.train_step(x, y)`` (vocab-parallel cross-entropy, no rank holds the whole
        logits), or ``engine.local_logits(x)`` for this rank's columns."""
        self._usable("engine(x)")
        out = self.strategy.forward(*args, **kwargs)
        whole = getattr(self.strategy.loss_fn, "whole_output", None)
        return out if whole is None else whole(out)

    def local_logits(self, *args, **kwargs) -> torch.Tensor:
        """The logits of the forward on this rank, as it holds them: under tensor parallelism
        with a vocabulary-split head, (..., V_local) = this tp rank's vocabulary columns
        ``shard_range(V, tp_rank, tp)`` (shardwise/comm/autograd.py: the first V % tp ranks hold
        one more); elsewhere the whole logits, as ``engine(x)``'s."""
        self._usable("engine.local_logits")
        from shardwise.models.build import logits_of
        return logits_of(self.strategy.forward(*args, **kwargs))

    def shard(self, *batches_):
        """This process's rows of each global batch (what it must train on): each argument a
        tensor, a tuple or a dict of tensors whose first dimension is the batch's rows."""
        index, count = self.strategy.data_shard()
        for b in batches_:
            batches.check(b)
        rows = shard_rows(batches.rows(batches_[0]), index, count)
        out = tuple(batches.to(batches.take(b, rows), self.runtime.device) for b in batches_)
        return out if len(out) > 1 else out[0]

    def loss(self, x, y=None) -> torch.Tensor:
        """Forward on this rank's batch ``x`` (tensor, tuple or dict) and the loss: ``loss_fn(
        output, y)``, or the model's own (``loss_from``; then y is None). For a loop of one's
        own: ``engine.backward(engine.loss(batch))``."""
        self._check(x, y, "engine.loss")
        return self.strategy.batch_loss(x, y)

    def loader(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
               collate_fn=None, num_workers: int = 0):
        """Your own map-style Dataset in global batches of ``batch_size``, this rank's rows of
        each, with a resumable position (state_dict / load_state_dict): shardwise/data/loader.py."""
        from shardwise.data.loader import ShardedLoader
        index, count = self.strategy.data_shard()
        return ShardedLoader(dataset, batch_size, index, count, shuffle=shuffle, seed=seed,
                             collate_fn=collate_fn, num_workers=num_workers)

    def backward(self, loss: torch.Tensor) -> None:
        self._usable("engine.backward")
        self.strategy.backward(loss)

    def step(self) -> None:
        self._usable("engine.step")
        self.strategy.step()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a global L2 norm of ``max_norm`` (after they are reduced, over
        every shard and parallel axis); returns the norm before clipping, as
        torch.nn.utils.clip_grad_norm_ does. Call it between backward and step, on every rank."""
        self._usable("engine.clip_grad_norm_")
        return self.strategy.clip_grad_norm_(max_norm)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.strategy.no_sync()

    def train_step(self, x, y=None) -> float:
        """One optimizer step on this rank's rows; x a tensor, a tuple (positional inputs) or
        a dict (keyword inputs: input_ids, attention_mask, labels...) of tensors, rows first;
        y the targets, or None with ``loss_from``. Returns the global batch's mean loss."""
        self._check(x, y, "engine.train_step")
        return self.strategy.train_step(x, y)

    def evaluate(self, x, y=None):
        """(global mean loss, accuracy or None) on this rank's rows; no update."""
        self._check(x, y, "engine.evaluate")
        return self.strategy.evaluate(x, y)

    def _usable(self, what: str) -> None:
        """Refuse to use a state moved into the run's last checkpoint (--checkpoint-move-last:
        the offload files' blocks were freed; they read zeros now)."""
        moved = getattr(self.strategy, "moved_to", None)
        if moved:
            raise RuntimeError(f"{what}: this engine's state was moved into the checkpoint "
                               f"{moved} at the end of the run (--checkpoint-move-last); fix: "
                               "load that checkpoint (--resume, or shardwise checkpoint "
                               "export) to go on")

    def _check(self, x, y, what: str) -> None:
        """Refuse a batch this engine cannot train on, with the fix."""
        self._usable(what)
        batches.check(x, f"{what} batch")
        batches.check(y, f"{what} target")
        if y is not None and batches.rows(y) != batches.rows(x):
            raise ValueError(f"{what}: the batch has {batches.rows(x)} rows and the target "
                             f"{batches.rows(y)}; fix: give both the same rows")
        if y is None and self.loss_from is None:
            raise ValueError(f"{what}: no target y, and the loss function needs one; fix: pass "
                             "y, or prepare(..., loss_from='loss') to train on the loss the "
                             "model computes from the labels in the batch")

    def state_dict(self) -> dict:
        self._usable("engine.state_dict")
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state)

    def full_state_dict(self) -> dict:
        self._usable("engine.full_state_dict")
        return self.strategy.full_state_dict()

    def close(self) -> None:
        """Release the strategy's threads and files (after the last step)."""
        self.strategy.close()


def prepare(model: nn.Module, optimizer_factory: OptimizerFactory, config: Config | None = None,
            *, loss_fn: LossFn | None = None, loss_from: str | int | None = None,
            runtime: Runtime | None = None) -> Engine:
    """Wrap ``model`` for the config's layout in the launcher's world; build the optimizer.

    The layout is ``config.parallel``'s strategy preset, axis sizes and ``zero_stage``
    (shardwise/parallel/layout.py); shardwise/parallel/compose.py applies it in its documented order.

    optimizer_factory: called with the list of the model's trainable parameters (requires_grad;
    frozen ones are never given to an optimizer, so weight decay cannot move them) and returns a
    torch.optim.Optimizer, which may have several parameter groups (per-group lr, weight decay).
    Strategies that optimise flat buffers or shards call it once on the original parameters to
    learn each one's group, then build the same optimizer type over one flat per group.
    loss_fn: (output, target) -> scalar mean loss; default cross-entropy.
    loss_from: instead of loss_fn, train on the loss the model returns: the key of its dict /
    ModelOutput output ("loss": Hugging Face models given ``labels``) or an index into its
    tuple; batches then carry the labels and train_step / evaluate take no target.
    """
    if loss_from is not None and loss_fn is not None:
        raise ValueError("prepare: give loss_fn or loss_from, not both (loss_from uses the "
                         "model's own loss, so loss_fn would be ignored); fix: drop one")
    cfg = resolve(config or Config())
    rt = runtime or init_runtime(cfg)
    validate(cfg, rt.world_size)
    if loss_from is not None:
        if rt.mesh.tp > 1:
            raise ValueError("prepare: loss_from under tensor parallelism: the tp GPT's loss "
                             "is the vocab-parallel cross-entropy on sharded logits, not the "
                             "model's own; fix: drop loss_from (or use tp = 1)")
        loss_fn = batches.loss_from(loss_from)
    strategy = parallelize(model, optimizer_factory, cfg, rt.mesh, rt.comm, rt.device,
                           loss_fn or _default_loss)
    return Engine(strategy, rt, loss_from)


def _default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


_default_loss.cross_entropy = True   # tp runs it vocab-parallel (parallel/tensor_loss.py)
