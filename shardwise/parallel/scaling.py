"""fp16 dynamic loss scaling for every layout that keeps fp32 parameters under autocast (single,
DDP, tensor and pipeline parallelism, one-process DP). A mixin of base.Strategy; the scaler
itself is memory/loss_scale.py. (ZeRO keeps fp16 working copies and fp32 masters, and drives the
same scaler from its own step: parallel/data/zero.py.)

Per step, with ``memory.mixed_precision = "fp16"``:

    backward      the loss times S (``_scaled``)
    clip / step   once the gradients are final (``_finish_grad_sync``: reduced over dp), every
                  rank checks its own gradients for inf / nan and one all-reduce (max) over the
                  whole world gives every rank the same verdict (meter ``amp_overflow``: 4 bytes);
                  clean: the gradients are divided by S, then clipped and stepped as usual;
                  overflow: the optimizer step is skipped on every rank (parameters and optimizer
                  states do not move), the gradients are zeroed and S halves
    after         S doubles after ``growth_interval`` (1000) clean steps in a row

The verdict is taken once per step (``_overflowed`` is idempotent until ``_end_step``), so
clipping and the step share it. A user's own loop must step with ``engine.step()`` (which can
skip); calling the optimizer's own ``step()`` under fp16 raises, since torch.optim cannot skip.
"""
from __future__ import annotations

import torch

from shardwise.memory.loss_scale import LossScaler, has_nonfinite


class LossScaling:
    """The per-step overflow gate (module docstring)."""

    def _init_loss_scaling(self) -> None:
        self.scaler = LossScaler(self.cfg.memory.mixed_precision == "fp16")
        self._overflow: bool | None = None      # this step's verdict, once taken

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scaled(loss)

    @torch.no_grad()
    def _overflowed(self) -> bool:
        """Whether this step's gradients hold an inf / nan on any rank (then: skip). Unscales the
        gradients when they are clean. Collectives: ``_finish_grad_sync``'s, one all-reduce."""
        if not self.scaler.enabled:
            return False
        if self._overflow is None:
            self._finish_grad_sync()
            flag = has_nonfinite(self._grads(), self.device)
            self.comm.all_reduce(flag, self.mesh.world, op="max", name="amp_overflow")
            self._overflow = bool(flag.item())
            if not self._overflow:
                self._scale_grads(torch.tensor(1.0 / self.scaler.scale, device=self.device))
        return self._overflow

    def _end_step(self) -> bool:
        """After the step was taken or skipped: move S; returns whether the step was skipped."""
        skipped = bool(self._overflow)
        if self.scaler.enabled:
            self.scaler.update(skipped)
        self._overflow = None
        return skipped

    def _check_user_step(self) -> None:
        """An optimizer.step() not driven by the strategy, under fp16: refused (module docstring)."""
        if self.scaler.enabled and self._overflow is None:
            raise RuntimeError("fp16 loss scaling: step with engine.step() (or train_step), which "
                               "unscales the gradients and skips a step that overflowed; the "
                               "optimizer's own step() cannot skip")
