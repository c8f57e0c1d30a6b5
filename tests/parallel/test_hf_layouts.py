"""Tensor parallelism and ZeRO-3 over dp x tp on models we did not write, by their plans
(shardwise/models/plans.py): Hugging Face GPT-2 (Conv1D weights (in, out), lm_head tied to wte),
Hugging Face Llama (RMSNorm, rotary, 4 query heads over 2 key-value heads) and a user's own
class with a registered plan, each against single-process training.

Every run is what a user does: ranks seeded differently before ``prepare`` (tp slices are cut
from global rank 0's weights), two AdamW parameter groups, clipping that binds at every step,
losses of every step and the gathered parameters compared with one process on the whole batch.
The pipeline runs them too (pp2 and tp2 x pp2 with 1F1B, dp2 x pp2 with ZeRO-1 or GPipe), with
GPT-2's lm_head on the last stage as a copy of wte on the first, whose gradients the pipeline
sums; the loop there is engine.train_step (no rank holds the whole model) with train.grad_clip.
The pipeline also takes several inputs: left-padded dict batches (attention_mask and
position_ids both change the result; tests/models_hf.py padded_batches) with the model's own loss
from labels (``loss_from="loss"``, computed on the last stage), or without labels and a user's
loss on targets (under tp, where loss_from is refused). Every micro-batch holds the same number
of valid labels, so the mean of micro-batch means is the batch's mean, as one process computes.
The stage cuts of both models, chained, are also checked in one process: each stage runs the
model's own modules, so the chain equals the model's forward exactly, with those inputs too.

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py says why): tp splits the matmul sums
and the vocab-parallel loss sums exp over two halves, dp averages ranks' gradients, each in
another order than the single process; Adam amplifies near-zero elements (its first steps are
about lr * sign(g) whatever |g|, so lr is 1e-3: reordering moves such an element by a small
fraction of lr, under atol; at 1e-2 one LayerNorm weight of GPT-2 drifted 3e-5). GPT-2's key bias has
a true gradient of exactly 0 (softmax ignores a row-wide constant): what it gets is rounding
noise, which Adam turns into steps of up to lr, so its drift is bounded by lr per step.
"""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import assert_clipped_steps_close, run_world
from models_hf import SEQ, VOCAB, lm_loss, padded_batches, tiny_gpt2, tiny_llama, token_batches, \
    two_groups
from reference import ATOL, RTOL

from shardwise.models.plans import ModelPlan, Split, plan_of, register_plan

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MAX_NORM, SEED, LR = 4, 8, 0.5, 100, 1e-3
WHY = "fp32; tp, the vocab-parallel loss and dp sum in other orders than one process"
KEY_BIAS_ATOL = LR * STEPS      # lr per step (module docstring)


class Mix(nn.Module):
    """A user's block: a residual MLP."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, h):                                    # (B, T, 32)
        return h + self.down(F.gelu(self.up(h)))


class TinyLM(nn.Module):
    """A user's own language model (not ours, not Hugging Face's), with a plan registered below."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(Mix() for _ in range(2))
        self.out = nn.Linear(32, VOCAB)

    def forward(self, ids):                                  # (B, T) -> (B, T, V)
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


register_plan(TinyLM, ModelPlan(
    blocks="layers", tp={"layers.*.up": Split("colwise"), "layers.*.down": Split("rowwise"),
                         "emb": Split("vocab"), "out": Split("vocab_head")},
    sizes=lambda m: dict(vocab_size=VOCAB)))


def smooth_loss(out, y):
    """A user's own loss (label smoothing reads every logit): under tp it gets the whole logits."""
    return F.cross_entropy(out["logits"].flatten(0, 1).float(), y.flatten(), label_smoothing=0.1)


