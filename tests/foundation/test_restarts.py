"""``--max-restarts``: a rank killed mid-run, torchrun's agent restarts the world, the new world
resumes from the last checkpoint and ends with the parameters of a run that was never killed.

One real command line (the launcher, torchrun with ``--max-restarts 3`` and two gloo ranks of
DDP on tiny_config's GPT, 14 steps, saving every 2). The test watches the checkpoint folder and
kills three times (KILLS): once ``latest`` names step 2 it SIGKILLs rank 1 of the first attempt
(found through /proc by its RANK and TORCHELASTIC_RESTART_COUNT), once it names step 6 rank 0
of the second, once it names step 10 rank 1 of the third; each kill lands somewhere after its
step (in a step or in a save: both must resume cleanly) and before the end, so the world
resumes from three different steps. The reference is the same config trained without checkpoints or
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
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

STEPS = 14
# (the step ``latest`` must reach, the rank to kill) for attempts 0, 1, 2: three kills, each at
# a later step, of rank 1, then rank 0 (which serves the attempt's store), then rank 1 again
KILLS = [(2, 1), (6, 0), (10, 1)]
FLAGS = ["--strategy", "ddp", "--nproc-per-node", "2", "--steps", str(STEPS), "--n-layer", "2",
         "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--vocab-size", "67",
         "--dataset", "synthetic", "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "2",
         "--eval-every", "0", "--eval-batches", "1", "--device", "cpu", "--no-progress",
         "--log-every", "1"]


def _rank_pid(marker: str, rank: int, attempt: int) -> int | None:
    """The pid of rank ``rank`` in attempt ``attempt`` of the run whose command line has
    ``marker``."""
    want = {f"RANK={rank}".encode(), f"TORCHELASTIC_RESTART_COUNT={attempt}".encode()}
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


def _kill_at(proc, ck: str, out_dir: str, attempt: int, after: int, rank: int,
             deadline: float) -> None:
    """Once ``latest`` names step ``after`` or later, SIGKILL rank ``rank`` of ``attempt``."""
    pid = None
    while _latest_step(ck) < after or pid is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        pid = pid or _rank_pid(out_dir, rank, attempt)
        if pid is None or _latest_step(ck) < after:
            time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)


# each start of a world of 2 (launcher, torchrun, the ranks' imports) takes 4-15 s on a quiet
# machine and up to a minute on a loaded one: four starts here (19 s in all on a quiet 2-core
# machine on 2026-12-02; in the default suite, since it is the only test of restarts that kill)
@pytest.mark.timeout(1200)
def test_a_rank_killed_at_three_steps_restarts_and_ends_like_an_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file
    out_dir, ck = str(tmp_path / "runs"), str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *FLAGS, "--out-dir", out_dir,
           "--run-name", "restarts", "--checkpoint-dir", ck, "--checkpoint-every", "2",
           "--max-restarts", str(len(KILLS))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    try:
        for attempt, (after, rank) in enumerate(KILLS):
            _kill_at(proc, ck, out_dir, attempt, after, rank, deadline)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    said = re.findall(rf"^restart (\d+) of {len(KILLS)}: resuming from step (\d+)$", stdout,
                      re.M)
    assert [int(k) for k, _ in said] == [1, 2, 3], stdout[-3000:]
    resumed = [int(s) for _, s in said]
    for (after, _), step in zip(KILLS, resumed):    # each kill after its step, before the end
        assert after <= step < STEPS and step % 2 == 0, resumed
    assert resumed == sorted(set(resumed)), f"three different steps: {resumed}"

    ref_losses, ref_params = run_world(_reference, 2, timeout=180)[0]
    run = os.path.join(out_dir, "restarts")
    # each attempt's metrics are kept (metrics-attempt<k>.jsonl) beside the last world's
    starts = [0, *resumed]
    for k, begin in enumerate(starts[:-1]):
        seen = _losses(os.path.join(run, f"metrics-attempt{k}.jsonl"))
        assert starts[k + 1] <= begin + len(seen) < STEPS, (k, begin, len(seen))
        assert seen == ref_losses[begin:begin + len(seen)], f"attempt {k}"
    assert _losses(os.path.join(run, "metrics.jsonl")) == ref_losses[resumed[-1]:]
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
