"""The held-out validation's code path end to end on a tiny model (shardwise/bench/
validate_planner_heldout.py): two rounds of three strategies, calibrations replaced by a fixed
one (a real calibration forks worlds for seconds; its figures only move the step prediction),
and the JSON carries every field docs/planner.md's generated block and inline values read."""
import itertools
import json
import os

import pytest

from shardwise.bench import validate_planner, validate_planner_heldout as vh
from shardwise.launch import auto as autoplan

TINY = {"tiny": ({"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32},
                 {"batch_size": 4})}


def _taking(rates):
    """A ``Calibrations._take`` that measures nothing: each calibration's GPT and matmul rate
    is the next of ``rates`` (FLOP/s per rank)."""
    def take(self, cfg, world):
        rate = next(rates)
        rank = autoplan.Compute(1, rate, rate, 1e-3, 5e9)
        cal = autoplan.Calibration("cpu", world, rank, rank, 1e9 if world > 1 else 0.0, 2e-4,
                                   16 * 2**30, 0.0, 2e-3, 2e9 if world > 1 else 0.0)
        self.taken.setdefault(world, []).append(cal)
        return cal
    return take


def _held_out(monkeypatch, tmp_path, runs: int, only: str, rates=None) -> dict:
    """``validate_planner --held-out --save`` on TINY into ``tmp_path``, calibrations at
    ``rates`` (default: one fixed rate); its JSON."""
    monkeypatch.setattr(vh, "MODELS", TINY)
    monkeypatch.setattr(validate_planner.Calibrations, "_take",
                        _taking(iter(rates or itertools.repeat(2e10))))
    monkeypatch.setattr(validate_planner, "RESULTS", str(tmp_path))      # --save writes here
    argv = ["--held-out", "--runs", str(runs), "--steps", "3", "--only", only, "--save"]
    assert validate_planner.main(argv) == 0
    return json.load(open(os.path.join(tmp_path, "planner_heldout.json")))


@pytest.mark.timeout(120)
def test_held_out_runs_end_to_end_and_writes_what_the_docs_read(monkeypatch, tmp_path):
    doc = _held_out(monkeypatch, tmp_path, 2, "single,ddp,zero2")
    assert {"rows", "summary", "runs", "steps", "seconds", "load", "cpus", "machine",
            "calibration_spread"} <= set(doc)
    assert {"commit", "dirty", "date"} <= set(doc["machine"])
    # every run between two calibrations of its own world, a round taking single (world 1:
    # before, after), ddp (world 2: before, after) and zero2 (its before is ddp's after)
    assert doc["per_run"] and {w: len(c) for w, c in doc["calibration_spread"].items()} == \
        {"1": 4, "2": 6}, doc["calibration_spread"]
    assert doc["summary"]["cases"] == 3 and doc["summary"]["completed"] == 3, doc["summary"]
    for row in doc["rows"]:
        assert len(row["runs"]) == 2 and len(row["step_gaps"]) == 2
        for run in row["runs"]:
            assert set(vh.CATEGORIES) <= set(run["memory_gap"])
            # the planner's memory model is exact for these layouts (calibration-free)
            assert run["memory_ok"], (row["strategy"], run["memory_gap"])
    table = open(os.path.join(tmp_path, "planner_heldout.md")).read()
    assert table == vh.markdown(doc) and table.count("| tiny |") == 3


@pytest.mark.timeout(120)
def test_a_third_calibration_where_two_disagree(monkeypatch, tmp_path):
    """World 2's calibrations alternate between two rates 50% apart: every run then takes a
    third after the two around it and is predicted from the median of the three."""
    doc = _held_out(monkeypatch, tmp_path, 2, "ddp", rates=[2e10, 1e10] * 10)
    # round 1: 2e10 before, 1e10 after (disagree), 2e10 third; round 2: that third is the
    # before, 1e10 after, 2e10 third
    assert doc["calibration_spread"]["2"] == [2e10, 1e10, 2e10, 1e10, 2e10]
    (row,) = doc["rows"]
    assert [r["calibrations"] for r in row["runs"]] == [3, 3]
    assert "three where two differ by more than 20%: 2 of 2 runs" in vh.markdown(doc)


@pytest.mark.timeout(120)
def test_a_failed_run_is_recorded_and_the_next_takes_its_own_calibration(monkeypatch, tmp_path):
    """zero1 fails to start between ddp and zero2 (all world 2): its row says why, and zero2
    does not take ddp's after (from before zero1's attempt) as its own before, but a fresh
    one."""
    real = vh._run_fn

    def run_fn(model, name, steps):
        if name == "zero1":
            raise RuntimeError("boom\nzero1 could not start")
        return real(model, name, steps)
    monkeypatch.setattr(vh, "_run_fn", run_fn)
    doc = _held_out(monkeypatch, tmp_path, 1, "ddp,zero1,zero2")
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert rows["zero1"]["error"] == "RuntimeError: zero1 could not start"
    assert not rows["zero1"]["runs"] and len(rows["zero2"]["runs"]) == 1
    # ddp's before and after, then zero2's own before and after: four, not three
    assert len(doc["calibration_spread"]["2"]) == 4
    assert doc["summary"]["failed"] == ["tiny zero1"]
