"""Composed layouts. (1) 3d (dp 2 x pp 2, world 4) at stage 0, whose dp part is now DDP's
buckets launched during the step's last micro-batch backward (1 MB buckets), against the private
path it replaced: one flat allreduce after the last backward (``--no-overlap`` with one bucket).
(2) shardwise's ZeRO-3 x tensor parallel (``--dp 2 --tp 2 --zero-stage 3``)
against torchtitan's everyday 2-D layout, FSDP2 over dp on top of DTensor tensor parallel over
tp (``parallelize_module`` then ``fully_shard`` per block and the root, one 2-D DeviceMesh).
Same benchmark GPT (shardwise.bench.harness.gpt_bench_config), world 4, same run.

Both sides split qkv / fc column-wise and proj row-wise by heads; shardwise also splits the
vocabulary (embedding, head, loss), which the DTensor peer keeps whole and FSDP shards."""
from __future__ import annotations

import torch

from shardwise.config.names import Axis, Strategy
from shardwise.bench.harness import Row, gpt_bench_config, threads_for, timed_steps
from shardwise.bench.peers import ours_tokens_per_s
from shardwise.bench.rows.model_parallel import dtensor_block
from shardwise.data import build_data
from shardwise.models import build_model, lm_loss
from shardwise.bench.peers import same_optimizer

STEPS = 10


def _cfg(steps=STEPS, **parallel):
    return gpt_bench_config(Strategy.THREE_D, parallel=parallel, train={"steps": steps},
                            logging={"schedule_png": "off"})


def ours_3d_buckets(rank, world, **_):
    return ours_tokens_per_s(_cfg(dp=2, pp=2, bucket_mb=1.0), world)


def flat_3d(rank, world, **_):
    return ours_tokens_per_s(_cfg(dp=2, pp=2, bucket_mb=1000.0, overlap=False), world)


def ours_zero3_tp(rank, world, steps=STEPS, **_):
    return ours_tokens_per_s(_cfg(steps, dp=world // 2, tp=2, zero_stage=3), world)


def fsdp2_dtensor_tp(rank, world, steps=STEPS, **_):
    """FSDP2 (fully_shard over the dp mesh dimension) on DTensor TP (over the tp dimension)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    threads_for(world)
    dp, tp = world // 2, 2
    cfg = _cfg(steps, dp=dp, tp=tp, zero_stage=3)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=(Axis.DP, Axis.TP))
    for block in model.blocks:
        dtensor_block(block, mesh[Axis.TP], tp, cfg.model.n_embd)
        fully_shard(block, mesh=mesh[Axis.DP])
    fully_shard(model, mesh=mesh[Axis.DP])
    opt = same_optimizer(cfg, model.parameters())
    b, state = cfg.train.batch_size, {"step": 0}
    dp_rank = mesh[Axis.DP].get_local_rank()

    def step():
        x, y = data.batch(state["step"], b, dp_rank, dp)
        state["step"] += 1
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, steps - 2)
    return {"items_per_s": b * cfg.model.block_size / dt}


ROWS = [
    Row("compose-3d-buckets-vs-flat", ours_3d_buckets, flat_3d, world=4, goal="ratio >= 1.0",
        peer_name="one flat allreduce after backward (the old private path)"),
    Row("compose-zero3-tp-vs-fsdp2-tp", ours_zero3_tp, fsdp2_dtensor_tp, world=4,
        goal="ratio >= 1.0", peer_name="FSDP2 over dp on DTensor TP (2-D DeviceMesh)",
        quick_args={"steps": 6}),
]
