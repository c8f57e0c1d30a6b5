"""The product row (single-defaults-vs-torch-defaults): its peer, a plain loop with torch's
AdamW defaults, reports the optimizer step's share of its step, which the row's goal reads
(ours >= 1 + that share). One short run of the peer in a forked world of one (a bench side sets
torch's thread count for its world: it must not leak into this test process)."""
import pytest

from harness import run_world

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
