"""ZeRO rows: stages 1-3 against PyTorch's own sharding (FSDP2 ``fully_shard`` per block then
the root; ``ZeroRedundancyOptimizer`` under torch DDP), disk offload against none, the
same-host shared-memory collectives against gloo's at 57M (``zero*-shm-vs-native-57m``), ZeRO-1
at 57M against one process with both cores (the physical limit of data parallelism), and peak
memory at 57M parameters (the ``*-memory-57m-*`` rows; shardwise/bench/memory.py has the method and
the six-way table).

Ours report ``peak_mem`` = the ledger's bytes held (parameters, gradients, optimizer states,
masters, communication buffers, saved activations; not what sits on disk); the runner adds every
side's peak resident memory (``peak_rss_max_rank``), the only memory figure the peers have.
"""
from __future__ import annotations

import torch

from shardwise.config.names import Strategy
from shardwise.bench.harness import (Row, gpt_bench_config, parameters, sized_config,
                                     threads_for, timed_steps)
from shardwise.bench.peers import ours_sized, ours_tokens_per_s, plain_loop_tokens_per_s
from shardwise.bench.rows.data_parallel import one_process_two_threads_sized
from shardwise.run.api import optimizer_kernel

STEPS = 14
# a bigger GPT for the offload row (13M parameters: Adam state is 50 MB per rank at N=2)
BIG = {"model": {"n_layer": 4, "n_embd": 512, "block_size": 64}, "train": {"steps": 6}}


def _ours(strategy: str, world: int, overrides: dict, steps: int = STEPS, **parallel) -> dict:
    train = {"steps": steps, **overrides.get("train", {})}
    sections = {k: v for k, v in overrides.items() if k != "train"}
    out = ours_tokens_per_s(gpt_bench_config(strategy, parallel=parallel, train=train,
                                             **sections), world)
    ledger = out["extra"]["ledger"]
    out["peak_mem"] = sum(v for k, v in ledger.items() if k != "on_disk")
    return out


def zero1(rank, world, **parallel):
    return _ours(Strategy.ZERO1, world, {}, **parallel)


def zero2(rank, world, **parallel):
    return _ours(Strategy.ZERO2, world, {}, **parallel)


def zero3(rank, world, **parallel):
    return _ours(Strategy.ZERO3, world, {}, **parallel)


STAGES = {1: Strategy.ZERO1, 2: Strategy.ZERO2, 3: Strategy.ZERO3}


def zero_sized(rank, world, stage=1, size="57m", steps=STEPS, **parallel):
    """ZeRO-``stage`` at one of harness.SIZES (its collectives as ``parallel`` says)."""
    return ours_sized(STAGES[stage], size, steps, world, **parallel)


def zero_sized_native(rank, world, **args):
    return zero_sized(rank, world, **{**args, "allreduce": "native"})


def zero3_big(rank, world, offload="none", **parallel):
    return _ours(Strategy.ZERO3, world, {**BIG, "memory": {"offload": offload}}, **parallel)


def zero3_big_no_offload(rank, world, **parallel):
    return zero3_big(rank, world, **{**parallel, "offload": "none"})


def zero3_sized(rank, world, size="3m", steps=STEPS, **parallel):
    return ours_sized(Strategy.ZERO3, size, steps, world, **parallel)


def fsdp2_sized(rank, world, size="3m", steps=STEPS, **parallel):
    cfg = sized_config(Strategy.ZERO3, size, steps)
    return {**fsdp2(rank, world, steps=steps, cfg=cfg), "extra": {"parameters": parameters(cfg)}}


