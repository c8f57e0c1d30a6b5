"""A benchmark keeps its result JSON, not the runs it timed: each side's run folder (final
weights, 228 MB at 57M) is removed once its figures are read (bench/harness.discard_run);
before, /tmp/shardwise-bench-runs grew to 72 GB over the benchmarks of a few days and filled
the disk. ``train()``'s summary names its folder (``run_dir``)."""
import os

import pytest

pytestmark = pytest.mark.timeout(180)

from shardwise.bench.harness import gpt_bench_config
from shardwise.bench.peers import ours_tokens_per_s
from shardwise.config.names import Strategy
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train


def test_a_bench_side_leaves_no_run_folder_and_train_names_its_folder(tmp_path):
    cfg = gpt_bench_config(Strategy.SINGLE, train={"steps": 3}, logging={"out_dir": str(tmp_path)})
    summary = train(cfg, init_runtime(cfg), quiet=True)
    summary["engine"].close()
    assert os.path.dirname(summary["run_dir"]) == str(tmp_path)
    assert {"final.safetensors", "summary.json"} <= set(os.listdir(summary["run_dir"]))
    before = set(os.listdir(tmp_path))
    out = ours_tokens_per_s(cfg, 1)
    assert out["items_per_s"] > 0
    assert set(os.listdir(tmp_path)) == before       # its own folder is gone


def _zero3_side(rank, world, out_dir):
    cfg = gpt_bench_config(Strategy.ZERO3, train={"steps": 3}, logging={"out_dir": out_dir})
    return ours_tokens_per_s(cfg, world)["items_per_s"]


def test_a_two_rank_side_removes_its_shared_folder_after_every_rank_is_done(tmp_path):
    """The ranks share the folder and rank 0 writes the final weights last: a rank that
    finished first must not remove it under rank 0 (it did, once: every row failed)."""
    from harness import run_world
    assert all(r > 0 for r in run_world(_zero3_side, 2, str(tmp_path), timeout=120))
    assert os.listdir(tmp_path) == []
