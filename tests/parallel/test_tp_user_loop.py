"""Under tensor parallelism ``engine(x)`` returns what the model returns on one process: a
plain user loop (its own cross-entropy on ``engine(x).logits``, ``loss.backward()``,
``engine.step()``) on Hugging Face GPT-2 (tied lm_head / wte, vocabulary split over tp) equals
one process. Before, engine(x) returned this rank's vocabulary columns (34 of 67 on tp rank 0),
and F.cross_entropy on them failed with "Target .. is out of bounds" (or, with targets inside
the slice, computed a wrong loss). ``engine.local_logits(x)`` asks for the slice explicitly.

Tolerance: fp32 rtol 1e-5 (tests/reference.py): tp splits the matmul sums over two ranks, in
another order than one process. SGD (not Adam), so that rounding noise in a near-zero gradient
stays noise-sized and the parameters compare with the same tolerance.
"""
import pytest
import torch
import torch.nn.functional as F

from harness import run_world
from models_hf import VOCAB, tiny_gpt2, token_batches
from reference import ATOL, RTOL

pytestmark = pytest.mark.timeout(240)
STEPS, BATCH, SEED, LR = 3, 8, 100, 0.1


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def user_loss(out, y):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def _single():
    model = tiny_gpt2(SEED)
    opt = sgd(list(model.parameters()))
    losses = []
    for x, y in token_batches(STEPS, BATCH):
        loss = user_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _world(rank, n):
    import shardwise
    from shardwise.comm.autograd import shard_range
    from shardwise.config import Config, ParallelConfig, TrainConfig
    cfg = Config(parallel=ParallelConfig(strategy="tp", tp=2),
                 train=TrainConfig(batch_size=BATCH, device="cpu"))
    engine = shardwise.prepare(tiny_gpt2(SEED + rank), sgd, cfg)   # ranks seeded differently
    losses, shapes = [], {}
    for x, y in token_batches(STEPS, BATCH):
        xs, ys = engine.shard(x, y)
        out = engine(xs)                                   # the plain loop of one process
        loss = user_loss(out, ys)
        loss.backward()
        engine.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():                                   # the slice, asked for explicitly
        whole, local = engine(xs).logits, engine.local_logits(xs)
        start, end = shard_range(VOCAB, engine.mesh.tp_rank, 2)
        shapes = dict(whole=tuple(whole.shape), local=tuple(local.shape),
                      same=torch.equal(local, whole[..., start:end]))
    state = engine.full_state_dict()
    engine.close()
    return losses, state, shapes


def test_tp2_user_loop_on_hf_gpt2_equals_one_process():
    want_losses, want_params = _single()
    for rank, (losses, params, shapes) in enumerate(run_world(_world, 2, timeout=200)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                                   rtol=RTOL, atol=0, msg=lambda m: f"rank {rank} losses: {m}")
        for name, want in want_params.items():
            torch.testing.assert_close(params[name], want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        assert shapes["whole"][-1] == VOCAB and shapes["same"]
        assert shapes["local"][-1] == (VOCAB + 1 - rank) // 2      # 34 | 33 columns
