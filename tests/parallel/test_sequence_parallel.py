"""Sequence parallelism (--sp with --tp 2): norms, residual adds and dropout on a half of the
sequence, tp's all-reduces turned into reduce-scatters and all-gathers along it
(shardwise/parallel/sequence.py).

Equal to one process on our GPT, Hugging Face Llama and GPT-2 at tp 2 (world 2) and at
dp 2 x tp 2 under ZeRO-1, ZeRO-3 and DDP (world 4; also shardwise's own loop on a meta-device GPT
under ZeRO-3 with activation checkpointing): ranks seeded differently before ``prepare`` (the
slices are cut from global rank 0's weights), two AdamW parameter groups, clipping that binds at
every step, a user's own loss on ``engine(x)`` (whole-sequence, whole-vocabulary logits) and
shardwise's vocab-parallel one; Llama with activation checkpointing too. The meter shows the
sequence-parallel collectives instead of tp's all-reduces, counted and sized by the formulas of
sequence.py's docstring; the activation ledger shows fewer saved bytes than tp alone at a long
sequence. Bad settings are refused before launch in one line.

Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py says why): the split matmuls, the
reduce-scatters, the tp sums of the norms' slice gradients and the vocab-parallel loss all sum
in other orders than one process. lr 1e-3 as in test_hf_layouts.py (Adam turns reordering noise
in a near-zero gradient element into a step of up to lr); GPT-2's key bias, whose true gradient
is exactly 0, drifts by at most lr per step (test_hf_layouts.py says why).
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness import assert_clipped_steps_close, assert_close_runs, run_world
from models_hf import (SEQ, VOCAB, one_process_loop, tiny_gpt2, tiny_llama, token_batches,
                       two_groups)
from reference import ATOL, RTOL, single_run, tiny_config

from shardwise import cli
from shardwise.config import (Config, DataConfig, MemoryConfig, ModelConfig, ParallelConfig,
                              TrainConfig)
from shardwise.models import build_model

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MAX_NORM, SEED, LR = 4, 8, 0.5, 100, 1e-3
KEY_BIAS_ATOL = LR * STEPS
GPT = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB)
BUILD = {"gpt": lambda seed: build_model(GPT, seed), "llama": tiny_llama, "gpt2": tiny_gpt2}
WHY = "fp32; tp, sp's reduce-scatters and tp sums, the vocab-parallel loss in other orders"


def user_loss(out, y):
    """A user's own next-token loss: it reads every logit (under tp they are gathered)."""
    logits = out if torch.is_tensor(out) else out["logits"]              # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _cfg(strategy="tp", ckpt=False, **parallel):
    parallel = ParallelConfig(strategy=strategy, sequence_parallel=True, **parallel)
    return Config(model=GPT, data=DataConfig(dataset="synthetic"), parallel=parallel,
                  memory=MemoryConfig(activation_checkpointing=ckpt),
                  train=TrainConfig(batch_size=BATCH, device="cpu"))


def _single(family):
    """Rank 0's initial weights, the whole batch, torch's own clipping."""
    return one_process_loop(BUILD[family](SEED), LR, MAX_NORM, STEPS, BATCH)


def _loop(rank, tag, family, cfg):
    """The user's loop on a model seeded by rank: -ce runs shardwise's vocab-parallel loss."""
    import shardwise
    engine = shardwise.prepare(BUILD[family](SEED + rank), two_groups(LR), cfg,
                               loss_fn=None if tag.endswith("-ce") else user_loss)
    engine.runtime.comm.meter.reset()
    losses, norms = [], []
    for x, y in token_batches(STEPS, BATCH):
        xs, ys = engine.shard(x, y)
        loss = engine.loss(xs, ys) if tag.endswith("-ce") else engine.loss_fn(engine(xs), ys)
        engine.backward(loss)
        norms.append(float(engine.strategy.clip_grad_norm_(MAX_NORM)))
        engine.step()
        losses.append(engine.strategy.reduce_mean(loss.detach()))
    meter = engine.runtime.comm.meter.snapshot()
    out = dict(losses=losses, norms=norms, params=engine.full_state_dict(), meter=meter,
               dp=engine.runtime.mesh.dp, zero_shard="zero_grad_rs" in meter,
               checkpointed=sum(getattr(m, "checkpointed", False)
                                for m in engine.strategy.model.modules()))
    engine.close()
    return out


def _traffic(rank):
    """One train_step of our GPT (shardwise's loss) under tp 2, with and without sp: the meter."""
    import shardwise
    out = {}
    for tag, sp in (("tp", False), ("sp", True)):
        cfg = _cfg(tp=2)
        cfg = replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=sp))
        engine = shardwise.prepare(BUILD["gpt"](SEED), two_groups(LR), cfg)
        x, y = token_batches(1, BATCH)[0]
        engine.runtime.comm.meter.reset()
        engine.train_step(*engine.shard(x, y))
        out[tag] = engine.runtime.comm.meter.snapshot()
        engine.close()
    return out


