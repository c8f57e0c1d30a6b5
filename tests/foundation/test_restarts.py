"""``--max-restarts``: a rank killed mid-run, torchrun's agent restarts the world, the new world
resumes from the last checkpoint and ends with the parameters of a run that was never killed.

One real command line (the launcher, torchrun with ``--max-restarts 1`` and two gloo ranks of
DDP on tiny_config's GPT, saving every 2 steps). The test watches the checkpoint folder: once
``latest`` names step 4 or later it SIGKILLs rank 1 (found through /proc by its RANK in the
first attempt), so the kill lands somewhere after step 4 (in a step or in a save: both must
resume cleanly) and, with 8 steps and 4 saves left, before the end. The reference is the same config trained without checkpoints or
kills in a forked world of 2 in this process; on CPU the resumed run must equal it bit for bit
(the same ranks redo the same arithmetic from the same saved state: no tolerance applies),
both the exported final parameters and every step's loss in metrics.jsonl.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import tiny_config
from shardwise import cli
from shardwise.runtime import init_runtime
from shardwise.train import train

STEPS, KILL_AFTER = 12, 4
FLAGS = ["--strategy", "ddp", "--nproc-per-node", "2", "--steps", str(STEPS), "--n-layer", "2",
         "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--vocab-size", "67",
         "--dataset", "synthetic", "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "2",
         "--eval-every", "0", "--eval-batches", "1", "--device", "cpu", "--no-progress",
         "--log-every", "1"]


def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the first attempt's rank ``rank`` of the run whose command line has ``marker``."""
    want = {f"RANK={rank}".encode(), b"TORCHELASTIC_RESTART_COUNT=0"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() not in fh.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if want <= set(fh.read().split(b"\0")):
                    return int(pid)
        except OSError:
            continue
    return None


def _reference(rank, world):
    """The uninterrupted run: the same config, no checkpoints, no kill."""
    cfg = tiny_config("ddp", steps=STEPS)
    cfg = replace(cfg, logging=replace(cfg.logging, run_name=f"restart-ref-{os.getpid()}"))
    summary = train(cfg, init_runtime(cfg), quiet=True)
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    return summary["losses"], params


def _latest_step(ck: str) -> int:
    try:
        with open(os.path.join(ck, "latest")) as fh:
            return int(fh.read().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def _losses(path: str) -> list[float]:
    with open(path) as fh:
        return [json.loads(line)["loss"] for line in fh]


# on a quiet machine the run takes about 15 s (two starts of a world of 2); the limits are for
# a loaded one, where each start of the launcher, torchrun and the ranks can take a minute
@pytest.mark.slow   # two launcher + world start-ups (~40 s quiet, 110 s loaded): pytest -m slow
@pytest.mark.timeout(420)
def test_a_killed_rank_restarts_the_world_and_ends_like_an_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file
    out_dir, ck = str(tmp_path / "runs"), str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *FLAGS, "--out-dir", out_dir,
           "--run-name", "restarts", "--checkpoint-dir", ck, "--checkpoint-every", "2",
           "--max-restarts", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid, deadline = None, time.monotonic() + 240
    try:
        while _latest_step(ck) < KILL_AFTER:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            pid = pid or _rank_pid(out_dir, 1)
            time.sleep(0.002)
        os.kill(pid or _rank_pid(out_dir, 1), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    said = re.findall(r"^restart 1 of 1: resuming from step (\d+)$", stdout, re.M)
    assert len(said) == 1, stdout[-3000:]
    resumed = int(said[0])
    assert KILL_AFTER <= resumed < STEPS and resumed % 2 == 0

    ref_losses, ref_params = run_world(_reference, 2, timeout=60)[0]
    run = os.path.join(out_dir, "restarts")
    # the first attempt's metrics are kept beside the restarted world's
    first = _losses(os.path.join(run, "metrics-attempt0.jsonl"))
    assert resumed <= len(first) < STEPS and first == ref_losses[:len(first)]
    assert _losses(os.path.join(run, "metrics.jsonl")) == ref_losses[resumed:]
    exported = str(tmp_path / "model.safetensors")
    assert cli.main(["checkpoint", "export", ck, "--out", exported]) == 0
    weights = load_file(exported)
    for name, p in ref_params.items():
        assert torch.equal(weights[name], p), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, says", [
    (["--max-restarts", "2"], "train.max_restarts = 2: a restarted world resumes from the last "
     "checkpoint, and without --checkpoint-dir nothing is saved"),
    (["--max-restarts", "-1", "--checkpoint-dir", "{tmp}/ck"], "train.max_restarts = -1: is "
     "negative"),
])
def test_bad_restart_settings_are_refused_before_launch(tmp_path, capsys, extra, says):
    code = cli.main(["train", *FLAGS, "--out-dir", str(tmp_path / "runs"),
                     *[a.format(tmp=tmp_path) for a in extra]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err
    assert not (tmp_path / "runs").exists()          # refused before anything was made