def loss_of(tag):
    """The run's loss: the user's lm_loss (models_hf.py), smoothing, or shardwise's own
    cross-entropy (``-ce``: output_loss, which tp runs vocab-parallel)."""
    from shardwise.models.build import output_loss
    if tag == "user":                  # TinyLM returns the logits tensor itself
        return lambda out, y: lm_loss({"logits": out}, y)
    return smooth_loss if tag.endswith("-smooth") else output_loss if tag.endswith("-ce") else lm_loss


def tiny_user(seed):
    torch.manual_seed(seed)
    return TinyLM()


BUILD = {"gpt2": tiny_gpt2, "llama": tiny_llama, "user": tiny_user}


def _cfg(strategy, ckpt=False, **parallel):
    from shardwise.config import Config, MemoryConfig, ParallelConfig, TrainConfig
    return Config(parallel=ParallelConfig(strategy=strategy, **parallel),
                  memory=MemoryConfig(activation_checkpointing=ckpt),
                  train=TrainConfig(batch_size=BATCH, device="cpu"))


def _single(family, loss_fn=lm_loss):
    """The reference: rank 0's initial weights, the whole batch, torch's own clipping."""
    model = BUILD[family](SEED)
    opt = two_groups(LR)(list(model.parameters()))
    losses, norms = [], []
    for x, y in token_batches(STEPS, BATCH):
        loss = loss_fn({"logits": model(x)} if family == "user" else model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return dict(losses=losses, norms=norms,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def _world(rank, n, runs):
    """Each (tag, family, cfg): the model seeded by rank, prepared, trained with a user loop."""
    import shardwise
    out = {}
    for tag, family, cfg in runs:
        engine = shardwise.prepare(BUILD[family](SEED + rank), two_groups(LR), cfg,
                                   loss_fn=loss_of(tag))
        engine.runtime.comm.meter.reset()        # this run's traffic only
        losses, norms = [], []
        for x, y in token_batches(STEPS, BATCH):
            xs, ys = engine.shard(x, y)
            # -ce: shardwise's cross-entropy, vocab-parallel under tp (engine(x) gathers)
            loss = engine.loss(xs, ys) if tag.endswith("-ce") else engine.loss_fn(engine(xs), ys)
            engine.backward(loss)
            norms.append(float(engine.strategy.clip_grad_norm_(MAX_NORM)))
            engine.step()
            losses.append(engine.strategy.reduce_mean(loss.detach()))
        model = engine.strategy.model
        sent = {k: v["bytes_sent"] for k, v in engine.runtime.comm.meter.snapshot().items()}
        out[tag] = dict(losses=losses, norms=norms, params=engine.full_state_dict(), sent=sent,
                        checkpointed=sum(getattr(m, "checkpointed", False)
                                         for m in model.modules()),
                        units=[type(m).__name__ for m, _ in getattr(engine.strategy, "units", [])],
                        local={k: tuple(v.shape) for k, v in model.state_dict().items()})
        engine.close()
    return out


def _targets(batch):
    """A dict batch without its labels, and the targets a user's next-token loss takes from them
    (shifted by one; -100, which cross-entropy ignores, where there is no next token)."""
    x = {k: v for k, v in batch.items() if k != "labels"}
    y = torch.full_like(batch["labels"], -100)
    y[:, :-1] = batch["labels"][:, 1:]
    return x, y


def _data(tag, steps=STEPS):
    """(x, y) batches of a run: token ids, or (``-own``) dict batches with labels (y None), or
    (``-mask``) dict batches without labels and shifted targets."""
    if tag.endswith("-own"):
        return [(b, None) for b in padded_batches(steps)]
    if tag.endswith("-mask"):
        return [_targets(b) for b in padded_batches(steps)]
    return token_batches(steps, BATCH)


def _single_padded(family):
    """The reference of ``-own`` / ``-mask`` runs: the whole dict batch, the model's own loss."""
    model = BUILD[family](SEED)
    opt = two_groups(LR)(list(model.parameters()))
    losses, norms = [], []
    for batch in padded_batches(STEPS):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        val = float(model(**padded_batches(1, seed=9)[0]).loss)
    return dict(losses=losses, val=val, norms=norms,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def _pipeline_world(rank, n, runs):
    """Each (tag, family, cfg) with a pipeline: no rank holds the whole model, so the loop is
    engine.train_step (clipping by train.grad_clip), on the same differently seeded ranks."""
    import shardwise
    out = {}
    for tag, family, cfg in runs:
        own = tag.endswith("-own")
        engine = shardwise.prepare(BUILD[family](SEED + rank), two_groups(LR), cfg,
                                   **(dict(loss_from="loss") if own else dict(loss_fn=lm_loss)))
        losses = [engine.train_step(*engine.shard(x, y)) if y is not None else
                  engine.train_step(engine.shard(x)) for x, y in _data(tag)]
        val = None
        if own:
            val, _ = engine.evaluate(engine.shard(padded_batches(1, seed=9)[0]))
        out[tag] = dict(losses=losses, params=engine.full_state_dict(), val=val,
                        local=sorted(k for k, _ in engine.strategy.model.named_parameters()))
        engine.close()
    return out


def _pp_cfg(schedule="1f1b", **parallel):
    from dataclasses import replace
    cfg = _cfg("3d", num_microbatches=2, schedule=schedule, **parallel)
    return replace(cfg, train=replace(cfg.train, grad_clip=MAX_NORM))


@pytest.fixture(scope="module")
def references():
    return {**{f: _single(f) for f in BUILD}, "gpt2-smooth": _single("gpt2", smooth_loss),
            **{f"{f}-padded": _single_padded(f) for f in ("gpt2", "llama")}}


def _reference(references, tag, family):
    return references[f"{family}-padded" if tag.endswith(("-own", "-mask")) else family]


def _check(r, ref, tag):
    assert_clipped_steps_close(r, ref, tag, MAX_NORM, RTOL, ATOL, WHY)
    for name, want in ref["params"].items():
        got = r["params"][name]
        if name.endswith("attn.c_attn.bias"):     # GPT-2's (q | k | v) biases, 32 each
            key, got, want = slice(32, 64), got.clone(), want.clone()
            assert (got[key] - want[key]).abs().max() <= KEY_BIAS_ATOL, f"{tag} {name}"
            got[key] = want[key]
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{tag} {name}: {m} ({WHY})")


def test_tp2_hf_gpt2_llama_and_a_user_plan_world2(references):
    runs = [("gpt2", "gpt2", _cfg("tp", tp=2)), ("llama", "llama", _cfg("tp", tp=2)),
            ("llama-ckpt", "llama", _cfg("tp", ckpt=True, tp=2)),
            ("user", "user", _cfg("tp", tp=2)), ("gpt2-smooth", "gpt2", _cfg("tp", tp=2)),
            ("llama-ce", "llama", _cfg("tp", tp=2))]
    results = run_world(_world, 2, runs, timeout=240)
    for tag, family, _ in runs:
        _check(results[0][tag], references.get(tag, references[family]), tag)
        assert results[0][tag]["losses"] == results[1][tag]["losses"]
    # a user's loss sees the whole logits (gathered over tp); shardwise's runs vocab-parallel
    assert results[0]["gpt2-smooth"]["sent"].get("tp_gather_logits", 0) > 0
    assert results[0]["llama"]["sent"].get("tp_gather_logits", 0) > 0
    assert "tp_gather_logits" not in results[0]["llama-ce"]["sent"]
    assert results[0]["llama-ce"]["sent"].get("tp_vocab", 0) > 0
    gpt2, llama = results[0]["gpt2"]["local"], results[0]["llama"]["local"]
    # Conv1D (in, out): c_attn split on dim 1 by q | k | v groups, c_proj on dim 0
    assert gpt2["transformer.h.0.attn.c_attn.weight"] == (32, 48)
    assert gpt2["transformer.h.0.attn.c_proj.weight"] == (16, 32)
    assert gpt2["transformer.wte.weight"] == gpt2["lm_head.weight"] == (34, 32)  # 67 = 34 + 33
    # Llama: one of the two kv heads (width 8) per rank, 2 of the 4 query heads
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (8, 32)
    assert llama["model.layers.0.self_attn.q_proj.weight"] == (16, 32)
    assert llama["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    assert llama["model.norm.weight"] == (32,)
    assert results[0]["llama-ckpt"]["checkpointed"] == 2 and results[0]["llama"]["checkpointed"] == 0
    assert results[0]["user"]["local"]["layers.0.up.weight"] == (32, 32)


def test_dp2_tp2_zero3_hf_gpt2_and_llama_world4(references):
    runs = [(f, f, _cfg("3d", dp=2, tp=2, zero_stage=3)) for f in ("gpt2", "llama")]
    results = run_world(_world, 4, runs, timeout=240)
    for tag, family, _ in runs:
        _check(results[0][tag], references[family], tag)
    assert results[0]["llama"]["units"].count("LlamaDecoderLayer") == 2   # the plan's blocks
    assert results[0]["gpt2"]["units"].count("GPT2Block") == 2


def _check_pipeline(results, references, runs):
    for tag, family, _ in runs:
        ref = _reference(references, tag, family)
        r = dict(results[0][tag], norms=ref["norms"])  # not returned
        _check(r, ref, tag)
        assert all(res[tag]["losses"] == r["losses"] for res in results)
        if r["val"] is not None:                 # evaluate on a dict batch, the model's loss
            assert abs(r["val"] - ref["val"]) <= ATOL + RTOL * ref["val"], tag


def test_pp2_hf_gpt2_with_its_tied_head_and_llama_world2(references):
    runs = [("gpt2", "gpt2", _pp_cfg(pp=2)), ("llama", "llama", _pp_cfg(pp=2)),
            ("gpt2-own", "gpt2", _pp_cfg(pp=2)), ("llama-own", "llama", _pp_cfg(pp=2)),
            ("llama-zb-own", "llama", _pp_cfg("zb-h1", pp=2))]
    results = run_world(_pipeline_world, 2, runs, timeout=240)
    _check_pipeline(results, references, runs)
    # the first stage holds wte, the last its tied copy as lm_head (both stepped alike)
    assert "transformer.wte.weight" in results[0]["gpt2"]["local"]
    assert "lm_head.weight" in results[1]["gpt2"]["local"]
    assert "transformer.wte.weight" not in results[1]["gpt2"]["local"]


def test_3d_hf_gpt2_and_llama_tp2_pp2_and_dp2_pp2_world4(references):
    runs = [(f"{f}-tp-pp", f, _pp_cfg(tp=2, pp=2)) for f in ("gpt2", "llama")]
    runs += [("gpt2-dp-pp-zero1", "gpt2", _pp_cfg(dp=2, pp=2, zero_stage=1)),
             ("llama-dp-pp-gpipe", "llama", _pp_cfg("gpipe", dp=2, pp=2)),
             ("llama-tp-pp-mask", "llama", _pp_cfg(tp=2, pp=2)),        # loss_from: not under tp
             ("gpt2-dp-pp-zero1-own", "gpt2", _pp_cfg(dp=2, pp=2, zero_stage=1))]
    results = run_world(_pipeline_world, 4, runs, timeout=240)
    for tag, family, cfg in runs:     # losses agree within a pipeline; replicas alike
        ref = _reference(references, tag, family)
        r = dict(results[0][tag], norms=ref["norms"])
        _check(r, ref, tag)
        if r["val"] is not None:
            assert abs(r["val"] - ref["val"]) <= ATOL + RTOL * ref["val"], tag


def test_dp2_pp2_zero2_zero3_hf_gpt2_tied_and_llama_world4(references):
    """ZeRO-2 and ZeRO-3 stages under a pipeline on models we did not write: GPT-2's wte and
    its tied lm_head copy sit in different stages' shards, so their whole gradients are summed
    over pp before the reduce-scatter (driver.py); Llama with its own loss from labels."""
    runs = [("gpt2-dp-pp-zero3", "gpt2", _pp_cfg(dp=2, pp=2, zero_stage=3)),
            ("gpt2-dp-pp-zero2", "gpt2", _pp_cfg("gpipe", dp=2, pp=2, zero_stage=2)),
            ("llama-dp-pp-zero3-own", "llama", _pp_cfg(dp=2, pp=2, zero_stage=3))]
    results = run_world(_pipeline_world, 4, runs, timeout=240)
    for tag, family, cfg in runs:
        ref = _reference(references, tag, family)
        r = dict(results[0][tag], norms=ref["norms"])
        _check(r, ref, tag)
        if r["val"] is not None:
            assert abs(r["val"] - ref["val"]) <= ATOL + RTOL * ref["val"], tag


def test_pipeline_stages_of_hf_models_chain_to_the_models_forward():
    from shardwise.parallel.pipeline.stage import PipelineStage, stage_bounds
    x = token_batches(1, 2)[0][0]
    for model in (tiny_llama(0), tiny_gpt2(0, tie_word_embeddings=False)):
        bounds = stage_bounds(model, 2)
        first, last = PipelineStage(model, bounds, 0), PipelineStage(model, bounds, 1)
        assert bounds == [(0, 1), (1, 2)]
        assert torch.equal(last(first(x)).logits, model(x).logits)  # the same modules, order
        batch = padded_batches(1)[0]                     # several inputs, the model's own loss
        ids, inputs = first.split_batch(batch)
        staged, whole = last(first(ids, inputs), inputs), model(**batch)
        assert torch.equal(staged.logits, whole.logits) and torch.equal(staged.loss, whole.loss)
        plain = {k: batch[k] for k in ("input_ids", "labels")}
        assert not torch.allclose(model(**plain).loss, whole.loss)   # the mask and positions count
        with pytest.raises(ValueError, match="also has use_cache, which they would ignore"):
            first.split_batch({**batch, "use_cache": True})
        with pytest.raises(ValueError, match="has no 'input_ids'"):
            first.split_batch({"attention_mask": batch["attention_mask"]})
        names = {last.global_name(k) for k, _ in last.named_parameters()}
        assert names | {k for k, _ in first.named_parameters()} == set(dict(model.named_parameters()))
    tied = tiny_gpt2(0)                     # lm_head.weight is transformer.wte.weight
    first, last = PipelineStage(tied, [(0, 1), (1, 2)], 0), PipelineStage(tied, [(0, 1), (1, 2)], 1)
    assert last.global_name("lm_head.weight") == "transformer.wte.weight"
    assert last.is_tied_copy("lm_head.weight") and not first.is_tied_copy("transformer.wte.weight")


def test_register_plan_on_a_users_class():
    class Wider(TinyLM):
        pass
    assert plan_of(Wider()) is plan_of(TinyLM()) and plan_of(Wider()).blocks == "layers"
    assert plan_of(nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match="not an nn.Module class"):
        register_plan(int, plan_of(TinyLM()))
    with pytest.raises(ValueError, match="Split.style"):
        Split("diagonal")


def test_llama_kv_heads_that_tp_cannot_divide_are_refused_before_launch(tmp_path):
    from shardwise.config import ConfigError, ModelConfig
    from shardwise.parallel import tensor_checks
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=48, num_attention_heads=6,
                                    num_key_value_heads=3, num_hidden_layers=2,
                                    vocab_size=VOCAB, max_position_embeddings=SEQ)))
    cfg = _cfg("tp", tp=2)
    from dataclasses import replace
    cfg = replace(cfg, model=ModelConfig(name="hf:llama", hf_config=str(path)))
    with pytest.raises(ConfigError, match=r"parallel\.tp = 2.*3 key-value heads"):
        tensor_checks.check(cfg, 2)
