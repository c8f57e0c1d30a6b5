"""Automatic mixed precision: run forward (and so backward) under torch.autocast.

Parameters, gradients and optimizer states stay fp32 (the master copy); matrix products run in
bf16 or fp16. bf16 keeps fp32's exponent range, so no loss scaling is needed; fp16 does on GPUs
(use bf16 unless the hardware lacks it). Knows no strategy: strategies call ``autocast_context``
around their forward.
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(mixed_precision: str, device: torch.device):
    """The autocast context for a MemoryConfig.mixed_precision value ('no' = a null context)."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[mixed_precision])
