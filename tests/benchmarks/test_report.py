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


def _folder_with_every_chart(tmp_path):
    """Rows that carry each chart's figures: a ddp series at worlds 1 / 2 / 4 with metered
    traffic, a ring row with bus bandwidths, ps rows with loss curves, a planner validation."""
    rows = []
    for world, ours, peer in ((1, [100.0, 110.0], [105.0, 115.0]), (2, [180.0, 190.0], [170.0, 200.0]),
                              (4, [300.0, 320.0], [280.0, 310.0])):
        r = _row(f"ddp-w{world}", ours, peer, 300 * 2**20, 310 * 2**20)
        r.update(world=world, series="ddp")
        r["ours"]["bytes_sent"] = 12 * 2**20
        rows.append(r)
    ring = _row("ring-busbw-w2", [1.0e9, 1.1e9], [1.2e9, 1.3e9], 200 * 2**20, 200 * 2**20)
    ring["ours"]["extra"] = {"busbw_bytes_per_s_by_mb": {"1": 4e8, "16": 1.4e9}}
    ring["peer_result"]["extra"] = {"busbw_bytes_per_s_by_mb": {"1": 7e8, "16": 1.2e9}}
    rows.append(ring)
    for mode in ("sync", "async"):
        ps = _row(f"ps-{mode}", [3000.0, 3100.0], [], 250 * 2**20, None)
        ps["ours"]["extra"] = {"losses": [5.5, 4.0, 3.2]}
        rows.append(ps)
    for n, size in enumerate((3e6, 5.7e7)):      # the sizes chart: one series at two sizes
        sized = _row(f"zero3-size-{n}", [900.0 / (n + 1)] * 2, [800.0 / (n + 1)] * 2,
                     (300 + 500 * n) * 2**20, (310 + 500 * n) * 2**20)
        sized["series"] = "size:zero3"
        sized["ours"]["extra"] = {"parameters": int(size)}
        rows.append(sized)
    for r in rows:
        (tmp_path / f"{r['row']}.json").write_text(json.dumps(r))
    planner = {"rows": [{"strategy": "ddp", "world": 2, "step_predicted_s": 0.11,
                         "step_measured_s": 0.12, "states_predicted": 5.3e7, "states_measured": 5.2e7}]}
    (tmp_path / "planner_validation.json").write_text(json.dumps(planner))
    return rows


def test_every_chart_is_drawn_from_the_json_and_named_in_the_report(tmp_path):
    rows = _folder_with_every_chart(tmp_path)
    text = open(write_report(str(tmp_path))).read()
    for png in ("throughput", "memory", "traffic", "scaling", "sizes", "busbw", "ps", "planner"):
        assert (tmp_path / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png}.png)" in text
    assert "Not drawn" not in text
    ddp4 = next(l for l in text.splitlines() if l.startswith("| ddp-w4"))
    assert f"{rows[2]['throughput_ratio']:.3f}" in ddp4 and "300-320" in ddp4


def test_a_chart_without_figures_is_named_not_drawn(tmp_path):
    r = _row("a-vs-torch", [900.0, 1000.0], [950.0, 1250.0], 300 * 2**20, 400 * 2**20)
    (tmp_path / "a-vs-torch.json").write_text(json.dumps(r))
    text = open(write_report(str(tmp_path))).read()
    assert "Not drawn" in text and "scaling" in text.split("Not drawn")[1]
    assert not (tmp_path / "scaling.png").exists() and not (tmp_path / "planner.png").exists()


def test_gpu_results_alone_make_a_report(tmp_path):
    """gpu.json of shardwise/bench/gpu.py: every run with its figures, errors and skips in
    their rows, then shardwise / PyTorch per case computed from the rows."""
    from shardwise.bench.gpu import ratios
    run = {"case": "compiled", "size": "350m", "strategy": "single", "compiled": True, "rep": 0,
           "step_seconds": 0.1, "step_min": 0.09, "step_max": 0.12, "peak_memory": 20 * 2**30}
    cases = [{**run, "impl": "pytorch (loop)", "tokens_per_s": 200000.0, "mfu": 0.55},
             {**run, "impl": "shardwise", "tokens_per_s": 150000.0, "mfu": 0.5,
              "ledger_device_bytes": 18 * 2**30, "ledger_gap": -0.1},
             {"case": "zero1-offload", "size": "350m", "impl": "shardwise", "rep": 0,
              "error": "RuntimeError: out of memory"},
             {"case": "ddp-nccl", "size": "350m", "impl": "peer", "rep": 0,
              "skipped": "--budget-s spent"}]
    gpu = {"machine": {"date": "2026-12-01", "commit": "abc1234", "gpu": "NVIDIA H200",
                       "driver": "580"}, "goal": "MFU >= 45%", "cases": cases,
           "ratios": ratios(cases)}
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    text = open(write_report(str(tmp_path))).read()
    assert "| 350m | compiled | shardwise #0 | 150,000 | 0.100 (0.090-0.120) | 50.0% |" in text
    assert "| 18,432 MiB | -10.0% |" in text or "-10.0%" in text
    assert "RuntimeError: out of memory" in text and "--budget-s spent" in text
    assert "| 350m | compiled | 150,000 | 200,000 | 0.750 | 1 + 1 |" in text
    assert "NVIDIA H200, driver 580" in text and "abc1234" in text


def test_row_selection_quick_set_and_refusals(capsys):
    """--rows globs over names and families; --quick's rows all exist and cover every family;
    a pattern that matches nothing is refused in one line (exit 2) before anything runs."""
    from shardwise.bench.run import QUICK, all_rows, main, select
    rows = all_rows()
    assert set(QUICK) <= set(rows)
    assert {rows[n][0] for n in QUICK} == {fam for fam, _ in rows.values()}
    chosen, unmatched = select(rows, ["zero3-*", "ps"])
    names = {r.name for r in chosen}
    assert "zero3-vs-fsdp2" in names and "ps-sync-straggler3x" in names and not unmatched
    assert "zero1-vs-torch-zero" not in names
    assert main(["--rows", "nope-*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope-*" in err and "fix:" in err
    assert main(["--reps", "0"]) == 2
    assert main(["--save", "--out", "/tmp/x"]) == 2


def _raises(rank, world, **_):
    raise ValueError("parallel.num_microbatches = 1: a row that cannot run")


def _fine(rank, world, **_):
    return {"items_per_s": 10.0}


@pytest.mark.timeout(120)
def test_a_failing_row_is_one_line_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    """A row whose ranks fail: one line naming it and the error, no traceback; the next row
    still runs and is reported; the exit code says a row failed (1)."""
    from shardwise.bench import run
    from shardwise.bench.harness import Row
    rows = {"broken": ("demo", Row("broken", _raises, None, world=1)),
            "fine": ("demo", Row("fine", _fine, None, world=1))}
    monkeypatch.setattr(run, "all_rows", lambda: rows)
    assert run.main(["broken", "fine", "--reps", "1", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "broken: failed, no result written: ValueError: parallel.num_microbatches = 1" in err
    assert "Traceback" not in out + err
    assert "error: 1 row(s) failed: broken" in err
    assert (tmp_path / "fine.json").exists() and not (tmp_path / "broken.json").exists()
    assert "fine: ours 10/s" in out
