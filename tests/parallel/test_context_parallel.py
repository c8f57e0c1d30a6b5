"""Context parallelism (--cp, --cp-impl ring|ulysses): every sequence cut over the cp ranks,
attention by ring attention or Ulysses' all-to-alls (shardwise/parallel/context.py,
shardwise/comm/context.py).

The attention alone, causal, at sequences 1024 and 4096 (cp 2 and 4, both implementations):
outputs and the gradients of q, k and v equal torch's scaled_dot_product_attention on the whole
sequence, fp32 within 1e-5 (the ring merges blocks by log-sum-exp: another summation order).
Training: equal to one process on our GPT at cp 2 (ring and Ulysses, world 2), cp 4 (Ulysses)
and dp 2 x cp 2 under ZeRO-1 and ZeRO-3 (world 4), with ranks seeded differently before
``prepare``, two AdamW parameter groups, clipping that binds at every step, a user's own loss on
``engine(x)`` (the whole sequence's logits, gathered) and shardwise's loss on each rank's part;
and shardwise's own loop (``train``) against ``single``. The meter's cp bytes per step equal the
formulas of comm/context.py's docstring. Bad settings are refused before launch in one line.

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py says why), with
assert_close_runs' strays rule where Adam meets a near-zero gradient; lr 1e-3 as in
test_sequence_parallel.py.
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness import assert_close_but_for_strays, assert_close_runs, run_world
from models_hf import SEQ, VOCAB, one_process_loop, token_batches, two_groups
from reference import ATOL, RTOL, single_run, tiny_config

from shardwise import cli
from shardwise.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.models import build_model

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MAX_NORM, SEED, LR = 4, 8, 0.5, 100, 1e-3
GPT = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB)
WHY = "fp32; the ring's log-sum-exp merge and the gradient average over dp x cp reorder sums"


def user_loss(out, y):
    """A user's own next-token loss on the whole logits (under cp they are gathered)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _cfg(strategy="ddp", cp=2, impl="ring", **parallel):
    parallel = ParallelConfig(strategy=strategy, cp=cp, cp_impl=impl, **parallel)
    return Config(model=GPT, data=DataConfig(dataset="synthetic"), parallel=parallel,
                  train=TrainConfig(batch_size=BATCH, device="cpu"))


def _loop(rank, tag, cfg):
    """The user's loop on a model seeded by rank: -ce runs shardwise's loss on this rank's part."""
    import shardwise
    engine = shardwise.prepare(build_model(GPT, SEED + rank), two_groups(LR), cfg,
                               loss_fn=None if tag.endswith("-ce") else user_loss)
    losses, norms = [], []
    for x, y in token_batches(STEPS, BATCH):
        xs, ys = engine.shard(x, y)
        loss = engine.loss(xs, ys) if tag.endswith("-ce") else engine.loss_fn(engine(xs), ys)
        engine.backward(loss)
        norms.append(float(engine.strategy.clip_grad_norm_(MAX_NORM)))
        engine.step()
        losses.append(engine.strategy.reduce_mean(loss.detach()))
    out = dict(losses=losses, norms=norms, params=engine.full_state_dict(),
               logits_shape=tuple(engine(xs).shape))
    engine.close()
    return out


def _attention(rank, n, impl, seq):
    """Ring or Ulysses on this rank's positions against sdpa on the whole sequence."""
    import torch.distributed as dist
    from shardwise.comm.collectives import Comm, CommMeter, Group
    from shardwise.comm.context import positions, ring_attention, ulysses_attention
    g = torch.Generator().manual_seed(0)
    B, h, d = 1, 4, 8
    q, k, v, dout = (torch.randn(B, h, seq, d, generator=g) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(dout)
    mine = positions(seq, n, rank)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    fn = ring_attention if impl == "ring" else ulysses_attention
    group = Group(dist.group.WORLD, tuple(range(n)), rank)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, mine]
    out = fn(*local, Comm(CommMeter()), group)
    out.backward(dout[:, :, mine])
    return {"out": (out.detach(), want),
            **{f"d{name}": (t.grad, w.grad[:, :, mine])
               for name, t, w in zip("qkv", local, whole)}}


def _traffic(rank):
    """One train_step of our GPT under cp 2 for each implementation: the meter."""
    import shardwise
    out = {}
    for impl in ("ring", "ulysses"):
        engine = shardwise.prepare(build_model(GPT, SEED), two_groups(LR), _cfg(impl=impl))
        x, y = token_batches(1, BATCH)[0]
        engine.runtime.comm.meter.reset()
        engine.train_step(*engine.shard(x, y))
        out[impl] = engine.runtime.comm.meter.snapshot()
        engine.close()
    return out


