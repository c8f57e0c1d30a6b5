"""Tensor parallelism: layers equal their nn.Linear / nn.Embedding / cross-entropy originals,
training equals single, and the meter shows Megatron's traffic (two allreduces of b*s*h per
layer forward, two backward).

Tolerance: fp32 rtol 1e-5 (and atol 1e-5 on parameters). Splitting a matmul over tp ranks sums
its products in another order (partial sums, then the allreduce), so gradients differ from the
single process's in the last bits; Adam divides each gradient element by its own running size,
so an element whose gradient nearly cancels turns those last bits into update differences of a
small fraction of lr (1e-2 here) over 10 steps: 1e-5 absolute is 1/1000 of lr.
"""
import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import assert_close_runs, run_world
from reference import run, single_run, tiny_config
from shardwise.run.api import optimizer_factory, prepare
from shardwise.comm.autograd import shard_range, split_sizes, vocab_parallel_cross_entropy
from shardwise.comm.collectives import Comm
from shardwise.data import build_data
from shardwise.mesh import Mesh
from shardwise.models import build_model, loss_for
from shardwise.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                       VocabParallelEmbedding)
from shardwise.run.runtime import init_runtime

pytestmark = pytest.mark.timeout(300)
RTOL, ATOL = 1e-5, 1e-5
WHY = "fp32; tp sums each matmul's products in another order"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def test_seed_matrix_example_split_on_dim1_and_concatenated():
    from tp_matmul import run_world as _rw, split_matmul
    results = _rw(split_matmul, 2)
    full = results[0]["x"] @ results[0]["w"]
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out_r"], full[:, 4 * rank: 4 * rank + 4])
        torch.testing.assert_close(r["out"], full)
        torch.testing.assert_close(r["layer_out"], r["out_r"])
        assert r["meter"]["all_gather"]["calls"] == 1


def test_split_sizes_cover_uneven_vocabularies():
    assert split_sizes(67, 2) == [34, 33] and sum(split_sizes(67, 4)) == 67
    assert shard_range(67, 1, 2) == (34, 67)


def _layers(rank, n):
    """Each tp layer against the full layer it was built from (same seed, same input)."""
    mesh, comm = Mesh.build(tp=n), Comm()
    g = mesh.tp_group
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 12), nn.Linear(12, 8)
    emb = nn.Embedding(11, 8)                                   # 11 rows: an uneven split
    x = torch.randn(3, 5, 8, requires_grad=True)
    ids, target = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (15,))
    # full MLP fc -> gelu -> proj, and its column -> row parallel version
    ref = proj(F.gelu(fc(x)))
    ref.square().sum().backward()
    x_grad, fc_grad = x.grad.clone(), fc.weight.grad.clone()
    x.grad = None
    col, row = ColumnParallelLinear(fc, comm, g), RowParallelLinear(proj, comm, g)
    out = row(F.gelu(col(x)))
    out.square().sum().backward()
    lo, hi = shard_range(12, g.rank, g.size)
    # vocab-parallel embedding and cross-entropy
    vemb = VocabParallelEmbedding(emb, comm, g)
    logits = torch.randn(15, 11, requires_grad=True)
    ce_ref = F.cross_entropy(logits, target)
    ce_ref.backward()
    v0, v1 = shard_range(11, g.rank, g.size)
    local = logits.detach()[:, v0:v1].clone().requires_grad_(True)
    ce = vocab_parallel_cross_entropy(local, target, v0, comm, g)
    ce.backward()
    return dict(mlp=(out.detach(), ref.detach()), x_grad=(x.grad, x_grad),
                fc_grad=(col.weight.grad, fc_grad[lo:hi]), emb=(vemb(ids).detach(), emb(ids).detach()),
                ce=(ce.detach(), ce_ref.detach()), ce_grad=(local.grad, logits.grad[:, v0:v1]))


def test_parallel_layers_equal_the_full_layers():
    for r in run_world(_layers, 2):
        for name, (got, want) in r.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _train_and_traffic(rank, n, configs):
    out = [run(cfg) for cfg in configs]
    cfg = configs[0]
    rt = init_runtime(cfg)
    engine = prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg,
                     loss_fn=loss_for(cfg.model), runtime=rt)
    x, y = build_data(cfg).batch(0, cfg.train.batch_size, *engine.strategy.data_shard())
    rt.comm.meter.reset()
    engine.train_step(x, y)
    local = sum(p.numel() for p in engine.model.parameters())   # this rank's tp slice
    return out, rt.comm.meter.snapshot(), tuple(x.shape), rt.mesh.tp, local


def _vol(elements: int, n: int) -> int:
    """Ring allreduce bytes each rank sends for ``elements`` fp32 values among n ranks."""
    return int(2 * (n - 1) / n * elements * 4)


def _check_traffic(meter, shape, tp, cfg):
    b, s = shape
    h, L = cfg.model.n_embd, cfg.model.n_layer
    # Megatron: per layer, g after attn.proj and mlp.proj (forward), f before qkv and fc (backward)
    for name in ("tp_fwd", "tp_bwd"):
        assert meter[name]["calls"] == 2 * L
        assert meter[name]["bytes_sent"] == 2 * L * _vol(b * s * h, tp)
    # vocab pieces, counted apart: embedding (b*s*h) + loss max (b*s) + [sum-exp, target] (2*b*s)
    # forward, f before the head (b*s*h) backward
    assert meter["tp_vocab"]["calls"] == 4
    assert meter["tp_vocab"]["bytes_sent"] == 2 * _vol(b * s * h, tp) + _vol(b * s, tp) \
        + _vol(2 * b * s, tp)


@pytest.mark.parametrize("world,dp", [(2, 1), (4, 2)])
def test_tp_equals_single_and_moves_megatron_traffic(world, dp):
    cfg = tiny_config("tp", steps=10, tp=2, dp=dp)
    cfg = replace(cfg, logging=replace(cfg.logging, schedule_png="off"))
    expected = single_run(cfg)
    for (results, meter, shape, tp, local) in run_world(_train_and_traffic, world, [cfg]):
        losses, params = results[0]
        assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why=WHY)
        _check_traffic(meter, shape, tp, cfg)
        if dp > 1:   # gradients averaged over dp by DDP's buckets: this rank's tp slice, once
            dp_meter = meter["ddp_all_reduce"]
            assert abs(dp_meter["bytes_sent"] - _vol(local, dp)) <= 4 * dp_meter["calls"]
