"""A mixture-of-experts model we did not write: Hugging Face Mixtral (tests/models_hf.py
tiny_mixtral: a learned router sends each token to 2 of 4 experts), under DDP and ZeRO 1-3 at
world 2, against single-process training; and tensor parallelism refused with one line.

Each run is what a user does: ranks seeded differently before ``prepare``, two AdamW parameter
groups, layer 1's router frozen (fine-tuning with a fixed routing: bit-for-bit unchanged),
clipping that binds at every step, the user's loop (``engine(x)``, their loss, their
``clip_grad_norm_``).

- **Their loss on the logits** (cross-entropy): data parallelism averages the ranks' gradients,
  which is the whole batch's gradient, so the reference is one process on the whole batch.
- **The model's own loss with the router's load-balancing term** (``output_router_logits``,
  ``loss_from="loss"``): that term multiplies two means over the tokens a forward sees (the
  share of tokens each expert got and its mean router probability), so it is not a mean over
  rows. Every rank computes it on its own rows, as torch DDP does; the reference is then one
  process that averages the two shards' losses (as for BatchNorm in test_zero_hf.py). A layout
  that computed it over the whole batch would differ from this.

An expert's slice of the 3-D expert weights gets a zero gradient when no token picked it; the
weights are one tensor each, so every parameter has a gradient every step (no unused
parameters to find). Expert parallelism (experts placed on different ranks) is not a shardwise
axis: these layouts replicate (DDP) or shard by bytes (ZeRO) every expert.

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py): the ranks' gradients are summed in
another order than one process's backward, and Adam amplifies near-zero elements. The router's
top-2 choice is discrete: a rounding difference could flip a near-tie and move the loss by more
than the tolerance; at these seeds and 4 steps no choice flips (the losses agree to 1e-6).
"""
import pytest
import torch

from harness import assert_clipped_steps_close, assert_close_but_for_strays, run_world
from models_hf import lm_loss, tiny_mixtral, token_batches, two_groups
from reference import ATOL, RTOL

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MAX_NORM, SEED, AUX = 4, 8, 0.5, 100, 0.05
FROZEN = ("model.layers.1.mlp.gate.weight",)
LAYOUTS = ("ddp", "zero1", "zero2", "zero3")
WHY = "fp32; the ranks' gradients are summed in another order than one process's backward"


def _model(seed: int, own_loss: bool):
    extra = dict(output_router_logits=True, router_aux_loss_coef=AUX) if own_loss else {}
    model = tiny_mixtral(seed, **extra)
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)
    return model


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _reference(own_loss: bool) -> dict:
    """One process: the whole batch (their loss), or the mean of the two ranks' row shards'
    own losses (the model's loss, module docstring); torch's clipping."""
    model = _model(SEED, own_loss)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = two_groups()(_trainable(model))
    losses, norms, aux = [], [], []
    for x, y in token_batches(STEPS, BATCH):
        if own_loss:
            half = BATCH // 2
            outs = [model(input_ids=x[i:i + half], labels=x[i:i + half]) for i in (0, half)]
            aux += [float(o.aux_loss) for o in outs]
            loss = (outs[0].loss + outs[1].loss) / 2
        else:
            loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(_trainable(model), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return dict(losses=losses, norms=norms, initial=initial, aux=aux,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def _cfg(strategy: str, **parallel):
    from shardwise.config import Config, ParallelConfig, TrainConfig
    parallel.setdefault("bucket_mb", 0.004)          # several buckets
    return Config(parallel=ParallelConfig(strategy=strategy, **parallel),
                  train=TrainConfig(batch_size=BATCH, device="cpu"))


def _world(rank, n, runs):
    import shardwise
    out = {}
    for tag, own_loss, cfg in runs:
        model = _model(SEED + rank, own_loss)            # every rank a different init
        if cfg.parallel.strategy == "tp":
            try:
                shardwise.prepare(model, two_groups(), cfg, loss_fn=lm_loss)
                out[tag] = "prepared"
            except TypeError as exc:
                out[tag] = str(exc)
            continue
        how = dict(loss_from="loss") if own_loss else dict(loss_fn=lm_loss)
        engine = shardwise.prepare(model, two_groups(), cfg, **how)
        losses, norms = [], []
        for x, y in token_batches(STEPS, BATCH):
            if own_loss:
                loss = engine(**engine.shard({"input_ids": x, "labels": x})).loss
            else:
                xs, ys = engine.shard(x, y)
                loss = lm_loss(engine(xs), ys)
            engine.backward(loss)
            norms.append(float(engine.clip_grad_norm_(MAX_NORM)))
            engine.step()
            losses.append(engine.strategy.reduce_mean(loss.detach()))
        out[tag] = dict(losses=losses, norms=norms, params=engine.full_state_dict())
        engine.close()
    return out


def _check(r, ref, tag):
    assert_clipped_steps_close(r, ref, tag, MAX_NORM, RTOL, ATOL, WHY)
    for name, want in ref["params"].items():
        if name in FROZEN:
            assert torch.equal(r["params"][name], ref["initial"][name]), f"{tag}: {name} moved"
            continue
        assert_close_but_for_strays(r["params"][name], want, RTOL, ATOL, f"{tag} {name} ({WHY})")


def test_mixtral_under_ddp_and_zero_equals_one_process_and_tp_is_refused():
    runs = [(s, False, _cfg(s)) for s in LAYOUTS]
    runs += [(f"{s}-own-loss", True, _cfg(s)) for s in ("ddp", "zero3")]
    runs += [("tp", False, _cfg("tp", tp=2))]
    results = run_world(_world, 2, runs, timeout=240)
    theirs, own = _reference(False), _reference(True)
    assert min(own["aux"]) > 0.5, "the load-balancing term must be in the model's loss"
    for tag, own_loss, _ in runs[:-1]:
        _check(results[0][tag], own if own_loss else theirs, tag)
        assert results[0][tag]["losses"] == results[1][tag]["losses"], tag
    refusal = results[0]["tp"]
    assert "MixtralForCausalLM has none" in refusal and "register_plan" in refusal, refusal
