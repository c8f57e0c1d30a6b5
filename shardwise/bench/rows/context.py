"""Context-parallel rows: shardwise's --cp at a long sequence, ring attention against Ulysses,
and ring attention against one process training the whole sequence (where the memory shows:
each cp rank holds the activations of S/cp positions). The benchmark GPT
(shardwise.bench.harness.gpt_bench_config) at sequence LONG, batch 1. torch's own
``context_parallel`` is not a peer here: it needs the CUDA flash / efficient attention kernels
(pytorch/pytorch#147793), and these rows run on CPU."""
from __future__ import annotations

from shardwise.config.names import Strategy
from shardwise.bench.harness import Row, gpt_bench_config
from shardwise.bench.peers import ours_tokens_per_s

LONG = 4096       # positions per sequence (batch 1): activations outweigh import torch
STEPS = 6


def _cfg(strategy: str, seq: int, **parallel):
    return gpt_bench_config(strategy, model={"block_size": seq},
                            train={"steps": STEPS, "batch_size": 1}, parallel=parallel,
                            logging={"schedule_png": "off"})


def ours_ring(rank, world, seq=LONG):
    return ours_tokens_per_s(_cfg(Strategy.DDP, seq, cp=world, cp_impl="ring"), world)


def ours_ulysses(rank, world, seq=LONG):
    return ours_tokens_per_s(_cfg(Strategy.DDP, seq, cp=world, cp_impl="ulysses"), world)


def one_process(rank, world, seq=LONG):
    # world is 1 here: one process, both cores, the whole sequence
    return ours_tokens_per_s(_cfg(Strategy.SINGLE, seq), 1)


ROWS = [
    Row("cp-ring-vs-ulysses-long", ours_ring, ours_ulysses, world=2, args={"seq": LONG},
        goal="which implementation is faster here (2 ranks on 2 cores)",
        peer_name=f"shardwise --cp 2 --cp-impl ulysses, sequence {LONG}, batch 1"),
    Row("cp-ring-vs-one-process-long", ours_ring, one_process, world=2, peer_world=1,
        args={"seq": LONG}, goal="RSS ratio < 1.0 (each rank holds S/cp positions' activations)",
        peer_name=f"one process (single), 2 threads, sequence {LONG}, batch 1"),
]
