"""Context parallelism (--cp) on models we did not write, and with tensor parallelism.

Hugging Face Llama (rotary positions given as each rank's global position_ids, 4 query heads over
2 key-value heads: the ring carries the 2 key-value heads, Ulysses splits them at cp 2 and
expands them to the 4 query heads first at cp 4) and Hugging Face GPT-2 (learned positions read
through position_ids, tied lm_head / wte, Conv1D) train under cp 2 (world 2, ring and Ulysses)
and cp 4 (world 4, both), shardwise's GPT under cp 2 x tp 2, Llama under dp 2 x cp 2 with
ZeRO-3, and pipelines: Llama pp 2 x cp 2 (1F1B, ring) and our GPT pp 2 x cp 2 (GPipe, Ulysses,
ZeRO-3) through engine.train_step and engine.evaluate (world 4), each equal to one process on
the whole batch: ranks seeded differently
before ``prepare``, two AdamW parameter groups, clipping that binds at every step, a user's own
loss on ``engine(x)`` (the gathered logits) and shardwise's loss on each rank's positions.
The attention alone with grouped-query heads (4 over 2, and over 1) equals torch's
scaled_dot_product_attention (enable_gqa) on the whole sequence at 1024 positions (cp 2, ring
and Ulysses; cp 4, Ulysses over 1 key-value head) and 4096 (cp 4, ring and Ulysses over 2).
Padded batches (left padding: attention_mask and position_ids, targets -100 on padding) train
equal to one process too: Llama at cp 2 (ring, Ulysses) and cp 4 (ring), GPT-2 at cp 2 and under
pp 2 x cp 2 (Ulysses); the padding lies in the early chunks, so each rank's loss is weighted by
its share of the valid targets (removing the weight fails these runs). Labels in the batch, or a
mask other than the 2-D padding mask, are refused in one line.

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py), with assert_close_runs' strays rule
where Adam meets a near-zero gradient, lr 1e-3 as in test_hf_layouts.py.
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness import assert_close_runs, run_world
from models_hf import SEQ, VOCAB, lm_loss, one_process_loop, padded_batches, tiny_gpt2, \
    tiny_llama, token_batches, two_groups
from reference import ATOL, RTOL

from shardwise.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.models import build_model

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MAX_NORM, SEED, LR = 4, 8, 0.5, 100, 1e-3
GPT = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB)
WHY = "fp32; the ring's log-sum-exp merge, tp's split sums and the dp x cp average reorder sums"
BUILD = {"llama": tiny_llama, "gpt2": tiny_gpt2, "gpt": lambda seed: build_model(GPT, seed)}


def _cfg(strategy="ddp", cp=2, impl="ring", **parallel):
    return Config(model=GPT, data=DataConfig(dataset="synthetic"), parallel=ParallelConfig(strategy=strategy, cp=cp, cp_impl=impl,
                                                     **parallel),
                  train=TrainConfig(batch_size=BATCH, device="cpu"))


def _padded(steps=STEPS, seed=3):
    """Left-padded dict batches (input_ids, attention_mask, position_ids: models_hf) and a
    user's next-token targets (the ids shifted by one, -100 on padding and past the end): the
    padding sits in the early chunks, so cp ranks hold unequal numbers of valid targets."""
    out = []
    for b in padded_batches(steps, seed=seed, labels=False):
        y = torch.full_like(b["input_ids"], -100)
        y[:, :-1] = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
        out.append((b, y))
    return out


def _batches(tag, steps=STEPS):
    return _padded(steps) if "-pad" in tag else token_batches(steps, BATCH)


def _loop(rank, family, tag, cfg):
    """A user's loop on ``family`` seeded by rank: the loss on ``engine(x)`` (the whole
    sequence's logits), or with tags ending -ce ``engine.loss`` (each rank's positions; for our
    GPT shardwise's own cross-entropy, for Hugging Face's ModelOutput the user's lm_loss)."""
    import shardwise
    own = tag.endswith("-ce")
    user = lm_loss if family != "gpt" else \
        (lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    engine = shardwise.prepare(BUILD[family](SEED + rank), two_groups(LR), cfg,
                               loss_fn=None if own and family == "gpt" else user)
    losses, norms = [], []
    for x, y in _batches(tag):
        xs, ys = engine.shard(x, y)
        whole = engine(**xs) if isinstance(xs, dict) else engine(xs)
        loss = engine.loss(xs, ys) if own else engine.loss_fn(whole, ys)
        engine.backward(loss)
        norms.append(float(engine.strategy.clip_grad_norm_(MAX_NORM)))
        engine.step()
        losses.append(engine.strategy.reduce_mean(loss.detach()))
    out = dict(losses=losses, norms=norms, params=engine.full_state_dict())
    engine.close()
    return out


def _pipeline_loop(rank, family, tag, cfg):
    """Under a pipeline no rank holds the whole model: engine.train_step, clipping by
    train.grad_clip (the driver cuts each step's batch to this rank's positions)."""
    import shardwise
    engine = shardwise.prepare(BUILD[family](SEED + rank), two_groups(LR), cfg,
                               loss_fn=lm_loss if family != "gpt" else None)
    losses = [engine.train_step(*engine.shard(x, y)) for x, y in _batches(tag)]
    evaluation = _padded(1, seed=9) if "-pad" in tag else token_batches(1, BATCH, seed=9)
    val, _ = engine.evaluate(*engine.shard(*evaluation[0]))
    out = dict(losses=losses, params=engine.full_state_dict(), val=val)
    engine.close()
    return out


def _gqa_attention(rank, n, impl, kv_heads, seq=1024):
    """Ring or Ulysses with grouped-query heads against sdpa(enable_gqa) on the whole sequence:
    the largest difference of the output and of each gradient."""
    import torch.distributed as dist
    from shardwise.comm.collectives import Comm, CommMeter, Group
    from shardwise.comm.context import positions, ring_attention, ulysses_attention
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 4, seq, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, 8, generator=g) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True).backward(dout)
    mine = positions(seq, n, rank)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    fn = ring_attention if impl == "ring" else ulysses_attention
    out = fn(*local, Comm(CommMeter()), Group(dist.group.WORLD, tuple(range(n)), rank))
    out.backward(dout[:, :, mine])
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return {"out": (out.detach(), want[:, :, mine]),
            **{f"d{name}": (t.grad, w.grad[:, :, mine])
               for name, t, w in zip("qkv", local, whole)}}


