"""Model-parallel rows: shardwise's pipeline against torch.distributed.pipelining (GPipe, 1F1B,
interleaved 1F1B against ScheduleInterleaved1F1B with 2 chunks per rank, ZB-H1 against
ScheduleInterleavedZeroBubble with one stage per rank: torch's split-backward schedule on the
same single-chunk pipeline, which is what ZB-H1 is; ScheduleZBVZeroBubble needs two chunks),
shardwise's tensor parallel (and with --sp, also at a long sequence, where activations show in the
memory) against DTensor tensor parallel, and the measured bubble against
(p-1)/(m+p-1) for p = 2, 4 and m = 1, 2, 4, 8 (an ours-only row whose ``extra`` is the table).
Same benchmark GPT (shardwise.bench.harness.gpt_bench_config), same world (2), same run."""
from __future__ import annotations

import statistics

import torch

from shardwise.config.names import Axis, Strategy
from shardwise.bench.harness import Row, gpt_bench_config, threads_for, timed_steps
from shardwise.bench.peers import ours_tokens_per_s
from shardwise.data import build_data
from shardwise.models import build_model, lm_loss
from shardwise.bench.peers import same_optimizer

STEPS = 12
MICRO = 4


LONG = 2048       # the long-sequence rows' length (batch 2): activations outweigh import torch


def _cfg(strategy: str, seq: int | None = None, **parallel):
    """The benchmark GPT; ``seq``: at that sequence length, batch 2 (the long-sequence rows)."""
    long = {"model": {"block_size": seq}, "train": {"steps": STEPS, "batch_size": 2}} if seq \
        else {"train": {"steps": STEPS}}
    return gpt_bench_config(strategy, parallel=parallel, logging={"schedule_png": "off"}, **long)


def ours_pp(rank, world, schedule):
    return ours_tokens_per_s(_cfg(Strategy.PP, pp=world, schedule=schedule,
                                  num_microbatches=MICRO), world)


def ours_pp_multi(rank, world, schedule, v, pp_transport="auto"):
    extra = {"virtual_stages": v} if v > 1 else {}
    return ours_tokens_per_s(_cfg(Strategy.PP, pp=world, schedule=schedule, num_microbatches=MICRO,
                                  pp_transport=pp_transport, **extra), world)


def ours_pp_gloo(rank, world, schedule, v, **_):
    """The same pipeline with the backend's send / recv (``--pp-transport native``)."""
    return ours_pp_multi(rank, world, schedule, v, pp_transport="native")


def torch_pipelining_multi(rank, world, schedule, v):
    """torch's multi-stage schedules on the same cut: ``v`` chunks per rank (stage indices
    rank + c * world, as shardwise's VirtualStages), ScheduleInterleaved1F1B for
    interleaved-1f1b and ScheduleInterleavedZeroBubble (backward split into input and weight
    gradients) for zb-h1."""
    from torch.distributed.pipelining import (PipelineStage, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    from shardwise.parallel.pipeline.stage import PipelineStage as Cut, stage_bounds
    threads_for(world)
    cfg = _cfg(Strategy.PP, pp=world)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    n = world * v
    bounds = stage_bounds(model, n)
    parts = [Cut(model, bounds, rank + c * world) for c in range(v)]
    stages = [PipelineStage(part, rank + c * world, n, torch.device("cpu"))
              for c, part in enumerate(parts)]
    cls = ScheduleInterleaved1F1B if schedule == "interleaved-1f1b" else \
        ScheduleInterleavedZeroBubble
    pipe = cls(stages, MICRO, loss_fn=lm_loss)
    params = [q for part in parts for q in part.parameters()]
    opt = same_optimizer(cfg, params)
    return _timed_pipeline(pipe, opt, data, cfg, rank)


def _timed_pipeline(pipe, opt, data, cfg, rank: int) -> dict:
    """Tokens/s of a torch.distributed.pipelining schedule (rank 0 feeds the inputs, the
    other ranks pass the targets), one AdamW step per batch: the step loop every torch pipelining peer shares."""
    b, state = cfg.train.batch_size, {"step": 0}

    def step():
        x, y = data.batch(state["step"], b)
        state["step"] += 1
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, STEPS - 2)
    return {"items_per_s": b * cfg.model.block_size / dt}


def ours_tp(rank, world, seq=None, **_):
    return ours_tokens_per_s(_cfg(Strategy.TP, seq, tp=world), world)


