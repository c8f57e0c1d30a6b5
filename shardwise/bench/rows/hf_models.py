"""Rows on models we did not write: a Hugging Face Llama (the benchmark GPT's sizes: 4 layers,
width 256, 4 heads, seq 128, byte vocabulary; MLP 704, untied head) under shardwise's tensor
parallel, which splits it by its plan (shardwise/models/plans.py), against DTensor tensor
parallel on the same model: ColwiseParallel q / k / v / gate / up, RowwiseParallel o / down in
every decoder layer (as the GPT row of model_parallel.py: DTensor's embedding and head stay
replicated, shardwise's are vocab-parallel). Same world (2), same run, same batches."""
from __future__ import annotations

import torch

from shardwise.config.names import Strategy
from shardwise.bench.harness import Row, gpt_bench_config, threads_for, timed_steps
from shardwise.bench.peers import ours_tokens_per_s
from shardwise.data import build_data
from shardwise.models import build_model, output_loss
from shardwise.bench.peers import same_optimizer

STEPS = 12


def _cfg(strategy: str, **parallel):
    cfg = gpt_bench_config(strategy, parallel=parallel, train={"steps": STEPS},
                           logging={"schedule_png": "off"})
    from dataclasses import replace
    return replace(cfg, model=replace(cfg.model, name="hf:llama"))


def ours_tp_llama(rank, world, **_):
    return ours_tokens_per_s(_cfg(Strategy.TP, tp=world), world)


LLAMA_TP = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
            "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
            "mlp.down_proj": "row"}


def dtensor_tp_llama(rank, world, **_):
    """torch's DTensor tensor parallel on the same Llama (its attention reshapes by head_dim,
    so the local heads need no attribute change)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    threads_for(world)
    cfg = _cfg(Strategy.TP, tp=world)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    mesh = init_device_mesh("cpu", (world,))
    styles = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in LLAMA_TP.items()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, styles)
    opt = same_optimizer(cfg, model.parameters())
    b, state = cfg.train.batch_size, {"step": 0}

    def step():
        x, y = data.batch(state["step"], b)
        state["step"] += 1
        output_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, STEPS - 2)
    return {"items_per_s": b * cfg.model.block_size / dt}


ROWS = [
    Row("hf-llama-tp-vs-dtensor", ours_tp_llama, dtensor_tp_llama, world=2, goal="ratio >= 1.0",
        peer_name="DTensor ColwiseParallel / RowwiseParallel on the same HF Llama"),
]
