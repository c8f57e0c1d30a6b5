"""Meta-device init (models/init.py): each rank materialises only what it keeps, and the weights
equal an eager build's bit for bit, under every layout and world size.

For each layout, model and world size, one world builds the model both ways with the same seed
(``build_model(..., init="meta")`` and ``init="eager"``), prepares it and trains 5 steps on the
same batches; the gathered parameters (and buffers) after prepare and after the 5 steps must be
``torch.equal``. Exact, no tolerance: both paths run the same arithmetic on the same values (the
meta path's pieces are cut from the same unit the eager path holds whole; gathers copy bytes).
The meta path must send nothing at the start (no ``zero_broadcast`` / ``init_broadcast``), and
the eager one still does (a model handed over in memory may differ across ranks).
"""
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import tiny_config
from shardwise.config import ConfigError, ModelConfig
from shardwise.models import build_model, loss_for
from shardwise.models.init import Materializer, is_meta
from shardwise.run.api import optimizer_factory, prepare
from shardwise.run.runtime import init_runtime

pytestmark = pytest.mark.timeout(400)
STEPS = 5
START = ("zero_broadcast", "init_broadcast", "ddp_broadcast")
MODELS = {"gpt": {}, "hf:llama": {}, "hf:gpt2": {}}


def _cfg(model: str, **parallel):
    cfg = tiny_config("3d" if parallel.get("tp", 1) > 1 or parallel.get("pp", 1) > 1 else
                      "zero3", steps=STEPS, **parallel)
    return replace(cfg, model=replace(cfg.model, name=model),
                   train=replace(cfg.train, optimizer="adamw"))


