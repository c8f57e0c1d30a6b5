"""DDP on the models people have, through the engine a user's own script drives: a Hugging Face
GPT2LMHeadModel (tied weights, ModelOutput outputs) with frozen parameters, two parameter groups,
gradient clipping and ranks seeded differently before prepare; a user loop that calls
``optimizer.zero_grad()`` / ``model.zero_grad()`` (torch's set_to_none), ``optimizer.step()``
and ``engine.clip_grad_norm_``; ``find_unused`` under AdamW; a BatchNorm CNN.

References (computed in this process, never typed): plain single-process training of rank 0's
model on the whole batch (torch.nn.utils.clip_grad_norm_ for clipping; torch.optim skipping a
parameter whose .grad is None for find_unused); for BatchNorm, user_models.bn_reference (each
shard normalised by its own statistics, running statistics those of rank 0's shard).

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py): DDP sums the ranks' gradients in
another order than one backward over the whole batch, and Adam turns last-bit differences of a
near-zero gradient element into a small fraction of lr (see LR below for GPT-2's key bias).
Frozen parameters: exact (no arithmetic touches them, so any difference is a bug).
"""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_world
from reference import ATOL, RTOL
from user_models import (UserNet, bn_net, bn_reference, freeze, gpt2, gpt2_loss, image_batches,
                         plain_run, token_batches, two_groups)

pytestmark = pytest.mark.timeout(300)
FROZEN = ("transformer.wpe.weight", "transformer.h.0.ln_1.weight")
STEPS, BATCH, SEED = 6, 8, 100
# GPT-2's attention key bias has an analytically zero gradient (softmax ignores a constant added
# to every score of a query), so its computed gradient is rounding noise g ~ 1e-10 in both runs;
# Adam moves it by about lr * g / eps (eps 1e-8) per step, and reordering changes g: at lr 1e-2
# that reached 1.8e-5 over 6 steps (over ATOL); at lr 1e-3 it stays ten times below ATOL.
LR = 1e-3
WHY = "fp32; the ranks' gradients are summed in another order"


def _cfg(find_unused=False, **train):
    from shardwise.config import Config, ParallelConfig, TrainConfig
    return Config(parallel=ParallelConfig(strategy="ddp", bucket_mb=0.01, find_unused=find_unused),
                  train=TrainConfig(batch_size=BATCH, device="cpu", steps=STEPS, **train))


def _hf_train_step(rank, max_norm):
    """train.grad_clip through engine.train_step; seeds differ per rank."""
    import shardwise
    model = gpt2(SEED + rank)
    freeze(model, FROZEN)
    engine = shardwise.prepare(model, two_groups(LR), _cfg(grad_clip=max_norm), loss_fn=gpt2_loss)
    losses = [engine.train_step(*engine.shard(x, y)) for x, y in token_batches(STEPS, BATCH)]
    strategy = engine.strategy       # the buckets live in the shared-memory all-reduce's mapping
    in_place = [strategy.reducer.in_place(b.buffer) for b in strategy.buckets.buckets]
    return losses, engine.full_state_dict(), (in_place, strategy.comm.spin)


def _hf_user_loop(rank, max_norm):
    """The user's loop: zero_grad (the optimizer's or the module's), loss.backward(), clip, then
    engine.step() or the optimizer's own step()."""
    import shardwise
    model = gpt2(SEED + rank)
    freeze(model, FROZEN)
    engine = shardwise.prepare(model, two_groups(LR), _cfg(), loss_fn=gpt2_loss)
    losses, norms = [], []
    for step, (x, y) in enumerate(token_batches(STEPS, BATCH)):
        (model.zero_grad if step % 2 else engine.optimizer.zero_grad)()   # set_to_none=True
        xs, ys = engine.shard(x, y)
        loss = gpt2_loss(engine(xs), ys)
        loss.backward()
        norms.append(float(engine.clip_grad_norm_(max_norm)))
        (engine.optimizer.step if step % 3 == 1 else engine.step)()   # the user's step, or ours
        losses.append(engine.strategy.reduce_mean(loss.detach()))
    return losses, norms, engine.full_state_dict()


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _branchy_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 10, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _find_unused(rank):
    import shardwise
    torch.manual_seed(SEED + rank)
    model = UserNet()
    cfg = _cfg(find_unused=True)
    engine = shardwise.prepare(model, _adamw, cfg, loss_fn=F.cross_entropy)
    for step, (x, y) in enumerate(_branchy_batches()):
        model.use_extra = step % 2 == 0
        xs, ys = engine.shard(x, y)
        engine.backward(engine.loss_fn(engine(xs), ys))
        engine.step()
    return engine.full_state_dict(), engine.meter.snapshot()


