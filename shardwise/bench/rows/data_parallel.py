"""Data-parallel rows: DDP against torch DDP (overlap on/off, ring), DP against DDP, the
shared-memory allreduce against gloo's inside DDP, ring and shared-memory bus bandwidth against
gloo's own allreduce."""
from __future__ import annotations

import time

import torch

from shardwise.config.names import Strategy
from shardwise.bench.harness import Row, gpt_bench_config, parameters, sized_config, threads_for
from shardwise.bench.peers import (ours_sized, ours_tokens_per_s, plain_loop_tokens_per_s,
                                   torch_ddp_tokens_per_s)

STEPS = 14


def ddp(rank, world, steps=STEPS, **parallel):
    return ours_tokens_per_s(gpt_bench_config(Strategy.DDP, parallel=parallel,
                                              train={"steps": steps}), world)


def torch_ddp(rank, world, steps=STEPS, **parallel):
    return {"items_per_s": torch_ddp_tokens_per_s(gpt_bench_config(Strategy.DDP), rank, world,
                                                  bucket_mb=parallel.get("bucket_mb", 25.0),
                                                  steps=steps - 2)}


def ddp_sized(rank, world, size="3m", steps=STEPS, **parallel):
    return ours_sized(Strategy.DDP, size, steps, world, **parallel)


def torch_ddp_sized(rank, world, size="3m", steps=STEPS, **parallel):
    cfg = sized_config(Strategy.DDP, size, steps)
    return {"items_per_s": torch_ddp_tokens_per_s(cfg, rank, world,
                                                  bucket_mb=parallel.get("bucket_mb", 25.0),
                                                  steps=steps - 2),
            "extra": {"parameters": parameters(cfg)}}


def one_process_two_threads(rank, world, **parallel):
    # world is 1 here: one process, both cores
    return {"items_per_s": plain_loop_tokens_per_s(gpt_bench_config(Strategy.SINGLE), rank, world,
                                                   steps=STEPS - 2)}


def one_process_two_threads_sized(rank, world, size="3m", steps=STEPS, **parallel):
    # world is 1 here: one process, both cores, the model of SIZES[size] at the same batch
    cfg = sized_config(Strategy.SINGLE, size, steps)
    return {"items_per_s": plain_loop_tokens_per_s(cfg, rank, world, steps=steps - 2),
            "extra": {"parameters": parameters(cfg)}}


def ddp_overlap_on(rank, world, **parallel):
    return ddp(rank, world, **{**parallel, "overlap": True})


def ddp_native(rank, world, **parallel):
    return ddp(rank, world, **{**parallel, "allreduce": "native"})


def dp_replicas(rank, world, **parallel):
    # one process driving 2 replicas with 2 threads on the 2 cores
    return ours_tokens_per_s(gpt_bench_config(Strategy.DP, parallel={"replicas": 2},
                                              train={"steps": STEPS}), world)


