"""Single-process data parallelism: d2l's "from scratch" scheme, one process, k replicas.

Partition: the model is replicated k times (one replica per CUDA device when there are k, else
k CPU replicas), each with its own optimizer; the global batch is scattered into k equal row
blocks. One Python thread drives each replica's forward and backward (torch releases the GIL
inside its kernels, so replicas run concurrently where the hardware allows).

Collectives (device copies, not torch.distributed): after backward every replica's gradients are
summed on replica 0 and the sum is broadcast back (d2l's ``allreduce``: gather to one
device, add, copy out), divided by k (mean gradient); then every replica runs its own optimizer
step on identical gradients, so the replicas stay identical.

Buffers (BatchNorm statistics) are copied from replica 0 to the others before each step's
forward, as DDP broadcasts them from dp rank 0. Clipping (``train.grad_clip``) runs on the mean
gradient, after the reduction: the norm is replica 0's, every replica is scaled the same.

fp16: one loss scale for all replicas; the overflow check reads every replica's gradients, each
device's flags combined on that device and one flag per device brought to the first
(memory/loss_scale.py's ``has_nonfinite``), so replicas on cuda:0..k-1 agree on skipping a step.

Memory: k full copies of parameters, gradients and optimizer state in one process.
Traffic per step: replica 0 receives (k-1) x 4P bytes and sends (k-1) x 4P bytes; metered as
``dp_reduce`` and ``dp_broadcast`` from replica 0's point of view.

Why DDP beats it (the usual DP vs DDP argument): one process means one GIL shared by all
replica threads, and all reduction work happens on replica 0 while the others wait; DDP runs a
process per replica and spreads the reduction over the ring. Reference: Dive into Deep Learning
(d2l), "Multi-GPU training", the from-scratch version.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy

import torch
import torch.nn as nn

from shardwise.data import batch as batches
from shardwise.parallel.base import OptimizerFactory, Strategy, as_float, grad_sq, \
    optimizer_state_bytes, tensor_bytes, trainable


def replica_devices(k: int, device: torch.device) -> list[torch.device]:
    """k CUDA devices when the machine has them, otherwise k replicas on ``device``."""
    if device.type == "cuda" and torch.cuda.device_count() >= k:
        return [torch.device("cuda", i) for i in range(k)]
    return [device] * k


class DataParallelStrategy(Strategy):
    name = "dp"

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        k = self.cfg.parallel.replicas
        self.devices = replica_devices(k, self.device)
        first = model.to(self.devices[0])
        self.replicas = [first] + [copy.deepcopy(first).to(d) for d in self.devices[1:]]
        self.optimizers = [optimizer_factory(trainable(r)) for r in self.replicas]
        self.model, self.optimizer = self.replicas[0], self.optimizers[0]
        self.pool = cf.ThreadPoolExecutor(max_workers=k, thread_name_prefix="shardwise-dp")

    def data_shard(self) -> tuple[int, int]:
        return 0, 1  # the one process takes the whole global batch and scatters it itself

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def _replica_backward(self, i: int, x, y) -> torch.Tensor:
        """Forward and backward of replica i over its rows (a tensor, tuple or dict of inputs;
        y None with the model's own loss), in ``grad_accum`` micro-batches."""
        model, dev = self.replicas[i], self.devices[i]
        xs, ys = batches.chunk(x, self.grad_accum), batches.chunk(y, self.grad_accum)
        total = torch.zeros((), device=dev)
        for xm, ym in zip(xs, ys):
            with self.autocast():
                out = batches.call(model, batches.to(xm, dev))
            loss = self.loss_fn(as_float(out), batches.to(ym, dev))
            self._scaled(loss / len(xs)).backward()
            total += loss.detach()
        return total / len(xs)

    def _allreduce_grads(self) -> None:
        """Sum every replica's gradients on replica 0, divide by k, copy the mean back out.
        Paired by parameter: a parameter no replica got a gradient for keeps None (skipped by
        the optimizers); one some replicas missed counts zero from them."""
        k = len(self.replicas)
        params = [list(r.parameters()) for r in self.replicas]
        nbytes = 0
        with torch.no_grad():
            for same in zip(*params):
                grads = [p.grad for p in same]
                if all(g is None for g in grads):
                    continue
                for p in same:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                g0 = same[0].grad
                for p in same[1:]:
                    g0.add_(p.grad.to(g0.device))
                g0.div_(k)
                for p in same[1:]:
                    p.grad.copy_(g0)
                nbytes += tensor_bytes([g0])
        self.comm.meter.record("dp_reduce", 0, (k - 1) * nbytes)
        self.comm.meter.record("dp_broadcast", (k - 1) * nbytes, 0)

    @torch.no_grad()
    def _copy_buffers(self) -> None:
        """Every replica takes replica 0's buffers (DDP's broadcast_buffers)."""
        first = list(self.replicas[0].buffers())
        for r in self.replicas[1:]:
            for b, b0 in zip(r.buffers(), first):
                b.copy_(b0)

    def train_step(self, x, y) -> float:
        k = len(self.replicas)
        xs, ys = batches.chunk(x, k), batches.chunk(y, k)   # scatter: replica i gets block i
        if len(xs) < k:
            raise ValueError(f"strategy dp: a batch of {batches.rows(x)} rows cannot feed "
                             f"{k} replicas; fix: give at least {k} rows a step")
        self._copy_buffers()
        losses = list(self.pool.map(self._replica_backward, range(k), xs, ys))
        if k > 1:
            self._allreduce_grads()
        if self.cfg.train.grad_clip > 0:
            super().clip_grad_norm_(self.cfg.train.grad_clip)
        if not self._overflowed():      # fp16 (parallel/scaling.py): skip a step that overflowed
            list(self.pool.map(lambda opt: opt.step(), self.optimizers))
        self._end_step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return float(sum(loss.to(self.devices[0]) for loss in losses) / k)

    _ONLY_TRAIN_STEP = ("strategy dp drives its replicas itself: call engine.train_step(x, y) "
                        "instead of engine(x) / engine.backward(loss) / engine.step()")

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(self._ONLY_TRAIN_STEP)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        raise RuntimeError(self._ONLY_TRAIN_STEP + " (with train.grad_clip set for clipping)")

    # clipping inside train_step: the replicas hold the same mean gradient after the reduction
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for r in self.replicas for p in r.parameters() if p.grad is not None]

    def _local_grad_sq(self) -> torch.Tensor:
        return grad_sq([p.grad for p in self.replicas[0].parameters() if p.grad is not None],
                       self.devices[0])

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self._grads():
            g.mul_(coef.to(g.device, g.dtype))

    def step(self) -> None:
        raise RuntimeError(self._ONLY_TRAIN_STEP)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for model, opt in zip(self.replicas, self.optimizers):
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

    # the layout-free optimizer state (checkpoint/canonical.py): replica 0's, as the base saves
    # it (every replica's is the same); loading gives each replica's optimizer its own copy
    def load_canonical_optimizer_state(self, state: dict) -> None:
        for model, opt in zip(self.replicas, self.optimizers):
            self._load_canonical_into(model, opt, state)

    def memory_ledger(self) -> dict[str, int]:
        params = [p for r in self.replicas for p in r.parameters()]
        return {"parameters": tensor_bytes(params),
                "gradients": tensor_bytes(p for p in params if p.requires_grad),
                "optimizer_states": sum(optimizer_state_bytes(o) for o in self.optimizers),
                "master_weights": 0, "comm_buffers": 0}
