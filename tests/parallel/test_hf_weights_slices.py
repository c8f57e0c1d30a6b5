"""``--hf-weights`` on the meta path (models/weights.py): each rank reads only its bytes of a
sharded safetensors folder, and the model it trains equals ``from_pretrained``'s.

The folder is ``save_pretrained(..., max_shard_size="200KB")`` of a small HF GPT-2 (tied head)
and Llama built from a config (never downloaded), so it is several shards plus an index. Each
layout loads it in one world; every rank counts the bytes it read (``weights.bytes_read``), and
the gathered state (``full_state_dict``) must equal ``from_pretrained(DIR)`` loaded in this
process with ``torch.equal``: loading copies bytes, nothing is computed. What a rank must read
is computed from the files, never typed: at world 2 under tp 2 a rank reads every tensor tp
keeps whole plus its half of every split one; under ZeRO-3 its half of every unit (plus a row
at each shard boundary, and the buffers and frozen tensors it keeps whole).
"""
import glob
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import tiny_config
from shardwise.models import build_model, loss_for
from shardwise.models.weights import bytes_read
from shardwise.run.api import optimizer_factory, prepare
from shardwise.run.runtime import init_runtime

pytestmark = pytest.mark.timeout(300)
LAYOUTS = {"zero3": {}, "tp2": dict(tp=2), "pp2": dict(pp=2, num_microbatches=2),
           "ddp": dict(zero_stage=0)}


def _save(family: str, folder) -> str:
    """A small HF model of ``family`` (seeded), saved in 200 KB shards; its folder."""
    import transformers
    torch.manual_seed(3)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=67,
                                         n_positions=16, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4,
                                          intermediate_size=192, vocab_size=67,
                                          max_position_embeddings=16, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    path = str(folder / family)
    model.save_pretrained(path, max_shard_size="200KB")
    return path


def _file_bytes(path: str) -> dict[str, int]:
    """Bytes of each tensor in the folder's files (a tensor's nbytes), by key."""
    from safetensors import safe_open
    from shardwise.models.hf import weight_files
    out = {}
    for f in weight_files(path):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                out[k] = t.numel() * t.element_size()
    return out


def _cfg(model: str, path: str, layout: dict, strategy: str = "zero3"):
    cfg = tiny_config("3d" if "tp" in layout or "pp" in layout else strategy, steps=1, **layout)
    return replace(cfg, model=replace(cfg.model, name=model, hf_weights=path, n_embd=64),
                   train=replace(cfg.train, optimizer="adamw"))


def _load(rank, n, runs):
    """For each run: this rank's bytes read while preparing, and the gathered state."""
    out = {}
    for tag, cfg in runs:
        rt = init_runtime(cfg)
        before = bytes_read()
        model = build_model(cfg.model, cfg.train.seed, init="meta")
        engine = prepare(model, optimizer_factory(cfg), cfg, loss_fn=loss_for(cfg.model),
                         runtime=rt)
        read = bytes_read() - before
        local = {n: (t.numel() * t.element_size()) for n, t in engine.model.named_parameters()}
        m = engine.model
        # (pp: the last stage holds a copy of the embedding, kept equal by the pipeline)
        tied = cfg.parallel.pp > 1 or (getattr(m, "lm_head", None) is not None and
                                       m.lm_head.weight is m.get_input_embeddings().weight)
        out[tag] = dict(read=read, state=engine.full_state_dict(), kept=sum(local.values()),
                        tied=tied)
        engine.close()
    return out


def _expected(path: str) -> dict:
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_weights_load_each_ranks_bytes_at_world_2(family, tmp_path):
    path = _save(family, tmp_path)
    assert len(glob.glob(f"{path}/model-*-of-*.safetensors")) > 1, "not a sharded folder"
    total = sum(_file_bytes(path).values())
    runs = [(tag, _cfg(f"hf:{family}", path, layout, "ddp" if tag == "ddp" else "zero3"))
            for tag, layout in LAYOUTS.items()]
    ranks = run_world(_load, 2, runs, timeout=280)
    _check_equal(family, path, ranks, [tag for tag, _ in runs])
    for r in ranks:
        assert r["tp2"]["read"] == r["tp2"]["kept"], r["tp2"]   # exactly the slices it keeps
        assert r["ddp"]["read"] == total                         # a replica reads everything
    zero3 = [r["zero3"]["read"] for r in ranks]
    # ZeRO-3: its half of each unit's flat parameters; a shard boundary inside a tensor makes
    # both ranks read that one row (at most 2 rows of 64 floats per unit here: < 1% of total)
    assert total <= sum(zero3) <= 1.01 * total, (zero3, total)
    assert max(zero3) <= 0.51 * total, (zero3, total)
    for tag in ("zero3", "tp2", "pp2"):     # pp: a stage reads its own blocks (and embeddings)
        assert all(r[tag]["read"] < 0.75 * total for r in ranks), tag


def test_hf_weights_at_world_1(tmp_path):
    """The single strategy on the meta path reads every tensor once, equal to from_pretrained."""
    path = _save("gpt2", tmp_path)
    ranks = run_world(_load, 1, [("single", _cfg("hf:gpt2", path, {}, "single"))], timeout=120)
    _check_equal("gpt2", path, ranks, ["single"])
    assert ranks[0]["single"]["read"] == sum(_file_bytes(path).values())


def test_hf_weights_in_bf16_load_into_an_fp32_model(tmp_path):
    """A bf16 checkpoint into the fp32 model: each value converted (exact: bf16 -> fp32 is)."""
    import transformers
    path = _save("llama", tmp_path)
    transformers.AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(
        str(tmp_path / "bf16"), max_shard_size="200KB")
    ranks = run_world(_load, 1, [("single", _cfg("hf:llama", str(tmp_path / "bf16"), {},
                                                  "single"))], timeout=120)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"),
                                                             dtype=torch.float32).state_dict()
    state = ranks[0]["single"]["state"]
    assert all(state[k].dtype == torch.float32 for k in want)
    bad = [k for k in want if not torch.equal(state[k], want[k])]
    assert not bad, bad
    assert ranks[0]["single"]["read"] == sum(_file_bytes(str(tmp_path / "bf16")).values())


def _check_equal(family: str, path: str, ranks: list, tags: list) -> None:
    """Every rank's gathered state equals from_pretrained(path)'s, tensor for tensor."""
    want = _expected(path)
    for tag in tags:
        for r in ranks:
            state = dict(r[tag]["state"])
            if family == "gpt2":     # tied: the gathered state names it once, the model still
                assert r[tag]["tied"], tag                   # holds one Parameter for both
                state.setdefault("lm_head.weight", state["transformer.wte.weight"])
            missing = [k for k in want if k not in state]
            assert not missing, (tag, missing)
            bad = [k for k in want if not torch.equal(state[k], want[k])]
            assert not bad, (tag, bad)
