"""``--optimizer adamw8bit`` is shardwise's own AdamW8bit on every device, never bitsandbytes.

bitsandbytes keeps other state keys (state1 / state2 / qmap...) and fp32 states below 4096
values; substituting it on CUDA silently broke the memory report, ZeRO's offload (which rebuilds
the optimizer over CPU master views) and layout-free checkpoints. Here CUDA is pretended (the
parameters "are on CUDA") and a bitsandbytes module is importable: the choice must not change.
"""
import sys
import types

import pytest
import torch

from shardwise.run.api import optimizer_factory
from shardwise.config import Config, TrainConfig
from shardwise.memory import optim8bit
from shardwise.memory.optim8bit import AdamW8bit, make_adamw8bit

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cuda_and_bitsandbytes(monkeypatch):
    calls = []

    def bnb(params, **kw):
        calls.append(kw)
        return ("bitsandbytes", kw)
    fake = types.SimpleNamespace(optim=types.SimpleNamespace(AdamW8bit=bnb))
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    # the hook the old code used to ask "are all parameters on CUDA?" (gone now: no effect)
    monkeypatch.setattr(optim8bit, "_all_on_cuda", lambda tensors: True, raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return calls


def test_make_adamw8bit_is_ours_on_cuda_with_bitsandbytes(cuda_and_bitsandbytes):
    p = torch.nn.Parameter(torch.randn(5000))        # above bitsandbytes' 4096-value floor
    opt = make_adamw8bit([p], lr=1e-2, weight_decay=0.1)
    assert type(opt) is AdamW8bit and not cuda_and_bitsandbytes
    p.grad = torch.randn(5000)
    opt.step()
    assert set(opt.state[p]) == {"step", "codes", "absmax"}   # the keys the report reads
    assert opt.state[p]["codes"].dtype == torch.uint8


def test_optimizer_choice_adamw8bit_is_ours(cuda_and_bitsandbytes):
    make = optimizer_factory(Config(train=TrainConfig(optimizer="adamw8bit", lr=1e-3)))
    opt = make([torch.nn.Parameter(torch.zeros(8))])
    assert type(opt) is AdamW8bit and not cuda_and_bitsandbytes
