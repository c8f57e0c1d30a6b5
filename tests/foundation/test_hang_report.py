"""The hang report: a world of 4 where one rank stops (SIGSTOP) or skips a collective; within
the collective timeout + 10 s the launcher's report names that rank, its last completed
collective and the step, and ``shardwise doctor RUN_DIR`` prints it again.

Each test runs the real command line (launcher, torchrun, 4 gloo ranks) with a 5 s collective
timeout, waits for the first metrics line, then stops a rank (its pid from its flight record).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shardwise import cli
from shardwise.comm import flight

TIMEOUT = 5
ARGS = ["--steps", "100000", "--log-every", "1", "--eval-every", "0", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
        "--no-progress", "--collective-timeout", str(TIMEOUT)]


def _start(tmp_path, env=None, *extra):
    out_dir = str(tmp_path / "runs")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *ARGS, "--out-dir", out_dir,
           "--run-name", "hang", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    return proc, os.path.join(out_dir, "hang")


def _wait_for_training(proc, run_dir, ranks=4):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    start = time.monotonic()
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0 and
               all(os.path.exists(flight.path_for(run_dir, r)) for r in range(ranks))):
        if proc.poll() is not None or time.monotonic() - start > 120:
            proc.kill()
            raise AssertionError(f"run did not start: {proc.communicate()}")
        time.sleep(0.2)


def _finish(proc, limit):
    try:
        _, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the run did not end within {limit} s: {proc.communicate()}")
    return stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["--strategy", "ddp", "--dp", "4"],
                                    ["--strategy", "zero3", "--dp", "4"]])
def test_a_stopped_rank_is_named_with_its_last_collective_and_step(tmp_path, capsys, layout):
    proc, run_dir = _start(tmp_path, None, *layout)
    _wait_for_training(proc, run_dir)
    victim = flight.read(flight.path_for(run_dir, 2))["pid"]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        stderr = _finish(proc, TIMEOUT + 60)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = stderr.splitlines()
    assert proc.returncode != 0
    behind = [line for line in lines if "is behind" in line]
    assert len(behind) == 1 and behind[0].startswith("  rank 2 is behind: its process is "
                                                      "stopped"), stderr[-3000:]
    last = flight.read(flight.path_for(run_dir, 2))
    done = [r for r in last["records"] if r["end"] > 0][-1]
    assert f"'{done['op']}' #{done['seq']}" in behind[0] and f"at step {done['step']}" in behind[0]
    waiting = [int(r) for m in re.finditer(r"rank\(s\) ([\d,]+) wait in '", stderr)
               for r in m.group(1).split(",")]        # ZeRO-3's prefetch: maybe two ops
    assert sorted(waiting) == [0, 1, 3], stderr[-3000:]
    # the report came within the timeout + 10 s of the stop (launcher's grace included)
    report = os.path.join(run_dir, "flight", "report.txt")
    assert os.path.getmtime(report) - (time.time() - (time.monotonic() - stopped_at)) <= TIMEOUT + 10
    capsys.readouterr()
    assert cli.main(["doctor", run_dir]) == 0
    assert "rank 2 is behind: its process is stopped" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    # rank 1 skips its 40th collective (ZeRO-3's all-gathers and reduce-scatters over gloo):
    # it runs the next one while the others wait in the skipped one
    proc, run_dir = _start(tmp_path, {"SHARDWISE_SKIP_COLLECTIVE": "1:40"},
                           "--strategy", "zero3", "--dp", "4")
    stderr = _finish(proc, 150)
    behind = [line for line in stderr.splitlines() if "is behind" in line]
    # gloo may notice the mismatch itself and end rank 1 (the sizes differ): then its
    # process is gone, and the report still says where it went astray
    assert len(behind) == 1 and behind[0].startswith("  rank 1 is behind: "), stderr[-3000:]
    assert re.search(r"it is in '\w+' #40 \([\d,]+ bytes\) while ranks 0,2,3 are in '\w+' #40",
                     behind[0]) and "skipped a collective" in behind[0], behind[0]


def test_doctor_without_records_is_one_line(tmp_path, capsys):
    assert cli.main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no flight records" in err[0]