def _refusals(rank):
    """Labels, or a mask that is not the 2-D padding mask, under cp: the one-line errors."""
    import shardwise
    engine = shardwise.prepare(tiny_llama(SEED), two_groups(LR), _cfg(), loss_fn=lm_loss)
    batch = padded_batches(1)[0]
    out = {}
    for name, kwargs in (("mask", {"attention_mask": batch["attention_mask"][:, None, None]}),
                         ("labels", {"labels": batch["input_ids"]})):
        try:
            engine(batch["input_ids"], **kwargs)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    engine.close()
    return out


def _world(rank, n, runs, attention, pipelines=()):
    out = {tag: _loop(rank, family, tag, cfg) for family, tag, cfg in runs}
    out.update({tag: _pipeline_loop(rank, family, tag, cfg) for family, tag, cfg in pipelines})
    out["attention"] = {key: _gqa_attention(rank, n, *key) for key in attention}
    if n == 2:
        out["refusals"] = _refusals(rank)
    return out


WORLD2 = [("llama", "llama-ring", _cfg()), ("llama", "llama-ring-ce", _cfg()),
          ("llama", "llama-ulysses", _cfg(impl="ulysses")), ("gpt2", "gpt2-ring", _cfg()),
          ("gpt2", "gpt2-ulysses-ce", _cfg(impl="ulysses")),
          ("llama", "llama-ring-pad", _cfg()), ("llama", "llama-ulysses-pad-ce", _cfg(impl="ulysses")),
          ("gpt2", "gpt2-ring-pad-ce", _cfg())]
WORLD4 = [("llama", "llama-ring-cp4", _cfg(cp=4)),
          ("llama", "llama-ulysses-cp4-ce", _cfg(cp=4, impl="ulysses")),
          ("llama", "llama-dp2-cp2-zero3", _cfg("zero3", dp=2)),
          ("gpt", "gpt-cp2-tp2", _cfg("3d", tp=2)), ("gpt", "gpt-cp2-tp2-ce", _cfg("3d", tp=2)),
          ("gpt", "gpt-cp2-tp2-ulysses", _cfg("3d", tp=2, impl="ulysses")),
          ("llama", "llama-ring-cp4-pad-ce", _cfg(cp=4))]