REGION_TYPES = (torch.nn.LayerNorm, torch.nn.Dropout)   # our GPT's modules between regions


def _region_bytes(engine, x, y) -> dict[str, int]:
    """Distinct storages autograd saves inside the blocks' norms and dropouts (between the
    regions) and the final norm in one train_step, per module; parameters left out. (The
    dropout after the embedding runs whole on every rank, before the first block's cut.)"""
    model = engine.strategy.model
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    where, seen, handles = [], {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, REGION_TYPES) and (name.startswith("blocks.") or name == "ln_f"):
            handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: where.append(n)))
            handles.append(mod.register_forward_hook(lambda m, a, o: where.pop() and None))

    def pack(t):
        s = t.untyped_storage()
        if where and s._cdata not in weights:
            seen[s._cdata] = (where[-1], s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.train_step(x, y)
    for h in handles:
        h.remove()
    out: dict[str, int] = {}
    for name, nbytes in seen.values():
        out[name] = out.get(name, 0) + nbytes
    return out


def _activations(rank, seq=512):
    """Saved-activation bytes of a train_step at a long sequence (dropout 0.1), tp 2 with and
    without sp: the ledger's activations_peak (the first steps) and, on the step after the
    ledger's samples, what the norms and dropouts between the regions saved, per module."""
    import shardwise
    from shardwise.parallel.ledger import ACT_SAMPLES
    model_cfg = ModelConfig(n_layer=2, n_embd=64, n_head=4, block_size=seq, vocab_size=VOCAB,
                            dropout=0.1)
    out = {}
    for sp in (False, True):
        cfg = Config(model=model_cfg, data=DataConfig(dataset="synthetic"),
                     parallel=ParallelConfig(strategy="tp", tp=2, sequence_parallel=sp),
                     train=TrainConfig(batch_size=2, device="cpu"))
        engine = shardwise.prepare(build_model(model_cfg, SEED), two_groups(LR), cfg)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (2, seq + 1), generator=g)
        x, y = engine.shard(tokens[:, :-1], tokens[:, 1:])
        for _ in range(ACT_SAMPLES):
            engine.train_step(x, y)
        tag = "sp" if sp else "tp"
        out[tag] = engine.strategy.memory_ledger()["activations_peak"]
        out[tag + "-regions"] = _region_bytes(engine, x, y)
        engine.close()
    return out


def _dropout(rank):
    """tp 2 + sp with dropout 0.1 on our GPT: the mask block 0's residual dropout drew on this
    rank's slice, and 3 steps' losses and weights with and without activation checkpointing."""
    import shardwise
    model_cfg = replace(GPT, dropout=0.1)
    out = {}
    for ckpt in (False, True):
        cfg = replace(_cfg(ckpt=ckpt, tp=2), model=model_cfg)
        engine = shardwise.prepare(build_model(model_cfg, SEED), two_groups(LR), cfg)
        masks = []
        drop = engine.strategy.model.blocks[0].drop
        handle = drop.register_forward_hook(lambda m, a, o: masks.append(o.detach() == 0))
        losses = []
        for x, y in token_batches(3, BATCH):
            losses.append(float(engine.train_step(*engine.shard(x, y))))
        handle.remove()
        out["ckpt" if ckpt else "plain"] = dict(losses=losses, params=engine.full_state_dict(),
                                                mask=masks[0])
        engine.close()
    return out


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, h):                                    # (B, T, 32)
        return h + self.down(F.gelu(self.up(h)))


