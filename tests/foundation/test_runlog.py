"""What a run leaves and prints: window means, strict JSON, CSV / TensorBoard, log lines, the run
directory (named once, written before the first step, never written over)."""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import replace

import pytest

from shardwise.config import rundir
from shardwise.cli import main
from shardwise.config import ConfigError
from shardwise.run.runlog import Window, log_line, strict
from shardwise.run.train import train
from tests.reference import tiny_config


def _cfg(tmp_path, **logging):
    cfg = tiny_config("single", steps=7)
    cfg = replace(cfg, train=replace(cfg.train, eval_every=3),
                  logging=replace(cfg.logging, out_dir=str(tmp_path), run_name="r", log_every=3,
                                  **logging))
    return cfg


def test_records_are_window_means_and_val_only_where_evaluated(tmp_path):
    summary = train(_cfg(tmp_path, csv=True), quiet=True)
    lines = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [3, 6, 7]          # every 3 steps, and the last
    losses = summary["losses"]
    for record, window in zip(lines, (losses[0:3], losses[3:6], losses[6:7])):
        assert record["window_steps"] == len(window)
        assert record["loss"] == pytest.approx(statistics.mean(window), rel=1e-12)
    # evaluation ran at steps 3 and 6 (eval_every) and 7 (the last): each such record has it
    assert all("val_loss" in r for r in lines)
    rows = list(csv.DictReader(open(tmp_path / "r" / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [3, 6, 7]
    assert float(rows[0]["loss"]) == pytest.approx(lines[0]["loss"])


def test_val_loss_is_absent_where_evaluation_did_not_run(tmp_path):
    cfg = _cfg(tmp_path)
    cfg = replace(cfg, train=replace(cfg.train, eval_every=0))
    train(cfg, quiet=True)
    lines = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert ["val_loss" in r for r in lines] == [False, False, True]


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    train(_cfg(tmp_path, tensorboard=True), quiet=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [3, 6, 7]


def test_non_finite_values_are_null_and_flagged():
    out = strict({"step": 1, "loss": float("nan"), "lr": 0.1, "val_loss": float("inf")})
    assert out == {"step": 1, "loss": None, "lr": 0.1, "val_loss": None,
                   "nonfinite": ["loss", "val_loss"]}
    json.dumps(out, allow_nan=False)          # strict JSON: would raise on a bare NaN
    w = Window()
    w.add(1.0, 0.1, 0)
    w.add(float("nan"), 0.1, 0)
    assert math.isnan(w.mean_loss())           # a NaN in the window is not averaged away


def test_log_line_reads_like_a_log():
    record = {"step": 40, "loss": 2.34561, "val_loss": 2.4, "items_per_second": 25612.4,
              "mfu": None, "peak_memory_per_rank": [800 * 2**20, 812 * 2**20]}
    assert log_line(record, 500, "tok", 80) == (
        "step 40/500 | loss 2.3456 | val 2.4000 | 25,612 tok/s | mfu - | mem 812.0 MB | eta 1m20s")


def test_printed_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    train(_cfg(tmp_path, progress=True), quiet=False)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in printed] == ["step 3/7", "step 6/7", "step 7/7"]


def test_config_is_written_before_the_first_step_and_runs_are_not_overwritten(tmp_path):
    cfg = _cfg(tmp_path)
    folder = rundir.create(rundir.name_run(cfg))
    assert json.load(open(os.path.join(folder, "config.json")))["logging"]["run_name"] == "r"
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.name_run(cfg)                   # the same explicit name again: refused
    auto = replace(cfg, logging=replace(cfg.logging, run_name=""))
    first = rundir.name_run(auto)
    rundir.create(first)
    second = rundir.name_run(auto)             # same second, same strategy: a new folder
    assert second.logging.run_name != first.logging.run_name


def test_cli_refuses_an_existing_run_name(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("{}\n")
    code = main(["train", "--strategy", "single", "--out-dir", str(tmp_path), "--run-name", "taken"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: logging.run_name = 'taken'")


@pytest.mark.parametrize("name", ["x" * 300, "a/b", "../up"])
def test_bad_run_names_are_refused(name, capsys):
    assert main(["train", "--strategy", "single", "--run-name", name]) == 2
    assert capsys.readouterr().err.startswith("error: logging.run_name")
