"""``--ft-replicas R``: replica groups that train through a lost rank (docs/checkpoints.md).

The must-show: DDP over 3 replica groups of one rank, 60 steps. Group 2's rank SIGKILLs itself
at the start of step 20 (test hook SHARDWISE_FT_TEST_KILL=2:20:5; a real SIGKILL, from inside
because a 60-step run of this size is too quick to aim at from outside). Its restart waits until
the others took 5 more rounds (a slow restart on a clock of steps, so the other two provably
step without it however fast this machine restarts a process), and every step lasts at least
PACE seconds (SHARDWISE_FT_TEST_PACE) so that the run is not over before the restarted process
has imported torch. Checked: the other two groups keep their one process (one ``start`` event,
the same pid, no restart), step without group 2 from step 20, group 2 rejoins by step 40, and at
step 60 the three groups' final.safetensors are bit-identical.

The losses. The data rule (parallel/replicas.py) gives every step the whole global batch,
split in equal shares over the live groups, so a step with 2 groups trains on the same rows as
a step with 3 and the loss of every step equals the uninterrupted run's up to the order of
summation. The reference is therefore one process training the same config (no groups, no
kill); the tolerance is rtol 1e-5 on the fp32 loss: the 3 shares' (or 2 shares') mean
gradients are summed in another order than one batch's, and 60 AdamW steps carry that rounding
on; measured by simulation on this config (stdlib text, lr 1e-2) at most 2e-6. (On the
synthetic random tokens Adam amplifies the same rounding to 1e-3 by step 40: their gradients
are noise around zero, so that data set is not used here.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from shardwise import cli
from shardwise.comm import quorum as q
from shardwise.comm.quorum import Decision, Quorum, propose

STEPS, KILL_STEP, AWAY, PACE = 60, 20, 5, 0.75
FLAGS = ["--strategy", "ddp", "--steps", str(STEPS), "--n-layer", "2", "--n-embd", "32",
         "--n-head", "2", "--block-size", "16", "--dataset", "stdlib", "--max-bytes", "200000",
         "--batch-size", "6", "--lr", "1e-2", "--warmup-steps", "2", "--eval-every", "0",
         "--eval-batches", "1", "--device", "cpu", "--no-progress", "--log-every", "1"]


# -- the quorum's rule ------------------------------------------------------------------------
def test_propose_members_synced_step_and_link():
    """Members = the fully registered groups; step = the synced ones'; a new link when the
    members change or one asks for it, else the previous round's."""
    first = propose(0, {0: (0, False, True), 1: (0, False, True), 2: (0, False, True)}, None)
    assert (first.members, first.synced, first.step, first.link, first.source) == \
        ((0, 1, 2), (), 0, 0, 0)
    same = propose(1, {0: (1, True, False), 1: (1, True, False), 2: (1, True, False)}, first)
    assert (same.synced, same.step, same.link) == ((0, 1, 2), 1, 0)
    lost = propose(2, {1: (2, True, False), 2: (2, True, False)}, same)
    assert (lost.members, lost.link, lost.source) == ((1, 2), 2, 1)
    back = propose(3, {0: (0, False, True), 1: (3, True, False), 2: (3, True, False)}, lost)
    assert (back.members, back.synced, back.step, back.link, back.source) == \
        ((0, 1, 2), (1, 2), 3, 3, 1)
    assert Decision.decode(3, back.encode()) == back