def _bn(rank, n):
    import shardwise
    engine = shardwise.prepare(bn_net(SEED + rank), _adamw, _cfg(), loss_fn=F.cross_entropy)
    losses = [engine.train_step(*engine.shard(x, y)) for x, y in image_batches(STEPS, BATCH)]
    x, y = next(image_batches(1, BATCH, seed=1))
    val, _ = engine.evaluate(*engine.shard(x, y))   # its forward takes rank 0's buffers
    buffers = {k: v.clone() for k, v in engine.model.named_buffers()}
    return losses, engine.full_state_dict(), buffers, val


def _world(rank, n, max_norm):
    return {"train_step": _hf_train_step(rank, max_norm), "user_loop": _hf_user_loop(rank, max_norm),
            "find_unused": _find_unused(rank), "bn": _bn(rank, n)}


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m} ({WHY})")


def _gpt2_reference():
    """Rank 0's model trained plainly; max_norm half the smallest unclipped norm, so it binds."""
    unclipped = plain_run(_frozen_gpt2(), two_groups(LR), token_batches(STEPS, BATCH), gpt2_loss,
                          max_norm=float("inf"))[1]
    max_norm = 0.5 * min(unclipped)
    losses, norms, params = plain_run(_frozen_gpt2(), two_groups(LR), token_batches(STEPS, BATCH),
                                      gpt2_loss, max_norm)
    assert all(norm > max_norm for norm in norms)   # clipping is active at every step
    return max_norm, losses, norms, params


def _frozen_gpt2():
    model = gpt2(SEED)
    freeze(model, FROZEN)
    return model


def _branchy_reference():
    torch.manual_seed(SEED)
    model = UserNet()
    opt = _adamw(model.parameters())
    for step, (x, y) in enumerate(_branchy_batches()):
        model.use_extra = step % 2 == 0
        opt.zero_grad()                      # set_to_none: the unused branch is skipped
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_hf_gpt2_user_loop_find_unused_and_batchnorm_under_ddp(world):
    max_norm, ref_losses, ref_norms, ref_params = _gpt2_reference()
    init = _frozen_gpt2()
    frozen = {k: v.detach() for k, v in init.named_parameters() if k in FROZEN}
    branchy = _branchy_reference()
    bn_losses, bn_params, bn_buffers, _ = bn_reference(bn_net(SEED), _adamw,
                                                    image_batches(STEPS, BATCH), world)
    bn_model = bn_net(SEED)
    bn_model.load_state_dict({**bn_params, **bn_buffers})
    bn_model.eval()
    x, y = next(image_batches(1, BATCH, seed=1))
    bn_val = float(F.cross_entropy(bn_model(x), y))

    for rank, res in enumerate(run_world(_world, world, max_norm)):
        losses, params, (in_place, polled) = res["train_step"]
        # the default all-reduce (auto) between the ranks of one host whose waits are polled
        # (ranks x threads within the cores: world 2 here) is shared memory, summing GPT-2's
        # buckets (several: bucket_mb 0.01) where backward wrote them; with more ranks than
        # cores (world 4 on 2) the backend's own, from ordinary buffers
        assert len(in_place) > 1 and in_place == [polled] * len(in_place), (in_place, polled)
        assert polled or world > len(os.sched_getaffinity(0)), world
        _close(losses, ref_losses, f"rank {rank} train_step losses")
        _close(params, ref_params, f"rank {rank} train_step parameters")
        losses, norms, user_params = res["user_loop"]
        _close(losses, ref_losses, f"rank {rank} user loop losses")
        _close(norms, ref_norms, f"rank {rank} clip_grad_norm_ vs torch's")
        _close(user_params, ref_params, f"rank {rank} user loop parameters")
        for name, value in frozen.items():   # frozen: bit for bit rank 0's initial values
            assert torch.equal(params[name], value) and torch.equal(user_params[name], value), name
        unused_params, meter = res["find_unused"]
        _close(unused_params, branchy, f"rank {rank} find_unused under AdamW")
        assert meter["ddp_unused"]["calls"] == STEPS
        losses, params, buffers, val = res["bn"]
        _close(losses, bn_losses, f"rank {rank} BatchNorm losses")
        _close(params, bn_params, f"rank {rank} BatchNorm parameters")
        _close(buffers, bn_buffers, f"rank {rank} BatchNorm buffers (rank 0's statistics)")
        _close(val, bn_val, f"rank {rank} evaluation with rank 0's running statistics")
