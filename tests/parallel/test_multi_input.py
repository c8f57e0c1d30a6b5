"""Models with several inputs and their own loss, under ddp, zero3, the parameter server
(sync, one ps task and two workers) and one process's replicas (dp), against one process
(pipelines: tests/parallel/test_hf_layouts.py).

The model is a Hugging Face GPT-2 (tests/models_hf.py) fed a dict batch: input_ids,
attention_mask (right padding, different lengths per row), position_ids and labels (-100 on the
padding); ``prepare(..., loss_from="loss")`` trains on the loss the model computes itself. Even
steps use ``engine.train_step(batch)``; odd steps the user's loop (``engine.loss(batch)``,
``backward``, ``step``), and ``engine(**batch)`` is checked against the plain model's forward.

Why the shards can equal one process: the model's loss is the mean over each shard's valid
(non -100) label positions, and the global loss the mean over the batch's; the row lengths are
chosen so that every shard of 2 holds the same number of valid positions (48), so the mean of
the shards' means is the global mean. Tolerance: fp32 rtol 1e-5, atol 1e-5 (tests/reference.py:
the gradient reduction sums the ranks' gradients in another order than one process's backward).
SGD keeps GPT-2's key bias (true gradient exactly 0; see test_zero_hf.py) within the same bound.
"""
from dataclasses import replace

import pytest
import torch

from harness import run_world
from models_hf import SEQ, VOCAB, tiny_gpt2
from reference import ATOL, RTOL

pytestmark = pytest.mark.timeout(200)
STEPS, BATCH, SEED, LR = 4, 8, 7, 0.5
LENGTHS = [16, 12, 10, 14, 12, 16, 14, 10]      # valid positions per shard of 2: 48 and 48
WHY = "fp32 gradient reduction sums in another order than one process's backward"


def _batches(steps: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()   # (B, T)
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone()})
    return out