@pytest.mark.timeout(60)
def test_quorum_rounds_drop_a_dead_group_and_take_a_joiner(monkeypatch):
    """Three one-rank groups on a real store: round 0 waits for all; in round 1 group 2 is gone
    (its heartbeat stops) and the others decide without it; in round 2 it registers again as a
    joiner and is a member, not synced; a failed vote fails the round for everyone."""
    monkeypatch.setattr(q, "STALE_S", 0.6)
    monkeypatch.setattr(q, "HEARTBEAT_S", 0.1)
    server = q.serve()
    address = f"127.0.0.1:{server.port}"
    clients = [Quorum(address, g, 0, 1, 3, timeout=30) for g in range(3)]

    def rounds(n, who, synced=True, step=0):
        out = {}
        threads = [threading.Thread(target=lambda g=g: out.__setitem__(
            g, clients[g].round(n, step, synced=synced, fresh=False, bound=30))) for g in who]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len({d for d in out.values()}) == 1      # one decision, read by everyone
        return next(iter(out.values()))

    assert rounds(0, (0, 1, 2), synced=False).members == (0, 1, 2)
    clients[2].close()                                  # group 2 dies: its heartbeat stops
    began = time.monotonic()
    d1 = rounds(1, (0, 1), step=1)
    assert d1.members == (0, 1) and d1.link == 1 and time.monotonic() - began < 20
    clients[2] = Quorum(address, 2, 0, 1, 3, timeout=30)     # restarted: a joiner
    out = {}
    join = threading.Thread(target=lambda: out.setdefault("d", clients[2].round(
        2, 0, synced=False, fresh=True, bound=30)))
    join.start()
    time.sleep(0.3)                                     # registered before the others
    d2 = rounds(2, (0, 1), step=2)
    join.join(30)
    assert out["d"] == d2 and d2.members == (0, 1, 2) and d2.synced == (0, 1) and d2.step == 2
    votes = {}
    threads = [threading.Thread(target=lambda g=g: votes.__setitem__(
        g, clients[g].vote(d2, ok=g != 1, bound=30))) for g in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert votes == {0: False, 1: False, 2: False}
    for c in clients:
        c.close()


# -- bad input: one line, exit 2 ----------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, words", [
    (["--nproc-per-node", "3", "--ft-replicas", "2", "--batch-size", "6"],
     "does not divide the data-parallel size 3"),
    (["--strategy", "ps", "--nproc-per-node", "3", "--ft-replicas", "2"],
     "the parameter server handles a lost worker itself"),
    (["--strategy", "zero2", "--nproc-per-node", "4", "--ft-replicas", "2", "--batch-size", "8"],
     "replica groups of ZeRO-2 are not built yet"),
    (["--nproc-per-node", "4", "--tp", "2", "--ft-replicas", "2", "--batch-size", "8"],
     "replica groups of --tp 2 are not built yet"),
    (["--nproc-per-node", "3", "--ft-replicas", "3", "--batch-size", "9"],
     "does not split into equal shares"),
    (["--nproc-per-node", "2", "--ft-replicas", "2", "--batch-size", "8", "--checkpoint-dir",
      "/tmp/shardwise-ft-refused"], "saving checkpoints under --ft-replicas is not built yet"),
    (["--nproc-per-node", "2", "--ft-replicas", "1"], "cannot survive"),
])
def test_refused_in_one_line(flags, words, capsys):
    code = cli.main(["train", "--device", "cpu", "--steps", "2", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: parallel.ft_replicas") and words in err, err


# -- the must-show: a group killed at step 20 rejoins; the others never stop ------------------
def _events(run: str, group: int) -> list[dict]:
    with open(os.path.join(run, f"replica{group}", "ft.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _reference() -> list[float]:
    """One process training the same config, no groups and no kill (module docstring)."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    cfg, _ = cli.parse_config([*FLAGS, "--out-dir", "/tmp/shardwise-test-runs", "--run-name",
                               f"ft-ref-{os.getpid()}"])
    torch.set_num_threads(1)
    summary = train(cfg, init_runtime(cfg), quiet=True)
    summary["engine"].close()
    return summary["losses"]


@pytest.mark.timeout(240)
def test_killed_group_rejoins_and_the_others_keep_stepping(tmp_path):
    from safetensors.torch import load_file
    env = {**os.environ, "SHARDWISE_FT_TEST_KILL": f"2:{KILL_STEP}:{AWAY}",
           "SHARDWISE_FT_TEST_PACE": str(PACE), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *FLAGS, "--nproc-per-node", "3",
           "--ft-replicas", "3", "--max-restarts", "2", "--collective-timeout", "60",
           "--out-dir", str(tmp_path), "--run-name", "ft"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    run = str(tmp_path / "ft")
    events = {g: _events(run, g) for g in range(3)}
    for g in (0, 1):        # the survivors: one process each, never restarted
        starts = [e for e in events[g] if e["event"] == "start"]
        assert len(starts) == 1 and starts[0]["restart"] == 0
        assert {e["pid"] for e in events[g]} == {starts[0]["pid"]}
        changes = [(e["step"], e["members"]) for e in events[g] if e["event"] == "members"]
        assert changes[0] == (KILL_STEP, [0, 1]), changes       # stepped on without group 2
        back = changes[1]
        assert back[1] == [0, 1, 2] and KILL_STEP + AWAY <= back[0] <= 40, changes
    starts = [e for e in events[2] if e["event"] == "start"]
    joins = [e for e in events[2] if e["event"] == "join"]
    assert [e["restart"] for e in starts] == [0, 1] and starts[0]["pid"] != starts[1]["pid"]
    assert joins[-1]["step"] == back[0] and joins[-1]["pid"] == starts[1]["pid"]
    params = [load_file(os.path.join(run, f"replica{g}", "final.safetensors")) for g in range(3)]
    for g in (1, 2):        # bit-identical replicas at the end
        assert params[g].keys() == params[0].keys()
        assert all(torch.equal(params[g][k], params[0][k]) for k in params[0])
    reference = torch.tensor(_reference(), dtype=torch.float64)
    for g in range(3):
        with open(os.path.join(run, f"replica{g}", "summary.json")) as fh:
            summary = json.load(fh)
        losses = torch.tensor(summary["losses"], dtype=torch.float64)
        start = summary["start_step"]
        assert start == (0 if g < 2 else back[0]) and len(losses) == STEPS - start
        torch.testing.assert_close(losses, reference[start:], rtol=1e-5, atol=0)
