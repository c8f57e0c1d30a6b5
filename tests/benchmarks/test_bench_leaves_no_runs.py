"""A benchmark keeps its result JSON, not the runs it timed: each side's run folder (final
weights, 228 MB at 57M) is removed once its figures are read (bench/harness.discard_run);
before, /tmp/shardwise-bench-runs grew to 72 GB over the benchmarks of a few days and filled
the disk. ``train()``'s summary names its folder (``run_dir``).

Every side runs in a forked world, never in this process: a bench side of world 1 uses both
cores (``threads_for``), and OpenMP's thread pool, once started here, hangs the next forked
world that runs two threads (GNU OpenMP is not fork-safe; it did, in CI)."""
import os

import pytest

from harness import run_world
from shardwise.bench.harness import gpt_bench_config
from shardwise.bench.peers import ours_tokens_per_s
from shardwise.config.names import Strategy

pytestmark = pytest.mark.timeout(180)


def _sides(rank, world, out_dir, strategy):
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    cfg = gpt_bench_config(strategy, train={"steps": 3}, logging={"out_dir": out_dir})
    named = None
    if world == 1:                  # train() itself: its summary names the folder it kept
        summary = train(cfg, init_runtime(cfg), quiet=True)
        summary["engine"].close()
        named = (summary["run_dir"], sorted(os.listdir(summary["run_dir"])))
    before = sorted(os.listdir(out_dir))
    rate = ours_tokens_per_s(cfg, world)["items_per_s"]
    return named, before, rate


def test_a_bench_side_leaves_no_run_folder_and_train_names_its_folder(tmp_path):
    (named, before, rate), = run_world(_sides, 1, str(tmp_path), Strategy.SINGLE, timeout=120)
    assert os.path.dirname(named[0]) == str(tmp_path)
    assert {"final.safetensors", "summary.json"} <= set(named[1])
    assert rate > 0 and sorted(os.listdir(tmp_path)) == before    # its own folder is gone


def test_a_two_rank_side_removes_its_shared_folder_after_every_rank_is_done(tmp_path):
    """The ranks share the folder and rank 0 writes the final weights last: a rank that
    finished first must not remove it under rank 0 (it did, once: every row failed)."""
    ranks = run_world(_sides, 2, str(tmp_path), Strategy.ZERO3, timeout=120)
    assert all(rate > 0 for _, _, rate in ranks)
    assert os.listdir(tmp_path) == []
