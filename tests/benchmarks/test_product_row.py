"""The product row (single-defaults-vs-torch-defaults): its peer, a plain loop with torch's
AdamW defaults, reports the optimizer step's share of its step, which the row's goal reads
(ours >= 1 + that share), the fused step's own time on the same model, and the ceiling that
swapping the one for the other can reach. One short run of the peer in a forked world of one (a bench side sets
torch's thread count for its world: it must not leak into this test process)."""
import pytest
from hypothesis import given, strategies as st

from harness import run_world
from shardwise.bench.peers import step_ceiling

pytestmark = pytest.mark.timeout(120)


def _peer(rank, world):
    from shardwise.bench.rows.foundation import peer_torch_defaults
    return peer_torch_defaults(rank, world, steps=5)


def test_the_peer_reports_its_optimizer_share():
    out = run_world(_peer, 1, timeout=100)[0]
    extra = out["extra"]
    assert out["items_per_s"] > 0
    assert 0 < extra["optimizer_step_s"] < extra["step_s"]
    assert extra["optimizer_share"] == pytest.approx(extra["optimizer_step_s"] / extra["step_s"])
    assert 0 < extra["ours_optimizer_step_s"]
    assert extra == {**extra, **step_ceiling(extra["step_s"], extra["optimizer_step_s"],
                                             extra["ours_optimizer_step_s"])}


@given(step=st.floats(0.01, 10), share=st.floats(0.01, 0.9), frac=st.floats(0, 1))
def test_the_ceiling_meets_the_goal_exactly_at_the_limit(step, share, frac):
    optimizer = step * share
    limit = step_ceiling(step, optimizer, 0.0)["replacement_limit_s"]
    at = step_ceiling(step, optimizer, limit)
    assert at["ceiling"] == pytest.approx(at["goal"], rel=1e-9)
    assert at["goal"] == pytest.approx(1 + share)
    faster = step_ceiling(step, optimizer, limit * frac)          # a quicker replacement
    assert faster["ceiling"] >= at["goal"] * (1 - 1e-9)
    slower = step_ceiling(step, optimizer, limit + optimizer * 0.01)
    assert slower["ceiling"] < slower["goal"]
    # no replacement at all (an optimizer that costs nothing) beats the goal by share^2 / (1 - share)
    free = step_ceiling(step, optimizer, 0.0)["ceiling"]
    assert free == pytest.approx(1 / (1 - share))