def _train(cfg):
    """shardwise's own loop (train) on cfg in this world: losses and parameters."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    summary = train(cfg, init_runtime(cfg), quiet=True)
    out = (summary["losses"], summary["engine"].full_state_dict())
    summary["engine"].close()
    return out


def _own_loop_cfg(**parallel):
    return tiny_config("3d", steps=6, **parallel)


def _world(rank, n, runs, attention, own):
    out = {tag: _loop(rank, tag, cfg) for tag, cfg in runs}
    out["attention"] = {(impl, seq): _attention(rank, n, impl, seq) for impl, seq in attention}
    out["own"] = {tag: _train(cfg) for tag, cfg in own}
    if n == 2:
        out["traffic"] = _traffic(rank)
    return out


@pytest.fixture(scope="module")
def reference():
    return one_process_loop(build_model(GPT, SEED), LR, MAX_NORM, STEPS, BATCH)


WORLD2 = [("ring", _cfg()), ("ring-ce", _cfg()), ("ulysses", _cfg(impl="ulysses")),
          ("ulysses-ce", _cfg(impl="ulysses"))]
WORLD4 = [("ring-dp2-zero1-ce", _cfg("zero1", dp=2)), ("ring-dp2-zero3", _cfg("zero3", dp=2)),
          ("ulysses-cp4", _cfg(cp=4, impl="ulysses")), ("ring-cp4-ce", _cfg(cp=4))]
OWN2 = [("ring", _own_loop_cfg(cp=2))]
OWN4 = [("ulysses-dp2-zero2", _own_loop_cfg(cp=2, dp=2, zero_stage=2, cp_impl="ulysses"))]


@pytest.fixture(scope="module")
def world2():
    return run_world(_world, 2, WORLD2, [("ring", 1024), ("ulysses", 1024), ("ring", 4096)],
                     OWN2, timeout=280)


@pytest.fixture(scope="module")
def world4():
    return run_world(_world, 4, WORLD4, [("ring", 1024), ("ulysses", 4096)], OWN4, timeout=280)


def _check(r, ref, tag):
    for step, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
        assert b > MAX_NORM, "clipping must bind for the test to mean anything"
        assert abs(a - b) <= ATOL + RTOL * b, f"{tag} step {step}: norm {a} vs {b} ({WHY})"
    assert_close_runs(r["losses"], ref["losses"], r["params"], ref["params"], RTOL, ATOL, WHY,
                      strays=True)
    assert r["logits_shape"][1:] == (SEQ, VOCAB), "engine(x): the whole sequence's logits"


def _check_attention(results):
    for r in results:
        for key, parts in r["attention"].items():
            for name, (got, want) in parts.items():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{key} {name}: {m}")


def test_ring_and_ulysses_attention_equal_sdpa_cp2(world2):
    _check_attention(world2)
    assert {k for k in world2[0]["attention"]} == {("ring", 1024), ("ulysses", 1024),
                                                   ("ring", 4096)}


def test_ring_and_ulysses_attention_equal_sdpa_cp4(world4):
    _check_attention(world4)


def test_cp2_equals_one_process(world2, reference):
    for tag, _ in WORLD2:
        _check(world2[0][tag], reference, tag)
        assert world2[0][tag]["losses"] == world2[1][tag]["losses"], tag


def test_dp2_cp2_and_cp4_equal_one_process(world4, reference):
    for tag, _ in WORLD4:
        _check(world4[0][tag], reference, tag)
        assert all(r[tag]["losses"] == world4[0][tag]["losses"] for r in world4), tag


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_shardwise_own_loop_under_cp_equals_single(world, request):
    results = request.getfixturevalue(world)
    for tag, cfg in (OWN2 if world == "world2" else OWN4):
        losses, params = results[0]["own"][tag]
        ref = single_run(cfg)
        assert_close_runs(losses, ref[0], params, ref[1], RTOL, ATOL, WHY, strays=True)


def test_cp_traffic_equals_the_formula(world2):
    """Per rank and step (comm/context.py): ring sends N-1 key/value blocks forward, N-1 again
    and N of their gradients backward; Ulysses' all-to-alls move (N-1)/N of 3 + 1 blocks each
    way per layer. A block: B_rank x h x L x d fp32 (B_rank = the batch: dp 1; L = S / N)."""
    n, layers = 2, GPT.n_layer
    block = BATCH * GPT.n_head * (SEQ // n) * (GPT.n_embd // GPT.n_head) * 4
    ring = world2[0]["traffic"]["ring"]["cp_ring"]
    assert ring["bytes_sent"] == layers * ((n - 1) * 2 * block * 2 + n * 2 * block)
    assert ring["bytes_recv"] == ring["bytes_sent"]
    a2a = world2[0]["traffic"]["ulysses"]["cp_a2a"]
    assert a2a["bytes_sent"] == layers * (n - 1) / n * (3 + 1 + 1 + 3) * block
    assert "cp_a2a" not in world2[0]["traffic"]["ring"]
    assert "cp_ring" not in world2[0]["traffic"]["ulysses"]


def _cli_error(capsys, *argv):
    code = cli.main(["train", *argv, "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "fix:" in err, err
    return err


def test_bad_cp_settings_are_refused_in_one_line(capsys):
    assert "2 x cp = 8 chunks" in _cli_error(capsys, "--cp", "4", "--block-size", "12")
    assert "heads" in _cli_error(capsys, "--cp", "4", "--cp-impl", "ulysses", "--n-head", "2",
                                 "--n-embd", "32")
    assert "--cp" in _cli_error(capsys, "--cp-impl", "ulysses")        # read only with --cp
    assert "sequence parallelism" in _cli_error(capsys, "--cp", "2", "--tp", "2", "--sp")
    assert "parallel.cp = 0: must be positive" in _cli_error(capsys, "--cp", "0")  # fuzz found
    assert "LeNet reads images" in _cli_error(capsys, "--cp", "2", "--model", "lenet",
                                             "--dataset", "digits")
