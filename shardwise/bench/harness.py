"""The benchmark contract: a Row pairs a shardwise configuration with its PyTorch peer.

A side is a function ``fn(rank, world_size, **args) -> dict`` run in a fresh forked gloo world
of ``world`` processes (shardwise.launch.world.run_world). It returns rank-local figures; the runner
keeps rank 0's dict and adds ``peak_rss_per_rank`` (each process's peak resident memory). Keys the
runner understands (all optional but ``items_per_s``):

    items_per_s     tokens/s (or samples/s) of the whole world, steady state (median step)
    peak_mem        bytes: the side's own peak-memory figure per rank (e.g. CUDA or ledger)
    bytes_sent      bytes sent per step by rank 0 (shardwise's comm meter; for peers, estimate)
    extra           anything else worth recording (a dict)

The runner alternates the two sides (ours, peer, ours, peer, ...) ``reps`` times, so drift in the
machine's speed hits both equally, and reports medians and ratios ours / peer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from shardwise.config.names import Strategy

RESULTS = os.path.join(os.path.dirname(__file__), "results")     # the committed, cited results


@dataclass(frozen=True)
class Row:
    name: str
    ours: Callable
    peer: Callable | None
    world: int = 1
    args: dict = field(default_factory=dict)
    goal: str = ""        # what the issue asks, in words, e.g. "ratio >= 0.98"
    peer_name: str = ""   # what the peer is, e.g. "plain PyTorch loop"
    peer_world: int | None = None   # the peer's world size when it differs (e.g. 1 process)
    series: str = ""      # rows sharing a series differ only in world size (the scaling chart)
    quick_args: dict = field(default_factory=dict)  # merged over args by --quick (fewer steps)
    # the peer's CPU heap: "auto" = what our side's train.cpu_allocator auto sets (the rows
    # compare strategies, as both sides step the same optimizer); "system" = glibc as it is
    # (the product row: torch's defaults)
    peer_allocator: str = "auto"


def peak_rss() -> int:
    """This process's peak resident memory, bytes (the CPU figure of shardwise.run.metrics)."""
    from shardwise.run.metrics import peak_memory_bytes
    return peak_memory_bytes(torch.device("cpu"))


def discard_run(summary: dict, rt) -> None:
    """After its figures are read, on every rank of the run's world: close the engine and
    remove the run's folder (its final weights are 228 MB at 57M; a benchmark keeps its result
    JSON, not a model per side and repetition). The ranks share the folder and rank 0 writes
    into it last, so it goes once every rank is done (a barrier)."""
    import shutil
    summary["engine"].close()
    rt.comm.barrier(rt.mesh.world)
    if rt.is_main:
        shutil.rmtree(summary["run_dir"], ignore_errors=True)


def timed_steps(step_fn: Callable[[], None], steps: int, warmup: int = 2) -> float:
    """Median seconds per call of ``step_fn`` after ``warmup`` untimed calls."""
    import statistics
    import time
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpt_bench_config(strategy: str = Strategy.SINGLE, **overrides):
    """The benchmark GPT of DESIGN.md: 4 layers, width 256, seq 128, byte vocab (3.3M params)."""
    from dataclasses import replace
    from shardwise.config import (Config, DataConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, TrainConfig)
    cfg = Config(model=ModelConfig(n_layer=4, n_embd=256, n_head=4, block_size=128, vocab_size=256),
                 data=DataConfig(dataset="synthetic"), parallel=ParallelConfig(strategy=strategy),
                 train=TrainConfig(steps=12, batch_size=8, lr=1e-3, eval_every=0, eval_batches=1,
                                   warmup_steps=1, device="cpu"),
                 logging=LoggingConfig(progress=False, out_dir="/tmp/shardwise-bench-runs"))
    for section, values in overrides.items():
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **values)})
    return cfg


# the model sizes of the scaling family (issue 35 item 7): the benchmark GPT, the memory rows'
# 57M GPT and a 350M one (GPT-2 medium's width at 28 layers), batches shrinking with size so a
# step stays seconds on a 2-core CPU
SIZES = {"3m": {},
         "57m": {"model": {"n_layer": 8, "n_embd": 768, "n_head": 12}, "train": {"batch_size": 4}},
         "350m": {"model": {"n_layer": 28, "n_embd": 1024, "n_head": 16},
                  "train": {"batch_size": 2}}}


def sized_config(strategy: str, size: str, steps: int, **parallel):
    """gpt_bench_config at one of :data:`SIZES`, ``steps`` steps."""
    over = SIZES[size]
    return gpt_bench_config(strategy, parallel=parallel, model=over.get("model", {}),
                            train={**over.get("train", {}), "steps": steps})


def parameters(cfg) -> int:
    """The parameter count of cfg's model (built on the meta device: no memory)."""
    from shardwise.models import build_model
    return sum(p.numel() for p in build_model(cfg.model, 0, init="meta").parameters())


def threads_for(world: int) -> None:
    """Share this machine's cores between the ranks of a world."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def script_parser(prog: str, doc: str):
    """The argument parser of a ``python -m shardwise.bench.<script>`` measurement: its first
    paragraph as the description, ``--size`` over :data:`SIZES` (default 57m) and ``--save``."""
    import argparse
    ap = argparse.ArgumentParser(prog=f"python -m shardwise.bench.{prog}",
                                 description=doc.split("\n\n")[0])
    ap.add_argument("--size", default="57m", choices=sorted(SIZES),
                    help="the scaling family's model (bench/harness.py SIZES)")
    ap.add_argument("--save", action="store_true", help="write into shardwise/bench/results/")
    return ap


def result_path(name: str, save: bool) -> str:
    """Where a script writes ``name``: the committed shardwise/bench/results/ with ``--save``,
    else ``$TMPDIR`` (default /tmp), so a casual run never overwrites the cited figures."""
    return os.path.join(RESULTS if save else os.environ.get("TMPDIR", "/tmp"), name)