def _busbw(fn, group_size: int, nbytes: int, reps: int = 5) -> float:
    """Bus bandwidth 2(N-1)/N * K / t of one allreduce of K bytes (median of reps)."""
    import statistics
    t = torch.ones(nbytes // 4)
    fn(t)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    return 2 * (group_size - 1) / group_size * nbytes / statistics.median(times)


SIZES_MB = [1, 4, 16, 64]


def _sweep(world: int, kind: str, reps: int) -> dict:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ring import ring_all_reduce
    from shardwise.mesh import Mesh
    threads_for(world)
    mesh, comm = Mesh.build(1, world, 1), Comm()
    if kind == "ring":
        fn = lambda t: ring_all_reduce(comm, t, mesh.dp_group)
    elif kind == "shm":
        from shardwise.comm.shm import ShmCollectives
        fast = ShmCollectives(comm, mesh.dp_group)
        fn = lambda t: fast.all_reduce(t, "shm_all_reduce")
    else:
        fn = lambda t: comm.all_reduce(t, mesh.dp_group)
    table = {mb: _busbw(fn, world, mb * 2**20, reps) for mb in SIZES_MB}
    return {"items_per_s": table[16], "extra": {"busbw_bytes_per_s_by_mb": table}}


def ring_sweep(rank, world, reps=5):
    return _sweep(world, "ring", reps)


def shm_sweep(rank, world, reps=5):
    return _sweep(world, "shm", reps)


def gloo_sweep(rank, world, reps=5):
    return _sweep(world, "native", reps)


ROWS = [
    # the same row at world 1, 2 and 4 (series "ddp": the report's scaling chart); the global
    # batch stays 8 (strong scaling), on however many cores the machine has
    Row("ddp-vs-torch-ddp-w1", ddp, torch_ddp, world=1, args={"bucket_mb": 25.0},
        goal="ratio >= 1.0", peer_name="torch DistributedDataParallel", series=Strategy.DDP,
        quick_args={"steps": 6}),
    Row("ddp-vs-torch-ddp", ddp, torch_ddp, world=2, args={"bucket_mb": 25.0},
        goal="ratio >= 1.0", peer_name="torch DistributedDataParallel", series=Strategy.DDP,
        quick_args={"steps": 6}),
    Row("ddp-vs-torch-ddp-w4", ddp, torch_ddp, world=4, args={"bucket_mb": 25.0},
        goal="ratio >= 1.0", peer_name="torch DistributedDataParallel", series=Strategy.DDP,
        quick_args={"steps": 6}),
    # the scaling family by model size (series "size:ddp": the report's sizes chart), world 2
    *[Row(f"ddp-vs-torch-ddp-size-{size}", ddp_sized, torch_ddp_sized, world=2,
          args={"size": size, "steps": steps, "bucket_mb": 25.0}, series="size:ddp",
          goal="ratio >= 1.0; tokens/s and peak RSS against model size",
          peer_name="torch DistributedDataParallel")
      for size, steps in (("3m", 10), ("57m", 6), ("350m", 4))],
    Row("ddp-ring-vs-torch-ddp", ddp, torch_ddp, world=2, args={"bucket_mb": 25.0, "allreduce": "ring"},
        goal="ratio >= 1.0", peer_name="torch DistributedDataParallel"),
    Row("ddp-shm-vs-native", ddp, ddp_native, world=2, args={"bucket_mb": 25.0, "allreduce": "shm"},
        goal="effect of the shared-memory allreduce (ratio > 1 means it helps)",
        peer_name="shardwise DDP, gloo allreduce"),
    Row("ddp-overlap-off-vs-on", ddp, ddp_overlap_on, world=2, args={"bucket_mb": 1.0, "overlap": False},
        goal="effect of overlap (ratio < 1 means overlap helps)", peer_name="shardwise DDP, overlap on"),
    Row("ddp-vs-one-process", ddp, one_process_two_threads, world=2, peer_world=1,
        args={"bucket_mb": 25.0}, goal="ratio >= 0.98 (DDP world 2 against the 2-core limit)",
        peer_name="one process, 2 threads, plain loop"),
    # issue 35 item 3 at the 57M GPT: the physical limit of data parallelism on 2 cores
    Row("ddp-vs-one-process-57m", ddp_sized, one_process_two_threads_sized, world=2,
        peer_world=1, args={"size": "57m", "steps": 8, "bucket_mb": 25.0},
        quick_args={"steps": 6}, goal="ratio >= 0.98 (DDP world 2 against the 2-core limit)",
        peer_name="one process, 2 threads, plain loop"),
    Row("dp-vs-ddp", dp_replicas, ddp, world=1, peer_world=2, args={"bucket_mb": 25.0},
        goal="single-process DP below DDP (GIL, reduction on replica 0)",
        peer_name="shardwise DDP, 2 processes"),
    Row("ring-busbw-w2", ring_sweep, gloo_sweep, world=2, args={}, quick_args={"reps": 3},
        goal="ring >= 0.9x gloo at 16 MB and above", peer_name="gloo all_reduce"),
    Row("shm-busbw-w2", shm_sweep, gloo_sweep, world=2, args={}, quick_args={"reps": 3},
        goal="shared memory >= 1.0x gloo at 16 MB", peer_name="gloo all_reduce"),
    Row("ring-busbw-w4", ring_sweep, gloo_sweep, world=4, args={},
        goal="ring >= 0.9x gloo at 16 MB and above", peer_name="gloo all_reduce"),
]