def torch_pipelining(rank, world, schedule):
    """The same GPT cut at the same block boundary, run by torch's PipelineStage + schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from shardwise.parallel.pipeline.stage import PipelineStage as Cut, stage_bounds
    threads_for(world)
    cfg = _cfg(Strategy.PP, pp=world)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    part = Cut(model, stage_bounds(model, world), rank)
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = cls(stage, MICRO, loss_fn=lm_loss)
    opt = same_optimizer(cfg, part.parameters())
    return _timed_pipeline(pipe, opt, data, cfg, rank)


def dtensor_block(block, tp_mesh, tp: int, c: int) -> None:
    """One GPT block under DTensor TP: qkv / fc column-wise, the projections row-wise."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    with torch.no_grad():   # reorder qkv rows so that a contiguous split keeps whole heads
        w = block.attn.qkv.weight
        w.copy_(w.view(3, tp, c // tp, c).transpose(0, 1).reshape(3 * c, c))
    block.attn.n_head //= tp
    parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})


def dtensor_tp(rank, world, **_):
    """torch's DTensor tensor parallel: ColwiseParallel qkv / fc, RowwiseParallel proj."""
    from torch.distributed.device_mesh import init_device_mesh
    threads_for(world)
    cfg = _cfg(Strategy.TP, tp=world)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        dtensor_block(block, mesh, world, cfg.model.n_embd)
    opt = same_optimizer(cfg, model.parameters())
    b, state = cfg.train.batch_size, {"step": 0}

    def step():
        x, y = data.batch(state["step"], b)
        state["step"] += 1
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, STEPS - 2)
    return {"items_per_s": b * cfg.model.block_size / dt}


def ours_tp_sp(rank, world, seq=None, **_):
    return ours_tokens_per_s(_cfg(Strategy.TP, seq, tp=world, sequence_parallel=True), world)


