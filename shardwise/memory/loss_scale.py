"""Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", 2018).

fp16 has five exponent bits: gradients below about 6e-8 flush to zero. The loss is multiplied by
a scale S before backward, so every gradient is S times larger and stays representable; before
the optimizer step the gradients are divided by S again (in fp32). When any gradient on any rank
is inf or nan the scale was too large: the step is skipped (no parameter, no optimizer state
moves), S is halved, and the next step tries again. After ``growth_interval`` clean steps in a
row S is doubled, so it tracks the largest scale that does not overflow. torch.amp.GradScaler
does the same with the same defaults but one difference: its inf check is per process, while
a sharded or split model needs every rank to agree (a rank that skips while another steps would
desynchronise them), so the strategies all-reduce the flag over the whole world (meter
``amp_overflow``, one float per step). bf16 has fp32's exponent range and needs none of this.

Knows no strategy: parallel/base.py and ZeRO (parallel/data/zero.py) drive it.
"""
from __future__ import annotations

import torch


class LossScaler:
    """S, the clean-step count and the skipped steps (all reported by the training loop)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 factor: float = 2.0, min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.factor, self.min_scale = growth_interval, factor, min_scale
        self.clean_steps = 0          # steps since the last overflow (or growth)
        self.skipped_steps = 0        # steps skipped for an overflow, over the run

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss * self.scale if self.enabled else loss

    def update(self, overflow: bool) -> None:
        """After a step's overflow check (the same verdict on every rank)."""
        if not self.enabled:
            return
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale = max(self.min_scale, self.scale / self.factor)
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.factor

    def report(self) -> dict | None:
        """What the loop logs: the current scale and how many steps were skipped."""
        if not self.enabled:
            return None
        return {"loss_scale": self.scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.skipped_steps = state["skipped_steps"]


def has_nonfinite(tensors, device: torch.device) -> torch.Tensor:
    """1.0 when any entry of ``tensors`` is inf or nan, else 0.0: a one-element fp32 tensor on
    ``device``, ready to be all-reduced with max (no host sync until the verdict is read).
    The tensors may live on several devices (one-process DP's replicas on cuda:0, cuda:1, ...):
    each device's flags are combined there, and one flag per device is brought to ``device``."""
    checks: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel():
            checks.setdefault(t.device, []).append(torch.isfinite(t).all())
    if not checks:
        return torch.zeros(1, device=device)
    finite = [torch.stack(flags).all().to(device) for flags in checks.values()]   # one a device
    return (~torch.stack(finite).all()).float().reshape(1)