def _pp_cfg(schedule="1f1b", **parallel):
    cfg = _cfg("3d", pp=2, num_microbatches=2, schedule=schedule, **parallel)
    return replace(cfg, train=replace(cfg.train, grad_clip=MAX_NORM))


PIPELINES = [("llama", "llama-pp2-cp2", _pp_cfg()),
             ("gpt2", "gpt2-pp2-cp2-pad", _pp_cfg(impl="ulysses")),
             ("gpt", "gpt-pp2-cp2-ulysses-zero3", _pp_cfg("gpipe", impl="ulysses",
                                                          zero_stage=3))]


def _evaluated(family):
    """One process's loss on the evaluation batch after the reference's training."""
    model = BUILD[family](SEED)
    ref = one_process_loop(model, LR, MAX_NORM, STEPS, BATCH)
    x, y = token_batches(1, BATCH, seed=9)[0]
    with torch.no_grad():
        out = model(x)
        logits = out if torch.is_tensor(out) else out["logits"]
        ref["val"] = float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return ref


def _padded_reference(family):
    """One process on the whole padded batches: the user's loss (mean over valid targets)."""
    model = BUILD[family](SEED)
    opt = two_groups(LR)(list(model.parameters()))
    losses, norms = [], []
    for x, y in _padded():
        loss = lm_loss(model(**x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    x, y = _padded(1, seed=9)[0]
    with torch.no_grad():
        val = float(lm_loss(model(**x), y))
    return dict(losses=losses, norms=norms, val=val,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.fixture(scope="module")
def references():
    return {**{family: _evaluated(family) for family in BUILD},
            **{f"{family}-pad": _padded_reference(family) for family in ("llama", "gpt2")}}


@pytest.fixture(scope="module")
def world2():
    return run_world(_world, 2, WORLD2, [("ring", 2), ("ring", 1), ("ulysses", 2),
                                         ("ulysses", 1)], timeout=280)


@pytest.fixture(scope="module")
def world4():
    return run_world(_world, 4, WORLD4, [("ring", 2, 4096), ("ulysses", 2, 4096),
                                         ("ulysses", 1, 1024)], PIPELINES, timeout=280)


def _check(results, runs, references):
    for r in results:
        for family, tag, _ in runs:
            got, ref = r[tag], references[family + ("-pad" if "-pad" in tag else "")]
            if "val" in got:                        # a pipeline: evaluate's loss too
                assert abs(got["val"] - ref["val"]) <= ATOL + RTOL * ref["val"], tag
            for step, (a, b) in enumerate(zip(got.get("norms", ()), ref["norms"])):
                assert b > MAX_NORM, "clipping must bind for the test to mean anything"
                assert abs(a - b) <= ATOL + RTOL * b, f"{tag} step {step}: norm {a} vs {b}"
            assert_close_runs(got["losses"], ref["losses"], got["params"], ref["params"], RTOL,
                              ATOL, f"{tag}: {WHY}", strays=True)


def _check_attention(results):
    for r in results:
        for key, parts in r["attention"].items():
            for name, (got, want) in parts.items():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{key} {name}: {m}")


def test_llama_and_gpt2_under_cp2_equal_one_process(world2, references):
    _check(world2, WORLD2, references)


def test_cp4_dp_x_cp_and_cp_x_tp_equal_one_process(world4, references):
    _check(world4, WORLD4, references)


def test_pipeline_x_cp_equals_one_process(world4, references):
    _check(world4, PIPELINES, references)


def test_grouped_query_attention_equals_sdpa(world2, world4):
    _check_attention(world2)
    _check_attention(world4)


def test_labels_and_a_4d_mask_are_refused_in_one_line(world2):
    for r in world2:
        assert "the 2-D (batch, 16) padding mask" in r["refusals"]["mask"], r["refusals"]
        assert "labels under context parallelism" in r["refusals"]["labels"], r["refusals"]
        assert all("\n" not in m for m in r["refusals"].values())