def fsdp2(rank, world, steps=STEPS, cfg=None, **parallel):
    """torch FSDP2: fully_shard on each block, then on the root (the documented recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))

    def wrap(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    cfg = cfg or gpt_bench_config(Strategy.ZERO3)
    return {"items_per_s": plain_loop_tokens_per_s(cfg, rank, world, wrap=wrap, steps=steps - 2)}


def fsdp2_hsdp(rank, world, steps=STEPS, dp_shard=2, **parallel):
    """torch FSDP2 as HSDP: fully_shard on a 2-D DeviceMesh (replicate, shard), per block then
    the root; the same replicate x shard split as ours."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world // dp_shard, dp_shard),
                            mesh_dim_names=("replicate", "shard"))

    def wrap(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    cfg = gpt_bench_config(Strategy.ZERO3)
    return {"items_per_s": plain_loop_tokens_per_s(cfg, rank, world, wrap=wrap, steps=steps - 2)}


def torch_zero_redundancy(rank, world, steps=STEPS, **parallel):
    """torch DDP with ZeroRedundancyOptimizer(AdamW): PyTorch's ZeRO-1."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from shardwise.data import build_data
    from shardwise.models import build_model, lm_loss
    cfg = gpt_bench_config(Strategy.ZERO1)
    threads_for(world)
    data = build_data(cfg)
    model = DDP(build_model(cfg.model, cfg.train.seed))
    params = list(model.parameters())
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=cfg.train.lr,
                                  betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay,
                                  **optimizer_kernel(params, cfg.train.optimizer_kernel))
    state, b = {"step": 0}, cfg.train.batch_size

    def step():
        x, y = data.batch(state["step"], b, rank, world)
        state["step"] += 1
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"items_per_s": b * cfg.model.block_size / timed_steps(step, steps - 2)}


def _memory_side(kind: str, rank: int, world: int, **args) -> dict:
    """A side of shardwise/bench/memory.py (57M-parameter GPT, malloc returning freed memory)."""
    from shardwise.bench.memory import ledger_total, side
    out = side(rank, world, kind, **args)
    out["peak_mem"] = ledger_total(out["ledger"])
    out["extra"] = {"baseline_rss": out["baseline"], "ledger": out["ledger"]}
    return out


def zero3_memory(rank, world, **args):
    return _memory_side(Strategy.ZERO3, rank, world, **args)


def zero3_offload_params_memory(rank, world, offload="disk", offload_sync="auto",
                                checkpointing=False, **args):
    """ZeRO-3 at 57M with parameters, gradients, masters and Adam states offloaded
    (``--offload disk --offload-params``, ``--offload-sync``); ``extra`` adds what the row's
    goal is about: the bytes offloaded (the ledger's ``on_disk``) and the peaks of prepare and
    of training. Built on the meta device (``shardwise train``'s default), so prepare holds one
    unit at a time. ``checkpointing``: ``--activation-checkpointing`` (both sides of a row)."""
    out = _memory_side(Strategy.ZERO3, rank, world, memory={
        "offload": offload, "offload_params": True, "offload_sync": offload_sync,
        "activation_checkpointing": checkpointing}, init="meta", **args)
    return _phases(out)


def zero3_memory_phases(rank, world, offload_sync=None, checkpointing=False, **args):
    """ZeRO-3 at 57M without offload, built on the meta device as its offloaded side is
    (``offload_sync`` is the offloaded side's: nothing here writes to a disk)."""
    return _phases(_memory_side(Strategy.ZERO3, rank, world, init="meta", memory={
        "activation_checkpointing": checkpointing}, **args))


def _phases(out: dict) -> dict:
    out["extra"].update(peak_prepare=out["peak_prepare"], peak_train=out["peak_train"],
                        offloaded=out["ledger"].get("on_disk", 0),
                        ledger_at_peak=out["ledger_instant"])
    return out


def zero2_memory(rank, world, **args):
    return _memory_side(Strategy.ZERO2, rank, world, **args)


def fsdp2_memory(rank, world, **args):
    return _memory_side("fsdp2", rank, world, **args)


def torch_ddp_memory(rank, world, **args):
    return _memory_side("torch-ddp", rank, world, **args)


FSDP2 = "torch FSDP2 (fully_shard per block, then root)"
GOAL = "throughput >= 1.0x FSDP2, peak memory <= 1.05x FSDP2"
QUICK = {"steps": 6}   # --quick: 4 timed steps after 2 warm-up steps
ROWS = [
    Row("zero1-vs-torch-zero", zero1, torch_zero_redundancy, world=2, args={}, quick_args=QUICK,
        goal="throughput >= 1.0x", peer_name="torch DDP + ZeroRedundancyOptimizer"),
    Row("zero2-vs-fsdp2", zero2, fsdp2, world=2, args={}, quick_args=QUICK, goal=GOAL,
        peer_name=FSDP2),
    Row("zero3-vs-fsdp2", zero3, fsdp2, world=2, args={}, quick_args=QUICK, goal=GOAL,
        peer_name=FSDP2, series=Strategy.ZERO3),
    # world scaling (series "zero3", with the rows at 2 and 4) and the scaling family by model
    # size (series "size:zero3": the report's sizes chart)
    Row("zero3-vs-fsdp2-w1", zero3, fsdp2, world=1, args={}, goal=GOAL, peer_name=FSDP2,
        series=Strategy.ZERO3),
    *[Row(f"zero3-vs-fsdp2-size-{size}", zero3_sized, fsdp2_sized, world=2,
          args={"size": size, "steps": steps}, series="size:zero3",
          goal="ratio >= 1.0; tokens/s and peak RSS against model size", peer_name=FSDP2)
      for size, steps in (("3m", 10), ("57m", 6), ("350m", 4))],
    # ZeRO's reduce-scatters and all-gathers through the same-host shared memory (comm/shm.py),
    # which --allreduce auto takes here, against gloo's, whose reduce-scatter all-reduces
    *[Row(f"zero{stage}-shm-vs-native-57m", zero_sized, zero_sized_native, world=2,
          args={"stage": stage, "size": "57m", "steps": 6, "allreduce": "shm"},
          quick_args={"steps": 4}, peer_name=f"shardwise ZeRO-{stage}, gloo's collectives",
          goal="effect of the shared-memory collectives (ratio > 1 means they help)")
      for stage in (1, 2, 3)],
    # issue 35 item 3's limit for ZeRO-1, which steps half the optimizer on each rank
    Row("zero1-vs-one-process-57m", zero_sized, one_process_two_threads_sized, world=2,
        peer_world=1, args={"stage": 1, "size": "57m", "steps": 8}, quick_args={"steps": 6},
        goal="ratio >= 0.98 (ZeRO-1 world 2 against the 2-core limit)",
        peer_name="one process, 2 threads, plain loop"),
    Row("zero3-ring-vs-fsdp2", zero3, fsdp2, world=2, args={"allreduce": "ring"}, goal=GOAL,
        peer_name=FSDP2),
    Row("zero3-vs-fsdp2-w4", zero3, fsdp2, world=4, args={}, goal=GOAL, peer_name=FSDP2,
        series=Strategy.ZERO3),
    Row("hsdp-vs-fsdp2-hsdp", zero3, fsdp2_hsdp, world=4, args={"dp_shard": 2}, goal=GOAL,
        peer_name="torch FSDP2 on a 2-D DeviceMesh (replicate 2 x shard 2)"),
    # memory at 57M parameters (the whole six-way table: python -m shardwise.bench.memory)
    Row("zero3-memory-57m-vs-fsdp2", zero3_memory, fsdp2_memory, world=2,
        args={"steps": 4, "batch": 4}, quick_args={"steps": 3}, goal="peak RSS <= 1.05x FSDP2",
        peer_name=FSDP2),
    Row("zero2-memory-57m-vs-torch-ddp", zero2_memory, torch_ddp_memory, world=2,
        args={"steps": 4, "batch": 4}, goal="peak RSS < torch DDP's", peer_name="torch DDP"),
    # ZeRO-Infinity at 57M (issue 30): throughput >= 0.85x, peak RSS below by >= 0.9 x offloaded
    Row("zero3-offload-params-disk-vs-none", zero3_offload_params_memory, zero3_memory_phases,
        world=2, args={"steps": 4, "batch": 4}, quick_args={"steps": 3},
        goal="throughput >= 0.85x; peak RSS below by >= 0.9 x the offloaded bytes",
        peer_name="shardwise ZeRO-3 without offload"),
    # the same with every written chunk synced to the disk at once (what a state bigger than
    # RAM runs with; at 57M --offload-sync auto leaves the writes to the kernel)
    Row("zero3-offload-params-disk-sync-vs-none", zero3_offload_params_memory, zero3_memory_phases,
        world=2, args={"steps": 4, "batch": 4, "offload_sync": "always"},
        quick_args={"steps": 3}, goal="throughput >= 0.85x; peak RSS below by >= 0.9 x the "
        "offloaded bytes", peer_name="shardwise ZeRO-3 without offload"),
    # both sides with activation checkpointing: their peaks then fall where the activations
    # are small on both (without it the offloaded side peaks at the end of the forward, the
    # other at the end of the backward: docs/zero.md), so the fall is offload's alone
    Row("zero3-offload-params-disk-vs-none-ckpt", zero3_offload_params_memory,
        zero3_memory_phases, world=2, args={"steps": 4, "batch": 4, "checkpointing": True},
        quick_args={"steps": 3}, goal="throughput >= 0.85x; peak RSS below by >= 0.9 x the "
        "offloaded bytes", peer_name="shardwise ZeRO-3 without offload, both checkpointed"),
    Row("zero3-offload-disk-vs-none", zero3_big, zero3_big_no_offload, world=2,
        args={"offload": "disk"}, goal="peak memory drops (ratio < 1), throughput cost stated",
        peer_name="shardwise ZeRO-3 without offload"),
]
