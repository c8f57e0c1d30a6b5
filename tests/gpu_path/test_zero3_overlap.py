"""ZeRO-3's backward reduce-scatter (issue 31): blocking on CPU, asynchronous on CUDA, where a
blocking NCCL call makes the compute stream wait for it after every unit.

The decision (``reduce_scatter_async``) is unit-tested for both devices; the asynchronous path
is then forced onto a gloo world of two (the path a CUDA run takes) and must train exactly as
the blocking one does, and equal single-process training within the usual fp32 tolerance.

Tolerance: the blocking and asynchronous runs reduce the same buffers with the same collective,
so they must agree bitwise. Against `single`, tests/reference.py's RTOL / ATOL (1e-5): the
reduce-scatter sums the ranks' gradients in another order than one process's backward.
"""
from dataclasses import replace

import pytest
import torch

from harness import assert_close_runs, run_world
from reference import ATOL, RTOL, single_run, tiny_config
from shardwise.config import MemoryConfig
from shardwise.parallel.data import zero_stage3
from shardwise.parallel.data.zero_stage3 import reduce_scatter_async
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(300)
WHY = "fp32 reduce-scatter sums in another order than one process's backward"


def test_the_reduce_scatter_is_asynchronous_on_cuda_only():
    assert reduce_scatter_async(True, "cuda")
    assert reduce_scatter_async(True, torch.device("cuda", 0))
    assert not reduce_scatter_async(True, "cpu")
    assert not reduce_scatter_async(True, torch.device("cpu"))
    # overlap off: every collective blocks, on any device
    assert not reduce_scatter_async(False, "cuda")


def _cfg(steps=6, accum=1):
    """tiny_config at width 27 / 3 heads: odd sizes, so every unit's shard is padded at N=2."""
    cfg = tiny_config("zero3", steps=steps)
    # seed 1, as tests/parallel/test_zero.py: seed 0's per-module init gives
    # blocks.0.ln_2.bias[0] a first gradient of ~1e-9 (the ranks' halves cancel), where Adam's
    # slope at |g| ~ eps turns the reduce-scatter's last-bit reordering into 2e-5
    cfg = replace(cfg, train=replace(cfg.train, seed=1))
    return replace(cfg, model=replace(cfg.model, n_embd=27, n_head=3),
                   memory=MemoryConfig(grad_accum=accum))


def _train(rank, n, force_async):
    """Train both configs; report losses, parameters and the async_op of every reduce-scatter
    that ZeRO-3's backward launched (more than one in flight proves the overlap is real)."""
    if force_async:     # what a CUDA device decides, on this gloo world
        zero_stage3.reduce_scatter_async = lambda overlap, device: overlap
    launched, peak = [], [0]
    real = zero_stage3.Zero3Strategy._reduce_staged

    def spy(self, c, async_op=None):
        launched.append(async_op)
        real(self, c, async_op)
        peak[0] = max(peak[0], len(self._reducing))
    zero_stage3.Zero3Strategy._reduce_staged = spy
    out = {}
    for tag, cfg in (("plain", _cfg()), ("accum", _cfg(accum=2))):
        launched.clear()
        peak[0] = 0
        s = train(cfg, init_runtime(cfg), quiet=True)
        params = s["engine"].full_state_dict()
        out[tag] = dict(losses=s["losses"], params=params if rank == 0 else None,
                        launched=set(launched), peak=peak[0])
    return out


@pytest.fixture(scope="module")
def runs():
    return {"blocking": run_world(_train, 2, False)[0], "async": run_world(_train, 2, True)[0]}


@pytest.mark.parametrize("tag", ["plain", "accum"])
def test_async_reduce_scatter_trains_exactly_as_blocking_and_equals_single(runs, tag):
    blocking, overlapped = runs["blocking"][tag], runs["async"][tag]
    assert blocking["launched"] == {False} and blocking["peak"] == 0
    # asynchronous: launched as such, and a second one was launched before the first was waited
    assert overlapped["launched"] == {True} and overlapped["peak"] >= 2
    assert overlapped["losses"] == blocking["losses"]
    for name, value in blocking["params"].items():
        assert torch.equal(overlapped["params"][name], value), name
    cfg = _cfg(accum=2 if tag == "accum" else 1)
    ref_losses, ref_params = single_run(cfg)
    assert_close_runs(overlapped["losses"], ref_losses, overlapped["params"], ref_params,
                      RTOL, ATOL, WHY)
