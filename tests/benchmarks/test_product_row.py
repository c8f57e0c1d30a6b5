"""The product row (single-defaults-vs-torch-defaults): its peer, a plain loop with torch's
AdamW defaults, reports the optimizer step's share of its step, which the row's goal reads
(ours >= 1 + that share). One short run of the peer in this process."""
import pytest

from shardwise.bench.rows.foundation import peer_torch_defaults

pytestmark = pytest.mark.timeout(120)


def test_the_peer_reports_its_optimizer_share():
    out = peer_torch_defaults(0, 1, steps=5)
    extra = out["extra"]
    assert out["items_per_s"] > 0
    assert 0 < extra["optimizer_step_s"] < extra["step_s"]
    assert extra["optimizer_share"] == pytest.approx(extra["optimizer_step_s"] / extra["step_s"])
