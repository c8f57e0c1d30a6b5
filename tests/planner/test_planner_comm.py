"""Communication model: ring traffic 2(N-1)/N K, and which link a group runs on."""
import pytest

from shardwise.planner import Batch, Hardware, Layout
from shardwise.planner.comm import (all_gather_time, allreduce_time, dp_traffic,
                                    reduce_scatter_time, ring_allreduce_bytes)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 1024])
def test_ring_allreduce_traffic(n):
    k = 1e9
    assert ring_allreduce_bytes(k, n) == pytest.approx(2 * (n - 1) / n * k)
    bw, alpha = 100e9, 1e-6
    expected = 0 if n == 1 else 2 * (n - 1) / n * k / bw + 2 * (n - 1) * alpha
    assert allreduce_time(k, n, bw, alpha) == pytest.approx(expected)
    # An allreduce is a reduce-scatter followed by an all-gather.
    assert allreduce_time(k, n, bw, alpha) == pytest.approx(
        reduce_scatter_time(k, n, bw, alpha) + all_gather_time(k, n, bw, alpha))


def test_zero_volumes_relative_to_ddp():
    """ZeRO-1/2 move what one allreduce moves; ZeRO-3 1.5x (ZeRO paper, section 7)."""
    hw = Hardware.custom(nodes=1, devices_per_node=8, memory_bytes=2**40, peak_flops=1e12,
                         intra_bw=100e9, intra_latency=0.0)
    p = 1e9
    ddp = dp_traffic(Layout(dp=8), p, hw, Batch(8)).last_backward
    z1 = dp_traffic(Layout(dp=8, zero=1), p, hw, Batch(8))
    z3 = dp_traffic(Layout(dp=8, zero=3), p, hw, Batch(8))
    assert z1.last_backward + z1.after_step == pytest.approx(ddp)
    assert z3.per_microbatch_rs + z3.per_microbatch_ag == pytest.approx(1.5 * ddp)


def test_links_inside_and_across_nodes():
    hw = Hardware.from_catalogue("a100-80gb", nodes=4, devices_per_node=8, network="8x200gbps")
    assert hw.link(8, 1) == (hw.intra_bw, hw.intra_latency)          # tp group in a node
    assert hw.link(1, 1)[1] == 0                                       # no group, no cost
    bw, alpha = hw.link(4, 8)                                          # dp across nodes, tp=8
    assert bw == pytest.approx(hw.inter_bw / 8) and alpha == hw.inter_latency
    bw_full, _ = hw.link(32, 1)                                        # all 8 per node in one ring
    assert bw_full == pytest.approx(min(hw.intra_bw, hw.inter_bw))
