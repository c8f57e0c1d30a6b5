"""final.safetensors without a whole copy of the model under the plain and tensor-parallel
layouts (StrategyState.full_state_order / full_state_groups, read by
shardwise/run/train._save_final): the parameters come one at a time, each split one gathered
from the tp group in the same order on every rank, and what is written is exactly what
``engine.full_state_dict()`` gathers, under each parameter's whole shape. Before, these layouts
gathered the whole model at once on every rank (issue 30: no rank holds the whole model).
"""
import pytest
import torch

from harness import run_world
from models_hf import SEQ, VOCAB, token_batches, two_groups

from shardwise.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from shardwise.models import build_model

pytestmark = pytest.mark.timeout(240)
GPT = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB)


def _streamed(rank, n, runs):
    import shardwise
    out = {}
    for tag, parallel in runs:
        cfg = Config(model=GPT, data=DataConfig(dataset="synthetic"),
                     parallel=ParallelConfig(**parallel),
                     train=TrainConfig(batch_size=8, device="cpu"))
        engine = shardwise.prepare(build_model(GPT, 7), two_groups(1e-3), cfg)
        for x, y in token_batches(2, 8):
            engine.train_step(*engine.shard(x, y))
        order = engine.strategy.full_state_order()
        groups = [dict(g) for g in engine.strategy.full_state_groups()]
        local = {n: tuple(p.shape) for n, p in engine.strategy.model.named_parameters()}
        out[tag] = dict(order=order, groups=groups, whole=engine.full_state_dict(), local=local)
        engine.close()
    return out


RUNS = [("tp2", {"strategy": "tp", "tp": 2}), ("ddp2", {"strategy": "ddp"})]


@pytest.fixture(scope="module")
def world2():
    return run_world(_streamed, 2, RUNS, timeout=200)


@pytest.mark.parametrize("tag", [r[0] for r in RUNS])
def test_one_parameter_at_a_time_equal_to_the_whole_state(world2, tag):
    for rank in world2:
        got = rank[tag]
        assert got["order"] is not None, "the layout streams its final weights"
        assert all(len(g) == 1 for g in got["groups"]), "one parameter per group"
        written = {k: v for g in got["groups"] for k, v in g.items()}
        assert [n for n, _ in got["order"]] == [k for g in got["groups"] for k in g]
        assert set(written) == set(got["whole"])
        for name, t in written.items():
            assert t.dtype == torch.float32
            assert torch.equal(t, got["whole"][name].float()), name
            assert tuple(t.shape) == dict(got["order"])[name]


def test_tensor_parallel_shapes_are_whole_not_the_ranks_piece(world2):
    got = world2[0]["tp2"]
    split = [n for n, shape in got["order"] if shape != got["local"][n]]
    assert split, "tp splits some parameters"
    for n in split:
        assert sum(got["local"][n]) < sum(dict(got["order"])[n])
