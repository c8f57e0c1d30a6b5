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


# -- a model that returns a dict, a frozen layer, two parameter groups, clipping ---------------
# Reference: plain PyTorch on the whole batch with torch.nn.utils.clip_grad_norm_; max_norm is
# half the first step's unclipped norm (computed), so clipping binds. Tolerance fp32 rtol 1e-5,
# atol 1e-6: single runs the same ops except the norm (a sum of squares here, torch's norm of
# per-tensor norms: the clip coefficient differs in its last bits), dp sums 2 replicas'
# gradients in another order; over 5 AdamW steps at lr 1e-2 that stays within ~100 ulps.
class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(6, 6)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return {"logits": self.body(self.frozen(x))}


def _dict_loss(out, y):
    return nn.functional.cross_entropy(out["logits"], y)


def _groups(ps):
    return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-2)


def _batches(n=5):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _plain_dict(max_norm):
    model = DictNet()
    opt = _groups([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = _dict_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach() for k, v in model.named_parameters()}


def test_dict_outputs_frozen_groups_and_clipping_single_and_dp():
    max_norm = 0.5 * _plain_dict(float("inf"))[1][0]
    losses, norms, params = _plain_dict(max_norm)
    frozen = {k: v for k, v in DictNet().named_parameters() if k.startswith("frozen")}
    close = dict(rtol=1e-5, atol=1e-6)
    for strategy in ("single", "dp"):
        cfg = Config(parallel=ParallelConfig(strategy=strategy, replicas=2),
                     train=TrainConfig(device="cpu", batch_size=8, grad_clip=max_norm))
        engine = shardwise.prepare(DictNet(), _groups, cfg, loss_fn=_dict_loss)
        got = [engine.train_step(*engine.shard(x, y)) for x, y in _batches()]
        torch.testing.assert_close(got, losses, **close)
        torch.testing.assert_close(engine.full_state_dict(), params, **close)
        for k, v in frozen.items():
            assert torch.equal(engine.full_state_dict()[k], v), (strategy, k)
        loss, acc = engine.evaluate(*_batches(1)[0])   # a dict output: loss, no accuracy
        assert acc is None and loss == loss
        engine.close()
    # the user's loop on single: engine.clip_grad_norm_ returns torch's norm and clips
    cfg = Config(parallel=ParallelConfig(strategy="single"), train=TrainConfig(device="cpu"))
    engine = shardwise.prepare(DictNet(), _groups, cfg, loss_fn=_dict_loss)
    got = []
    for x, y in _batches():
        engine.optimizer.zero_grad()
        engine.backward(engine.loss_fn(engine(x), y))
        got.append(float(engine.clip_grad_norm_(max_norm)))
        engine.step()
    torch.testing.assert_close(got, norms, **close)
    torch.testing.assert_close(engine.full_state_dict(), params, **close)


def test_repeat_batch_overfits_one_batch():
    """--repeat-batch trains on the first batch every step: the loss on it falls steadily."""
    from dataclasses import replace as _replace

    from reference import tiny_config
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    cfg = tiny_config("single", steps=12)
    cfg = _replace(cfg, data=_replace(cfg.data, repeat_batch=True))
    losses = train(cfg, init_runtime(cfg), quiet=True)["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.7 * losses[0], losses
    other = train(_replace(cfg, data=_replace(cfg.data, repeat_batch=False)), quiet=True)["losses"]
    assert losses[0] == other[0] and losses[1:] != other[1:]     # the same first batch only
