"""Shared pieces of the GPU suite (tests/gpu/, ``pytest -m gpu``).

Every GPU test trains in forked child processes (shardwise.launch.world.run_world), never in the pytest
process itself: a process that has touched CUDA cannot fork a child that uses CUDA, so the parent
only asks whether a device exists (through NVML, which starts no CUDA context).

Development aid, not a substitute: ``SHARDWISE_GPU_SUITE_DEVICE=cpu python -m pytest -m gpu`` runs
the same tests on the CPU (gloo instead of NCCL), so the suite's own logic can be checked on a
machine without a GPU. Only a run on CUDA says anything about the GPU path.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from reference import tiny_config

DEVICE = os.environ.get("SHARDWISE_GPU_SUITE_DEVICE", "cuda")
# a world of one process on the device's own backend: NCCL on a GPU
SOLO_BACKEND = "nccl" if DEVICE == "cuda" else "gloo"


def cuda_present() -> bool:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")   # no CUDA context in the parent
    return torch.cuda.is_available()


def marks(timeout: int = 600) -> list:
    """The marks of every GPU test module: selected by ``-m gpu``, skipped without CUDA."""
    return [pytest.mark.gpu, pytest.mark.timeout(timeout),
            pytest.mark.skipif(DEVICE == "cuda" and not cuda_present(),
                               reason="no CUDA device (the GPU suite needs one)")]


def config(strategy: str = "single", steps: int = 8, precision: str = "fp32", **parallel):
    """tests/reference.py's tiny GPT on the suite's device."""
    cfg = tiny_config(strategy, steps=steps, **parallel)
    return replace(cfg, train=replace(cfg.train, device=DEVICE),
                   memory=replace(cfg.memory, mixed_precision="no" if precision == "fp32" else precision),
                   logging=replace(cfg.logging, schedule_png="off"))


def on_cpu(params: dict) -> dict:
    """Tensors leave the child on the CPU: the parent must never load a CUDA tensor."""
    return {k: v.detach().float().cpu() for k, v in params.items()}


def train_on_device(cfg):
    """Train ``cfg`` in this child's world; (losses, full parameters on the CPU, device types
    the engine's parameters were on)."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    summary = train(cfg, init_runtime(cfg), quiet=True)
    engine = summary["engine"]
    kinds = sorted({p.device.type for p in engine.model.parameters()})
    params = on_cpu(engine.full_state_dict())
    engine.close()
    return summary["losses"], params, kinds


def single_reference(rank, n, cfgs):
    """Each config under ``single`` in a world of one (a child: the parent stays off CUDA)."""
    out = []
    for cfg in cfgs:
        c = replace(cfg, parallel=replace(cfg.parallel, strategy="single", dp=0, tp=1, pp=1))
        out.append(train_on_device(c))
    return out


def assert_close(got, expected, rtol, atol, why):
    losses, params, kinds = got
    assert kinds == [DEVICE], f"parameters were on {kinds}, not {DEVICE}"
    from shardwise.launch.world import assert_close_runs
    assert_close_runs(losses, expected[0], params, expected[1], rtol, atol, why=why)


def assert_near(got, ref, loss_rtol: float, param_rel: float, why: str):
    """Losses within ``loss_rtol`` at every step and the parameters' relative L2 distance within
    ``param_rel`` (where element-wise closeness is not expected: bf16, 8-bit states)."""
    losses, params, kinds = got
    assert kinds == [DEVICE], f"parameters were on {kinds}, not {DEVICE}"
    for step, (a, b) in enumerate(zip(losses, ref[0])):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: loss {a} vs {b} ({why})"
    num = sum(float((params[k] - ref[1][k]).norm() ** 2) for k in params) ** 0.5
    den = sum(float(ref[1][k].norm() ** 2) for k in params) ** 0.5
    assert num <= param_rel * den, f"parameters {num / den:.3g} apart ({why})"
