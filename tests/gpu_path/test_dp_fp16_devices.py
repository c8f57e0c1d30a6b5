"""fp16's overflow flag over gradients on several devices (one-process DP, a replica per GPU).

With ``--strategy dp --replicas k`` on k GPUs the replicas' gradients live on cuda:0..k-1, and the
loss scaler's inf / nan check took ``torch.stack`` of per-tensor flags from every device, which
fails across devices. A CPU has one real device; 'meta' is a second one that shows the same
mismatch (torch.stack refuses cpu with meta exactly as cuda:0 with cuda:1).
"""
from dataclasses import replace

import pytest
import torch

from reference import run, tiny_config
from shardwise.memory.loss_scale import has_nonfinite

pytestmark = pytest.mark.timeout(120)


def test_flags_from_two_devices_are_combined_on_the_target_device():
    grads = [torch.ones(3), torch.ones(4, device="meta"), None, torch.ones(2)]
    flag = has_nonfinite(grads, torch.device("meta"))
    assert flag.device.type == "meta" and flag.shape == (1,) and flag.dtype == torch.float32


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), None])
def test_verdict_is_unchanged_on_one_device(bad):
    grads = [torch.ones(3), torch.zeros(0), torch.ones(5)]
    if bad is not None:
        grads[2][3] = bad
    flag = has_nonfinite(grads, torch.device("cpu"))
    assert flag.tolist() == [0.0 if bad is None else 1.0]
    assert has_nonfinite([], torch.device("cpu")).tolist() == [0.0]


def test_dp_fp16_two_replicas_trains():
    cfg = tiny_config("dp", steps=3, replicas=2)
    cfg = replace(cfg, memory=replace(cfg.memory, mixed_precision="fp16"))
    losses, _ = run(cfg)
    assert len(losses) == 3 and all(l == l for l in losses)