def _single():
    model = tiny_gpt2(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, logits = [], []
    for batch in _batches():
        out = model(**batch)
        logits.append(out.logits.detach().clone())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    with torch.no_grad():
        val = float(model(**_batches(1)[0]).loss)
    return dict(losses=losses, val=val, logits=logits,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def _ps_world(rank, n):
    """One ps task and two workers (sync): train_step on dict batches with the model's loss."""
    import shardwise
    from shardwise.config import Config, ParallelConfig, TrainConfig
    cfg = Config(parallel=ParallelConfig(strategy="ps", num_ps=1, ps_timeout=60.0),
                 train=TrainConfig(batch_size=BATCH, device="cpu", steps=STEPS))
    engine = shardwise.prepare(tiny_gpt2(SEED), lambda ps: torch.optim.SGD(ps, lr=LR), cfg,
                               loss_from="loss")
    losses = [engine.train_step(engine.shard(batch)) for batch in _batches()]
    val, _ = engine.evaluate(engine.shard(_batches(1)[0]))
    out = dict(losses=losses, val=val, params=engine.full_state_dict())
    engine.close()
    return out


def _world(rank, n, strategies):
    import shardwise
    from shardwise.config import Config, ParallelConfig, TrainConfig
    out = {}
    for strategy in strategies:
        cfg = Config(parallel=ParallelConfig(strategy=strategy),
                     train=TrainConfig(batch_size=BATCH, device="cpu"))
        engine = shardwise.prepare(tiny_gpt2(SEED), lambda ps: torch.optim.SGD(ps, lr=LR), cfg,
                                   loss_from="loss")
        losses, logits = [], []
        for step, batch in enumerate(_batches()):
            mine = engine.shard(batch)
            if step % 2 == 0:
                with torch.no_grad():
                    logits.append(engine(**mine).logits.clone())
                losses.append(engine.train_step(mine))
            else:
                loss = engine.loss(mine)
                engine.backward(loss)
                engine.step()
                losses.append(engine.strategy.reduce_mean(loss.detach()))
        val, _ = engine.evaluate(engine.shard(_batches(1)[0]))
        out[strategy] = dict(losses=losses, val=val, logits=logits, params=engine.full_state_dict())
        if strategy == "ddp":
            out["loader"] = _loader_runs(engine)
        engine.close()
    return out


class Items(torch.utils.data.Dataset):
    """Item i is {"i": i, "x": (3,) floats}: a dict dataset, collated into dict batches."""

    def __len__(self):
        return 22                                     # 5 global batches of 4, 2 items dropped

    def __getitem__(self, i):
        return {"i": i, "x": torch.full((3,), float(i))}


def _loader_runs(engine) -> dict:
    """Two epochs straight; and 2 batches, a saved position, a new loader that resumes."""
    whole = engine.loader(Items(), 4, seed=5)
    straight = [b["i"].tolist() for _ in range(2) for b in whole]
    first = engine.loader(Items(), 4, seed=5)
    head = []
    for b in first:
        head.append(b["i"].tolist())
        assert torch.equal(b["x"][:, 0], b["i"].float())
        if len(head) == 2:
            break
    state = first.state_dict()
    again = engine.loader(Items(), 4, seed=5)
    again.load_state_dict(state)
    rest = [b["i"].tolist() for _ in range(2) for b in again][:8 - 2]
    return dict(straight=straight, resumed=head + rest, state=state)


def test_dict_batch_and_model_loss_ddp_zero3_world2():
    from shardwise.data.loader import ShardedLoader
    ref = _single()
    results = run_world(_world, 2, ("ddp", "zero3"), timeout=180)
    # the user's Dataset: each batch split over the 2 ranks is one process's batch
    one = ShardedLoader(Items(), 4, 0, 1, seed=5)
    whole = [one.indices(e, s) for e in range(2) for s in range(len(one))]
    assert len(whole) == 10 and len(set(sum(whole[:5], []))) == 20   # no item twice an epoch
    for step, want in enumerate(whole):
        got = results[0]["loader"]["straight"][step] + results[1]["loader"]["straight"][step]
        assert got == want, f"loader step {step}"
    assert whole[:5] != whole[5:]                     # each epoch its own order
    for r in (0, 1):
        lr = results[r]["loader"]
        assert lr["state"]["batches_done"] == 2 and lr["state"]["epoch"] == 0
        assert lr["resumed"] == lr["straight"][:8]    # resumed = straight, across the epoch
    for tag in ("ddp", "zero3"):
        got = results[0][tag]
        assert results[1][tag]["losses"] == got["losses"], f"{tag}: ranks disagree"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= ATOL + RTOL * abs(b), f"{tag} step {step}: {a} vs {b} ({WHY})"
        assert abs(got["val"] - ref["val"]) <= ATOL + RTOL * abs(ref["val"]), tag
        for r in (0, 1):     # engine(**batch) on this rank's rows = the model's forward there
            for i, step in enumerate(range(0, STEPS, 2)):
                want = ref["logits"][step][r * BATCH // 2:(r + 1) * BATCH // 2]
                torch.testing.assert_close(results[r][tag]["logits"][i], want, rtol=RTOL,
                                           atol=ATOL, msg=lambda m: f"{tag} rank {r}: {m}")
        assert got["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{tag} {name}: {m} ({WHY})")


def test_dict_batch_and_model_loss_under_the_parameter_server_world3():
    ref = _single()
    results = run_world(_ps_world, 3, timeout=180)
    for r, got in enumerate(results):             # sync: every rank reports the global mean
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= ATOL + RTOL * abs(b), f"ps rank {r} step {step}: {a} vs {b}"
        assert abs(got["val"] - ref["val"]) <= ATOL + RTOL * abs(ref["val"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(results[0]["params"][name], want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"ps {name}: {m} ({WHY})")


class TwoInputs(torch.nn.Module):
    """forward(x, scale) -> a tuple (logits, aux): positional inputs, a tuple output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 4)

    def forward(self, x, scale):
        logits = self.lin(x) * scale                                     # (B, 4)
        return logits, logits.square().mean()


def test_tuple_batch_and_refusals_world1():
    import shardwise
    from shardwise.config import Config, ParallelConfig, TrainConfig
    cfg = Config(parallel=ParallelConfig(strategy="single"), train=TrainConfig(device="cpu"))
    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(8, 6, generator=g), torch.rand(8, 1, generator=g)),
             torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out[0], y)
    engine = shardwise.prepare(TwoInputs(), lambda ps: torch.optim.Adam(ps, lr=1e-2), cfg,
                               loss_fn=loss_fn)
    ours = [engine.train_step(x, y) for x, y in data]
    model = TwoInputs()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    plain = []
    for x, y in data:
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    assert ours == plain          # the same ops in the same order: bit-identical
    with pytest.raises(ValueError, match="no target y"):
        engine.train_step(data[0][0])
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        engine.train_step((torch.zeros(8, 6), torch.zeros(4, 1)), data[0][1])
    with pytest.raises(ValueError, match="the target 3"):
        engine.train_step(data[0][0], data[0][1][:3])
    with pytest.raises(ValueError, match="not both"):
        shardwise.prepare(TwoInputs(), torch.optim.SGD, cfg, loss_fn=loss_fn, loss_from=1,
                          runtime=engine.runtime)
    own = shardwise.prepare(TwoInputs(), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg,
                            loss_from=1, runtime=engine.runtime)                     # the tuple's item 1: its own loss
    assert own.train_step(data[0][0]) == pytest.approx(float(TwoInputs()(*data[0][0])[1]))
    with pytest.raises(ValueError, match="would be ignored"):
        own.train_step(*data[0])
    wrong = shardwise.prepare(TwoInputs(), torch.optim.SGD, cfg, loss_from="loss",
                              runtime=engine.runtime)
    with pytest.raises(TypeError, match="holds no scalar loss"):
        wrong.train_step(data[0][0])
    from shardwise.data.loader import ShardedLoader
    with pytest.raises(ValueError, match="multiple of the data-parallel size 2"):
        ShardedLoader(Items(), 3, 0, 2)
    with pytest.raises(ValueError, match="seed is 1, the state was saved with 5"):
        ShardedLoader(Items(), 4, 0, 1, seed=1).load_state_dict(
            ShardedLoader(Items(), 4, 0, 1, seed=5).state_dict())
    # one process, two replicas (strategy dp): a dict batch and the model's own loss, each
    # replica on half the rows (48 valid labels each), equal to the plain model
    dp = replace(cfg, parallel=ParallelConfig(strategy="dp", replicas=2))
    replicas = shardwise.prepare(tiny_gpt2(SEED), lambda ps: torch.optim.SGD(ps, lr=LR), dp,
                                 loss_from="loss", runtime=engine.runtime)
    ref = _single()
    losses = [replicas.train_step(batch) for batch in _batches()]
    val, _ = replicas.evaluate(_batches(1)[0])
    for step, (a, b) in enumerate(zip(losses, ref["losses"])):
        assert abs(a - b) <= ATOL + RTOL * abs(b), f"dp step {step}: {a} vs {b} ({WHY})"
    assert abs(val - ref["val"]) <= ATOL + RTOL * abs(ref["val"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(replicas.full_state_dict()[name], want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"dp {name}: {m} ({WHY})")
    replicas.close()
