"""The benchmark report regenerates from a results folder: table figures from the JSON, charts
as real PNG files, and a clear refusal when there is nothing to report."""
from __future__ import annotations

import json

import pytest

from shardwise.bench.report import load, write_report


def _row(name, ours_runs, peer_runs, rss_ours, rss_peer):
    import statistics
    ours, peer = statistics.median(ours_runs), statistics.median(peer_runs) if peer_runs else None
    out = {"row": name, "world": 2, "reps": len(ours_runs), "goal": "ratio >= 1.0",
           "machine": {"date": "2026-12-01 09:00:00", "cpus": 2, "commit": "abc1234"},
           "ours": {"items_per_s": ours, "peak_rss_max_rank": rss_ours,
                    "extra": {"ledger": {"parameters": 2**20, "gradients": 2**20}}},
           "runs": {"ours": ours_runs, "peer": peer_runs}}
    if peer is not None:
        out["peer_result"] = {"items_per_s": peer, "peak_rss_max_rank": rss_peer}
        out["throughput_ratio"] = ours / peer
        out["peak_rss_ratio"] = rss_ours / rss_peer
    return out


def test_report_from_a_small_results_folder(tmp_path):
    rows = [_row("a-vs-torch", [900.0, 1000.0, 1100.0], [950.0, 1250.0, 1300.0], 300 * 2**20, 400 * 2**20),
            _row("b-alone", [50.0, 70.0], [], 100 * 2**20, None)]
    for r in rows:
        (tmp_path / f"{r['row']}.json").write_text(json.dumps(r))
    (tmp_path / "notes.json").write_text(json.dumps({"not": "a row"}))   # ignored
    assert [r["row"] for r in load(str(tmp_path))] == ["a-vs-torch", "b-alone"]
    path = write_report(str(tmp_path), str(tmp_path / "out"))
    text = open(path).read()
    ratio = rows[0]["throughput_ratio"]
    line = next(l for l in text.splitlines() if l.startswith("| a-vs-torch"))
    assert f"{ratio:.3f}" in line and "900-1,100" in line and "950-1,300" in line
    assert f"{rows[0]['peak_rss_ratio']:.3f}" in line and "300 MiB" in line
    assert "commit: abc1234" in text
    for png in ("throughput.png", "memory.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text


def test_no_results_is_a_clear_refusal(tmp_path):
    with pytest.raises(SystemExit, match="no benchmark results"):
        write_report(str(tmp_path))