def dtensor_tp_sp(rank, world, seq=None, **_):
    """torch's DTensor tensor parallel with Megatron's sequence parallelism, as torchtitan plans
    it: layer norms ``SequenceParallel`` (on a 1/T slice of the sequence), attention and MLP
    entered through ``PrepareModuleInput`` (all-gather of the slices), the projections
    ``RowwiseParallel(output_layouts=Shard(1))`` (reduce-scatter); the blocks' input cut to this
    rank's slice, the final norm's output gathered before the (whole) head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    threads_for(world)
    cfg = _cfg(Strategy.TP, seq, tp=world)
    data, model = build_data(cfg), build_model(cfg.model, cfg.train.seed)
    mesh = init_device_mesh("cpu", (world,))
    c = cfg.model.n_embd
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    gather_kv = PrepareModuleInput(input_layouts=(Shard(1), None),   # attn(x, kv): kv is None
                                   desired_input_layouts=(Replicate(), None))
    for block in model.blocks:
        with torch.no_grad():
            w = block.attn.qkv.weight
            w.copy_(w.view(3, world, c // world, c).transpose(0, 1).reshape(3 * c, c))
        block.attn.n_head //= world
        parallelize_module(block, mesh, {
            "ln_1": SequenceParallel(), "attn": gather_kv, "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(), "mlp": gather, "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, mesh, {
        "ln_f": SequenceParallel(),
        "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True)})
    model.blocks[0].register_forward_pre_hook(   # the replicated embeddings: keep this slice
        lambda m, args: (args[0].chunk(world, dim=1)[rank], *args[1:]))
    opt = same_optimizer(cfg, model.parameters())
    b, state = cfg.train.batch_size, {"step": 0}

    def step():
        x, y = data.batch(state["step"], b)
        state["step"] += 1
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = timed_steps(step, STEPS - 2)
    return {"items_per_s": b * cfg.model.block_size / dt}


def bubble_table(rank, world):
    """Measured bubble (median of 3 steps) vs the formula, p = 2 (dp = 2) and p = 4, m = 1..8."""
    from shardwise.run.api import optimizer_factory, prepare
    from shardwise.models import loss_for
    from shardwise.run.runtime import init_runtime
    threads_for(world)
    table, rate = [], None
    for p in (2, 4):
        for m in (1, 2, 4, 8):
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                ("zb-h1", 1)):
                if p * v > 4 or (v > 1 and m % p):   # 4 blocks; interleaving needs m = k·p
                    continue
                extra = {"virtual_stages": v} if v > 1 else {}
                par = {Axis.PP: p, Axis.DP: world // p, "schedule": schedule,
                       "num_microbatches": m, **extra}
                cfg = gpt_bench_config(Strategy.THREE_D, parallel=par, train={"batch_size": 16},
                                       logging={"schedule_png": "off"})
                rt = init_runtime(cfg)
                engine = prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg,
                                 loss_fn=loss_for(cfg.model), runtime=rt)
                x, y = build_data(cfg).batch(0, 16, *engine.strategy.data_shard())
                reps = []
                dt = timed_steps(lambda: reps.append(engine.train_step(x, y)), 3, warmup=1)
                bubbles = []
                for _ in range(3):
                    engine.train_step(x, y)
                    bubbles.append(engine.strategy.pipeline_report()["bubble_measured"])
                rep = engine.strategy.report
                table.append({"p": p, "m": m, "schedule": schedule, "v": v,
                              "bubble_measured": statistics.median(bubbles),
                              "bubble_formula": rep["bubble_formula"],
                              "peak_in_flight": rep["peak_in_flight"]})
                if (p, m, schedule) == (4, 8, "1f1b"):
                    rate = 16 * cfg.model.block_size / dt
    return {"items_per_s": rate, "extra": {"bubble": table}}


ROWS = [
    Row("mp-pp-gpipe-vs-torch", ours_pp, torch_pipelining, world=2, args={"schedule": "gpipe"},
        goal="ratio >= 1.0", peer_name="torch.distributed.pipelining ScheduleGPipe"),
    Row("mp-pp-1f1b-vs-torch", ours_pp, torch_pipelining, world=2, args={"schedule": "1f1b"},
        goal="ratio >= 1.0", peer_name="torch.distributed.pipelining Schedule1F1B"),
    Row("mp-pp-interleaved-vs-torch", ours_pp_multi, torch_pipelining_multi, world=2,
        args={"schedule": "interleaved-1f1b", "v": 2}, goal="ratio >= 1.0",
        peer_name="torch.distributed.pipelining ScheduleInterleaved1F1B (2 chunks per rank)"),
    Row("mp-pp-zbh1-vs-torch", ours_pp_multi, torch_pipelining_multi, world=2,
        args={"schedule": "zb-h1", "v": 1}, goal="ratio >= 1.0",
        peer_name="torch.distributed.pipelining ScheduleInterleavedZeroBubble (1 stage per rank)"),
    Row("mp-pp-interleaved-shm-vs-native", ours_pp_multi, ours_pp_gloo, world=2,
        args={"schedule": "interleaved-1f1b", "v": 2, "pp_transport": "shm"},
        goal="effect of the shared-memory sends (ratio > 1 means they help)",
        peer_name="shardwise interleaved 1F1B over gloo's send / recv"),
    Row("mp-pp-zbh1-shm-vs-native", ours_pp_multi, ours_pp_gloo, world=2,
        args={"schedule": "zb-h1", "v": 1, "pp_transport": "shm"},
        goal="effect of the shared-memory sends (ratio > 1 means they help)",
        peer_name="shardwise ZB-H1 over gloo's send / recv"),
    Row("mp-tp-vs-dtensor", ours_tp, dtensor_tp, world=2, goal="ratio >= 1.0",
        peer_name="DTensor ColwiseParallel / RowwiseParallel"),
    Row("mp-tp-sp-vs-dtensor-sp", ours_tp_sp, dtensor_tp_sp, world=2, goal="ratio >= 1.0",
        peer_name="DTensor TP with SequenceParallel (torchtitan's plan)"),
    Row("mp-tp-sp-long-vs-dtensor-sp", ours_tp_sp, dtensor_tp_sp, world=2,
        args={"seq": LONG}, goal="ratio >= 1.0, RSS ratio <= 1.0",
        peer_name=f"DTensor TP with SequenceParallel, sequence {LONG}, batch 2"),
    Row("mp-tp-sp-vs-tp-long", ours_tp_sp, ours_tp, world=2, args={"seq": LONG},
        goal="RSS ratio < 1.0 (sp's saving at a long sequence), its price in throughput",
        peer_name=f"shardwise tp without --sp, sequence {LONG}, batch 2"),
    Row("mp-bubble", bubble_table, None, world=4, goal="measured bubble vs (p-1)/(m+p-1)"),
]