class NoRegions(torch.nn.Module):
    """A user's model whose plan says how tp splits it, but not its regions nor final norm."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(Residual() for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def _refusals(rank):
    """What sp refuses inside a run, each as one line: a plan without regions (prepare), and a
    batch whose sequence length tp does not divide (the first op that cuts it)."""
    import shardwise
    from shardwise.models.plans import ModelPlan, Split, register_plan
    register_plan(NoRegions, ModelPlan(blocks="layers", tp={
        "layers.*.up": Split("colwise"), "layers.*.down": Split("rowwise")}))
    out = {}
    try:
        shardwise.prepare(NoRegions(), two_groups(LR), _cfg(tp=2), loss_fn=user_loss)
    except TypeError as e:
        out["plan"] = str(e)
    engine = shardwise.prepare(BUILD["gpt"](SEED), two_groups(LR), _cfg(tp=2))
    x, _ = token_batches(1, BATCH)[0]
    try:
        engine(x[:, :15])
    except ValueError as e:
        out["length"] = str(e)
    engine.close()
    return out


def _world2(rank, n, runs):
    out = {tag: _loop(rank, tag, family, cfg) for tag, family, cfg in runs}
    out["refusals"] = _refusals(rank)
    out["traffic"] = _traffic(rank)
    out["activations"] = _activations(rank)
    out["dropout"] = _dropout(rank)
    return out


def _train_cfg():
    """shardwise's own loop on a meta-device GPT (the run's default init: every rank makes only
    its slices from the seed) with ZeRO-3 over dp 2, tp 2 + sp and activation checkpointing."""
    cfg = tiny_config("3d", steps=6, dp=2, tp=2, zero_stage=3, sequence_parallel=True)
    return replace(cfg, memory=replace(cfg.memory, activation_checkpointing=True),
                   logging=replace(cfg.logging, schedule_png="off"))


def _world4(rank, n, runs):
    out = {tag: _loop(rank, tag, family, cfg) for tag, family, cfg in runs}
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    summary = train(_train_cfg(), init_runtime(_train_cfg()), quiet=True)
    engine = summary["engine"]
    checkpointed = sum(getattr(m, "checkpointed", False) for m in engine.strategy.model.modules())
    out["train-z3-ckpt"] = (summary["losses"], engine.full_state_dict(), set(summary["comm"]),
                            checkpointed)
    engine.close()
    return out


@pytest.fixture(scope="module")
def references():
    return {f: _single(f) for f in BUILD}


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


@pytest.fixture(scope="module")
def world2():
    runs = [("gpt", "gpt", _cfg(tp=2)), ("llama", "llama", _cfg(tp=2)),
            ("gpt2", "gpt2", _cfg(tp=2)), ("llama-ckpt", "llama", _cfg(ckpt=True, tp=2)),
            ("gpt-ce", "gpt", _cfg(tp=2))]
    return runs, run_world(_world2, 2, runs, timeout=280)


def test_sp_tp2_equals_one_process_gpt_llama_gpt2(world2, references):
    runs, results = world2
    for tag, family, _ in runs:     # -ce: shardwise's loss, vocab-parallel (the same value)
        _check(results[0][tag], references[family], tag)
        assert results[0][tag]["losses"] == results[1][tag]["losses"]
    assert results[0]["llama-ckpt"]["checkpointed"] == 2
    # the user's loss read whole logits; shardwise's ran vocab-parallel on this rank's columns
    assert "tp_gather_logits" in results[0]["llama"]["meter"]
    assert "tp_gather_logits" not in results[0]["gpt-ce"]["meter"]
    for tag, _, _ in runs:
        meter = results[0][tag]["meter"]
        assert {"sp_ag", "sp_rs", "sp_grad"} <= set(meter) and "tp_fwd" not in meter, tag


def _ring(elements: int, n: int, allreduce: bool = False) -> float:
    """Bytes a rank sends for fp32 ``elements`` among n ranks: all-gather / reduce-scatter of
    the whole, (n-1)/n of it; an all-reduce twice that."""
    return (2 if allreduce else 1) * (n - 1) / n * elements * 4


def test_sp_meter_shows_its_collectives_by_the_formula(world2):
    _, results = world2
    m, tp_m = results[0]["traffic"]["sp"], results[0]["traffic"]["tp"]
    n, L, h = 2, GPT.n_layer, GPT.n_embd
    K = BATCH * SEQ * h                                   # the residual stream's elements
    # our GPT's head reads the final gather: 6L + 3 all-gathers (4L + 2 + 2L + 1 re-gathers)
    for name, calls in (("sp_ag", 6 * L + 3), ("sp_rs", 4 * L + 1)):
        assert m[name]["calls"] == calls, name
        assert abs(m[name]["bytes_sent"] - calls * _ring(K, n)) <= calls, name
    assert "tp_fwd" not in m and "tp_bwd" not in m     # tp's per-layer all-reduces are gone
    # slice-used parameters (per layer ln_1, ln_2 weight and bias, two row biases; ln_f's two)
    # all-reduced once each: 6L + 2 vectors of h
    assert m["sp_grad"]["calls"] == 6 * L + 2
    assert abs(m["sp_grad"]["bytes_sent"] - (6 * L + 2) * _ring(h, n, True)) <= 6 * L + 2
    # the vocabulary: the embedding's all-reduce and the loss's two, as under tp; the head's f
    # (backward all-reduce of K) is gone
    assert m["tp_vocab"]["calls"] == tp_m["tp_vocab"]["calls"] - 1 == 3
    assert m["tp_vocab"]["bytes_sent"] == tp_m["tp_vocab"]["bytes_sent"] - int(_ring(K, n, True))
    # against tp's 8L + 2 units of (n-1)/n * 4K (f, g, the head's f): sp moves 10L + 4, the
    # 2L + 1 backward re-gathers and the first block's backward gather more (docstring)
    def units(meter, names):
        return sum(meter[k]["bytes_sent"] for k in names if k in meter) / _ring(K, n)
    assert units(tp_m, ("tp_fwd", "tp_bwd")) + 2 == pytest.approx(8 * L + 2, abs=1e-3)
    assert units(m, ("sp_ag", "sp_rs")) == pytest.approx(10 * L + 4, abs=1e-3)


def test_sp_saves_activation_memory_at_a_long_sequence(world2):
    """The issue's bound: in the norm / dropout regions sp saves at most 1/tp of what tp saves
    (measured per module); over the whole step it saves less (attention's and the MLP's
    insides are tp's already, so the whole-step ratio stays above 1/tp)."""
    _, results = world2
    act = results[0]["activations"]
    tp, sp = act["tp-regions"], act["sp-regions"]
    print(f"\nactivations_peak at seq 512, tp 2: tp {act['tp']} B, tp+sp {act['sp']} B, "
          f"ratio {act['sp'] / act['tp']:.3f}; norm and dropout regions: tp {sum(tp.values())} B, "
          f"tp+sp {sum(sp.values())} B, ratio {sum(sp.values()) / sum(tp.values()):.3f}")
    assert act["sp"] < act["tp"]
    assert sp.keys() == tp.keys() and any(k.endswith(".drop") for k in tp) and "ln_f" in tp
    for name in tp:
        assert sp[name] <= tp[name] / 2, (name, sp[name], tp[name])


def test_sp_dropout_draws_a_stream_per_rank_and_recomputes_it(world2):
    """Dropout under sp: the two ranks' slices get different masks (one shared stream would drop
    the same offsets of both), and activation checkpointing's recompute replays the masks (the
    checkpointed run equals the plain one)."""
    _, results = world2
    a, b = results[0]["dropout"], results[1]["dropout"]
    m0, m1 = a["plain"]["mask"], b["plain"]["mask"]
    assert m0.shape == m1.shape and 0 < m0.float().mean() < 0.3
    assert not torch.equal(m0, m1)
    torch.testing.assert_close(a["ckpt"]["losses"], a["plain"]["losses"], rtol=1e-6, atol=0)
    for name, want in a["plain"]["params"].items():
        torch.testing.assert_close(a["ckpt"]["params"][name], want, rtol=1e-6, atol=1e-7)
    assert a["plain"]["losses"] == b["plain"]["losses"]          # the loss is the world's


def test_sp_dp2_tp2_zero1_zero3_equals_one_process(references):
    runs = [("gpt-z1", "gpt", _cfg("3d", dp=2, tp=2, zero_stage=1)),
            ("llama-z3", "llama", _cfg("3d", dp=2, tp=2, zero_stage=3)),
            ("gpt2-z0", "gpt2", _cfg("3d", dp=2, tp=2, zero_stage=0))]
    results = run_world(_world4, 4, runs, timeout=280)
    for tag, family, _ in runs:
        _check(results[0][tag], references[family], tag)
        assert "sp_rs" in results[0][tag]["meter"] and "tp_fwd" not in results[0][tag]["meter"]
    assert results[0]["llama-z3"]["zero_shard"] and results[0]["gpt-z1"]["dp"] == 2
    cfg = _train_cfg()                      # the reference: one process, no sp (tp = 1)
    expected = single_run(replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=False)))
    losses, params, meter, checkpointed = results[0]["train-z3-ckpt"]
    assert {"sp_ag", "sp_rs", "sp_grad", "zero_grad_rs"} <= meter and checkpointed == 2
    assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why=WHY)


def test_sp_refuses_a_plan_without_regions_and_an_odd_length_in_one_line(world2):
    _, results = world2
    said = results[0]["refusals"]
    assert "needs the model plan's regions" in said["plan"] and "fix:" in said["plan"]
    assert "a length of 15 does not divide" in said["length"] and "fix:" in said["length"]
    assert all("\n" not in m for m in said.values())


@pytest.mark.parametrize("extra, says", [
    (["--sp", "--nproc-per-node", "2"], "parallel.sequence_parallel = True"),
    (["--sp", "--nproc-per-node", "2", "--tp", "2", "--block-size", "15"],
     "model.block_size = 15"),
])
def test_bad_sp_settings_are_one_line_exit_2(capsys, extra, says):
    code = cli.main(["train", "--steps", "2", "--dataset", "synthetic", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0] and "fix:" in err[0], err
