"""Parameter-server rows: sync, async and ssp (s=2) with worker 1 at 3x step time (1 ps task,
2 workers), against allreduce data parallelism on the same 2 workers with the same straggler.

Throughput is tokens/s of the whole run (steps x global batch / wall time of the loop), since the
median step of an async run says little. ``extra`` keeps the loss curve (the ps's mean of the
workers' losses), the staleness records' summary and the traffic per step at the busiest ps
task, next to the allreduce formula 2(N-1)/N*K per worker. Plot: shardwise/bench/plot_ps.py.
"""
from __future__ import annotations

import time

import torch

from shardwise.config.names import Strategy
from shardwise.bench.harness import Row, discard_run, gpt_bench_config, threads_for
from shardwise.bench.peers import same_optimizer

STEPS = 20
BENCH = {"data": {"dataset": "stdlib", "max_bytes": 1_000_000},
         "train": {"steps": STEPS, "warmup_steps": 2, "lr": 1e-3},
         "logging": {"log_every": STEPS}}  # no mid-run logging collective to pace async


def _cfg(strategy, steps=STEPS, **parallel):
    bench = {**BENCH, "train": {**BENCH["train"], "steps": steps}, "logging": {"log_every": steps}}
    return gpt_bench_config(strategy, parallel=parallel, **bench)


def ps_run(rank, world, steps=STEPS, **parallel):
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    threads_for(world)
    cfg = _cfg(Strategy.PS, steps, **parallel)
    rt = init_runtime(cfg)
    s = train(cfg, rt, quiet=True)
    stats = s["engine"].strategy.stats()
    meter = rt.comm.meter.snapshot()
    params = sum(p.numel() * p.element_size() for p in s["engine"].model.parameters())
    busiest = (meter["ps_push"]["bytes_recv"] + meter["ps_pull"]["bytes_sent"]) / steps
    discard_run(s, rt)
    n = world - cfg.parallel.num_ps
    items = steps * cfg.train.batch_size * cfg.model.block_size
    return {"items_per_s": items / s["wall_seconds"], "bytes_sent": busiest,
            "extra": {"losses": s["losses"], "model_bytes": params,
                      "busiest_ps_bytes_per_step": busiest,
                      "ring_allreduce_bytes_per_worker": 2 * (n - 1) / n * params,
                      "staleness_max": stats.get("staleness_max", 0),
                      "staleness_mean": stats.get("staleness_mean", 0.0),
                      "applied": stats.get("applied")}}


def allreduce_dp(rank, world, steps=STEPS, **parallel):
    """The same 2 workers, gradients averaged by an allreduce (metered), rank 1 at 3x."""
    from shardwise.comm.collectives import Comm
    from shardwise.data import build_data
    from shardwise.mesh import Mesh
    from shardwise.models import build_model, loss_for
    threads_for(world)
    cfg = _cfg(Strategy.DDP, steps)
    mesh, comm = Mesh.build(1, world, 1), Comm()
    model, data = build_model(cfg.model, cfg.train.seed), build_data(cfg)
    loss_fn, opt = loss_for(cfg.model), same_optimizer(cfg, model.parameters())
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    losses, t_start = [], time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = data.batch(step, cfg.train.batch_size, rank, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        if rank == 1:  # the same straggler: 3x step time
            time.sleep(2 * (time.perf_counter() - t0))
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)
        comm.all_reduce(flat, mesh.world, op="avg")
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    wall = time.perf_counter() - t_start
    sent = comm.meter.snapshot()["all_reduce"]["bytes_sent"] / steps
    return {"items_per_s": steps * cfg.train.batch_size * cfg.model.block_size / wall,
            "bytes_sent": sent, "extra": {"losses": losses, "allreduce_bytes_per_worker": sent}}


_PEER = "allreduce DP, 2 workers, same straggler"
ROWS = [
    Row("ps-sync-straggler3x", ps_run, allreduce_dp, world=3, peer_world=2, peer_name=_PEER,
        args={"num_ps": 1, "ps_mode": "sync", "straggler": "1:3"}, quick_args={"steps": 10},
        goal="sync paced by the straggler; traffic at the ps vs allreduce"),
    Row("ps-async-straggler3x", ps_run, None, world=3,
        args={"num_ps": 1, "ps_mode": "async", "straggler": "1:3"}, quick_args={"steps": 10},
        goal="faster than sync with a 3x straggler"),
    Row("ps-ssp2-straggler3x", ps_run, None, world=3,
        args={"num_ps": 1, "ps_mode": "ssp", "staleness": 2, "straggler": "1:3"},
        quick_args={"steps": 10},
        goal="between sync and async"),
]