def _batches(cfg, n: int):
    g = torch.Generator().manual_seed(7)
    m = cfg.model
    out = []
    for _ in range(n):
        t = torch.randint(0, m.vocab_size, (cfg.train.batch_size, m.block_size + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _one(cfg, init: str) -> dict:
    """Build with ``init``, prepare, train STEPS steps; the gathered state before and after."""
    rt = init_runtime(cfg)
    model = build_model(cfg.model, cfg.train.seed, init=init)
    assert is_meta(model) == (init == "meta")
    engine = prepare(model, optimizer_factory(cfg), cfg, loss_fn=loss_for(cfg.model), runtime=rt)
    start = {k: v.clone() for k, v in engine.full_state_dict().items()}
    sent = {k for k, s in rt.comm.meter.snapshot().items() if s["calls"]}
    index, count = engine.strategy.data_shard()
    losses = []
    for x, y in _batches(cfg, STEPS):
        rows = slice(index * len(x) // count, (index + 1) * len(x) // count)
        losses.append(engine.train_step(x[rows], y[rows]))
    tied = None
    if cfg.model.name == "hf:gpt2" and cfg.parallel.pp == 1:
        m = engine.model
        tied = m.lm_head.weight is m.transformer.wte.weight
    left = [n for n, t in [*engine.model.named_parameters(), *engine.model.named_buffers()]
            if t.is_meta]
    out = dict(start=start, end=engine.full_state_dict(), losses=losses, started=sent,
               tied=tied, left_meta=left)
    engine.close()
    return out


def _compare_many(rank, n, runs):
    out = {}
    for tag, cfg in runs:
        out[tag] = {init: _one(cfg, init) for init in ("meta", "eager")}
    return out


def _check(results: dict, world: int) -> None:
    for tag, r in results.items():
        meta, eager = r["meta"], r["eager"]
        assert meta["left_meta"] == [], (tag, meta["left_meta"])
        for when in ("start", "end"):
            assert meta[when].keys() == eager[when].keys(), tag
            bad = [k for k in meta[when] if not torch.equal(meta[when][k], eager[when][k])]
            assert not bad, f"{tag} {when}: {bad}"
        assert meta["losses"] == eager["losses"], tag
        assert not set(START) & meta["started"], (tag, meta["started"])
        if world > 1:    # a model handed over in memory is still broadcast at the start
            assert set(START) & eager["started"], (tag, eager["started"])
        if meta["tied"] is not None:
            assert meta["tied"] and eager["tied"], tag


def _layouts(world: int) -> list:
    if world == 1:
        return [("zero3", {}), ("ddp", dict(zero_stage=0))]
    if world == 2:
        return [("zero3", {}), ("tp2", dict(tp=2)), ("pp2", dict(pp=2, num_microbatches=2))]
    return [("zero3", {}), ("dp2-tp2-zero3", dict(tp=2, zero_stage=3)),
            ("pp2-tp2", dict(pp=2, tp=2, num_microbatches=2))]


def _runs(world: int, models=MODELS) -> list:
    runs = []
    for model in models:
        for tag, parallel in _layouts(world):
            cfg = _cfg(model, **parallel)
            if tag == "ddp":
                cfg = replace(cfg, parallel=replace(cfg.parallel, strategy="ddp"))
            runs.append((f"{model}/{tag}", cfg))
    return runs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_init_equals_eager_bit_for_bit(world):
    results = run_world(_compare_many, world, _runs(world), timeout=380)[0]
    assert len(results) == len(MODELS) * len(_layouts(world))
    _check(results, world)


def test_same_weights_under_every_layout():
    """The weights after prepare are the single-process model's, whatever the layout: zero3 and
    tp at world 2 gather to exactly what one process builds (layout-free init)."""
    cfg = _cfg("gpt")
    whole = build_model(cfg.model, cfg.train.seed)
    want = {k: v.detach() for k, v in whole.state_dict().items()}
    runs = [("zero3", _cfg("gpt")), ("tp2", _cfg("gpt", tp=2))]
    results = run_world(_compare_many, 2, runs, timeout=200)[0]
    for tag in ("zero3", "tp2"):
        got = results[tag]["meta"]["start"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), tag


# -- the contract, refused in one line ---------------------------------------------------------
class ReadsWeights(torch.nn.Module):
    """Reads its own weight's values in __init__ (a data-dependent scale): fails on meta."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.scale = float(self.fc.weight.abs().max())


class NoInitialiser(torch.nn.Module):
    """A raw Parameter and no reset_parameters: nothing can set it after a meta build."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(3, 4))


def reads_weights(cfg):
    return ReadsWeights()


def no_initialiser(cfg):
    return torch.nn.Sequential(torch.nn.Linear(4, 4), NoInitialiser())


@pytest.mark.parametrize("fn,names", [("reads_weights", ("ReadsWeights.__init__",)),
                                      ("no_initialiser", ("'1'", "NoInitialiser", "table"))])
def test_user_model_without_the_contract_is_refused_in_one_line(fn, names):
    m = ModelConfig(name=f"{__name__}:{fn}")
    with pytest.raises(ConfigError) as err:
        model = build_model(m, 0, init="meta")
        Materializer(model, 0)
    msg = str(err.value)
    assert "\n" not in msg and "fix:" in msg
    for name in names:
        assert name in msg, msg
    # eager builds it (the constructor's own weights when it has no initialiser)
    assert not is_meta(build_model(m, 0, init="eager"))


def test_tied_weights_stay_tied_and_buffers_are_recomputed():
    for name in ("hf:gpt2", "hf:llama"):
        m = ModelConfig(name=name, n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=67)
        model = build_model(m, 3, init="meta")
        Materializer(model, 3).fill_module(model)
        eager = build_model(m, 3)
        if name == "hf:gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
        else:   # the rotary table is a buffer Hugging Face's _init_weights recomputes
            from shardwise.models import hf
            plain = hf.build(m)
            rotary = model.model.rotary_emb
            assert torch.equal(rotary.inv_freq, plain.model.rotary_emb.inv_freq)
            assert torch.equal(rotary.original_inv_freq, plain.model.rotary_emb.original_inv_freq)
        for (k, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
            assert torch.equal(a, b), k
