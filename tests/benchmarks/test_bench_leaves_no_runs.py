"""A benchmark keeps its result JSON, not the runs it timed: each side's run folder (final
weights, 228 MB at 57M) is removed once its figures are read (bench/harness.discard_run);
before, /tmp/shardwise-bench-runs grew to 72 GB over the benchmarks of a few days and filled
the disk. ``train()``'s summary names its folder (``run_dir``)."""
import os

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
