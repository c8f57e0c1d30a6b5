"""Stopping a run from outside: SIGTERM to `shardwise train`'s launcher (which forwards SIGINT,
SIGTERM and SIGHUP alike), SIGINT to a one-process run, SIGKILL of the launcher.

Each test starts the real command line (the launcher, torchrun and two gloo ranks), waits until
rank 0 has written its first metrics line (training is under way), signals the launcher and
checks that no process of the run is left within 10 s and that the person sees one line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ARGS = ["--steps", "100000", "--log-every", "1", "--eval-every", "0", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--no-progress"]
DEADLINE = 10.0


def _processes_mentioning(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (the run's unique out dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _start(tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    out_dir = str(tmp_path / "runs")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *ARGS, "--out-dir", out_dir,
           "--run-name", "stopme", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out_dir, "stopme", "metrics.jsonl")
    start = time.monotonic()
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        if proc.poll() is not None or time.monotonic() - start > 120:
            proc.kill()
            raise AssertionError(f"run did not start: {proc.communicate()}")
        time.sleep(0.2)
    return proc, out_dir


def _wait_gone(proc: subprocess.Popen, out_dir: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < DEADLINE:
        if proc.poll() is not None and not _processes_mentioning(out_dir):
            return time.monotonic() - start
        time.sleep(0.1)
    left = _processes_mentioning(out_dir)
    seen = {pid: _describe(pid) for pid in left}    # which of the run's processes, doing what
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes left after {DEADLINE} s (load {os.getloadavg()[0]:.1f}): "
                         f"{seen}")


def _describe(pid: int) -> str:
    """A left process's state, parent and command line, for the failure message."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read().strip()
        return f"state {fields[0]} ppid {fields[1]} wchan {wchan}: {cmd}"
    except OSError as exc:
        return f"gone ({exc.strerror})"


@pytest.mark.timeout(180)
def test_signal_stops_every_rank_with_one_line(tmp_path):
    sig = signal.SIGTERM      # the launcher forwards SIGINT the same way (SIGINT: one process, below)
    proc, out_dir = _start(tmp_path)
    proc.send_signal(sig)
    _wait_gone(proc, out_dir)
    stdout, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 128 + sig
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    step = json.load(open(os.path.join(out_dir, "stopme", "stopped.json")))["step"]
    assert step >= 1
    assert lines[0] == f"stopped at step {step}; metrics so far in {os.path.join(out_dir, 'stopme')}"
    # what the ranks printed on their way out is kept, not lost
    assert os.path.exists(os.path.join(out_dir, "stopme", "launcher.log"))


@pytest.mark.timeout(180)
def test_sigkill_of_the_launcher_leaves_no_rank_training(tmp_path):
    proc, out_dir = _start(tmp_path)
    proc.kill()                       # no handler runs: the ranks must notice on their own
    _wait_gone(proc, out_dir)


@pytest.mark.timeout(120)
def test_single_process_run_stops_with_one_line(tmp_path):
    proc, out_dir = _start(tmp_path, "--strategy", "single")
    proc.send_signal(signal.SIGINT)                        # Ctrl-C
    _wait_gone(proc, out_dir)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT
    assert [line for line in stderr.splitlines() if line.strip()] == [
        f"stopped at step {json.load(open(os.path.join(out_dir, 'stopme', 'stopped.json')))['step']}"
        f"; metrics so far in {os.path.join(out_dir, 'stopme')}"]


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            found += [int(c) for c in fh.read().split()]
    return found


@pytest.mark.timeout(180)
def test_a_killed_torchrun_agent_ends_the_run_with_one_line(tmp_path):
    proc, out_dir = _start(tmp_path)
    agent, = _children(proc.pid)                       # the launcher's one child: torchrun
    os.kill(agent, signal.SIGKILL)
    _wait_gone(proc, out_dir)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGKILL
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == [f"error: torchrun (pid {agent}) was killed by SIGKILL from outside this "
                     f"launcher, and its ranks with it; metrics so far in "
                     f"{os.path.join(out_dir, 'stopme')}"], stderr
