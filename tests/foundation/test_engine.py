"""The Python API: prepare() with a user's own model, state_dict round trip, world of one."""
import copy

import pytest
import torch
import torch.nn as nn

import shardwise
from harness import run_world
from shardwise.config import Config, ParallelConfig, TrainConfig

pytestmark = pytest.mark.timeout(180)


def _train(engine, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        xs, ys = engine.shard(x, y)
        loss = engine.loss_fn(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def test_single_engine_equals_plain_pytorch():
    cfg = Config(parallel=ParallelConfig(strategy="single"), train=TrainConfig(device="cpu"))
    engine = shardwise.prepare(_net(), lambda ps: torch.optim.Adam(ps, lr=1e-2), cfg,
                               loss_fn=nn.functional.cross_entropy)
    ours = _train(engine, 5)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    plain = []
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        plain.append(loss.item())
    assert ours == plain  # the same ops in the same order: bit-identical
    torch.testing.assert_close(engine.full_state_dict(), dict(model.named_parameters()), rtol=0, atol=0)


def _resume(rank, n):
    cfg = Config(parallel=ParallelConfig(strategy="ddp"), train=TrainConfig(device="cpu"))
    opt = lambda ps: torch.optim.Adam(ps, lr=1e-2)
    a = shardwise.prepare(_net(), opt, cfg, loss_fn=nn.functional.cross_entropy)
    _train(a, 3)
    state = copy.deepcopy(a.state_dict())  # state_dict() holds live references, as in torch
    straight = _train(a, 2, seed=1)
    b = shardwise.prepare(_net(), opt, cfg, loss_fn=nn.functional.cross_entropy, runtime=a.runtime)
    b.load_state_dict(state)
    resumed = _train(b, 2, seed=1)
    return straight, resumed


def test_ddp_state_dict_resume_continues_identically():
    for straight, resumed in run_world(_resume, 2):
        assert straight == resumed
