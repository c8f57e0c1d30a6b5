"""final.safetensors under a pipeline (tensor parallel inside or not) is streamed stage by stage (PipelineDriver.full_state_order /
full_state_groups, read by shardwise/run/train._save_final): global rank 0 receives each stage's
parameters in turn, every other rank yields nothing, and what rank 0 writes is exactly the model
``engine.full_state_dict()`` gathers (every name once: GPT-2's lm_head, tied to wte across the
stages, is not written twice). Before, every rank gathered the whole model at the end of a
pipeline run (an object all-gather over pp), which held the model whole on every rank.
"""
import pytest
import torch

from harness import run_world
from models_hf import SEQ, VOCAB, lm_loss, tiny_gpt2, token_batches, two_groups

from shardwise.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.models import build_model

pytestmark = pytest.mark.timeout(240)
GPT = ModelConfig(n_layer=4, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB)


def _cfg(**parallel):
    return Config(model=GPT, data=DataConfig(dataset="synthetic"),
                  parallel=ParallelConfig(strategy="3d", num_microbatches=2, **parallel),
                  train=TrainConfig(batch_size=8, device="cpu"))


def _streamed(rank, n, runs):
    import shardwise
    out = {}
    for tag, family, parallel in runs:
        model = tiny_gpt2(7) if family == "gpt2" else build_model(GPT, 7)
        engine = shardwise.prepare(model, two_groups(1e-3), _cfg(**parallel),
                                   loss_fn=lm_loss if family == "gpt2" else None)
        for x, y in token_batches(2, 8):
            engine.train_step(*engine.shard(x, y))
        order = engine.strategy.full_state_order()
        groups = [dict(g) for g in engine.strategy.full_state_groups()]
        out[tag] = dict(order=order, groups=groups, whole=engine.full_state_dict())
        engine.close()
    return out


RUNS = [("gpt-pp2-dp2-zero2", "gpt", {"pp": 2, "dp": 2, "zero_stage": 2}),
        ("gpt2-pp2-dp2", "gpt2", {"pp": 2, "dp": 2}),
        ("gpt-pp2-tp2", "gpt", {"pp": 2, "tp": 2})]


@pytest.fixture(scope="module")
def world4():
    return run_world(_streamed, 4, RUNS, timeout=200)


@pytest.mark.parametrize("tag", [r[0] for r in RUNS])
def test_rank0_receives_the_whole_model_stage_by_stage_and_nobody_else_does(world4, tag):
    main = world4[0][tag]
    written = {}
    for group in main["groups"]:
        assert not set(group) & set(written), "a name written twice"
        written.update(group)
    names = [n for n, _ in main["order"]]
    assert len(names) == len(set(names)) and set(names) == set(written)
    assert set(written) == set(main["whole"]), "the same names as full_state_dict"
    for name, t in written.items():
        assert torch.equal(t, main["whole"][name].float().cpu()), name
        assert tuple(t.shape) == dict(main["order"])[name]
    assert sum(1 for g in main["groups"] if g) == 2, "one group per stage"
    for other in world4[1:]:
        assert all(not g for g in other[tag]["groups"]), "only rank 0 holds what is written"
