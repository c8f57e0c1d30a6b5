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

The same with ZeRO inside each group (test_zero_groups_rejoin_with_their_shards): 2 groups of 2
ranks at world 4, group 1's rank 0 killed at step 20 (torchrun restarts both of its ranks), each
rank of group 1 rejoining with the shards of the same rank of group 0; ZeRO-2 in the default
suite, ZeRO-1 and ZeRO-3 with ``-m slow``; and with tensor parallelism (tp 2) or a pipeline (pp
2) inside each of 2 groups at world 4 (``-m slow``:
test_tp_and_pp_groups_rejoin_with_their_pieces). Every rank writes its own ``start`` event, so
every survivor's pid is checked. A failed vote (Redo) is checked apart, in-process, with a
stand-in hook: DDP and ZeRO-1/2/3 at world 2, dp 2 x tp 2 and dp 2 x pp 2 (DDP and ZeRO stages)
at world 4; the retaken steps end bit-identical to a run whose votes all passed, and the hook
runs once per taken step. A stop with ``--checkpoint-dir``
(test_stop_saves_one_checkpoint_and_every_group_resumes_from_it): every group at one step
boundary, one checkpoint, and a resume of every group from it.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from shardwise import cli
from shardwise.comm import quorum as q
from shardwise.comm.quorum import Decision, Quorum, propose
from shardwise.parallel.replicas import Redo

STEPS, KILL_STEP, AWAY, PACE = 60, 20, 5, 0.75
PACE_STOP = 0.3       # the stop test's step length: its signal must land mid-run
FLAGS = ["--strategy", "ddp", "--steps", str(STEPS), "--n-layer", "2", "--n-embd", "32",
         "--n-head", "2", "--block-size", "16", "--dataset", "stdlib", "--max-bytes", "200000",
         "--batch-size", "6", "--lr", "1e-2", "--warmup-steps", "2", "--eval-every", "0",
         "--eval-batches", "1", "--device", "cpu", "--no-progress", "--log-every", "1"]


# -- the quorum's rule ------------------------------------------------------------------------
def test_propose_members_synced_step_and_link():
    """Members = the fully registered groups; step = the synced ones'; a new link when the
    members change or one asks for it, else the previous round's; stop = a registered rank's
    signal."""
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
    stop = propose(4, {0: (4, True, False), 1: (4, True, False), 2: (4, True, False)}, back, 15)
    assert (stop.stop, stop.link, back.stop) == (15, 3, 0)      # a stop: every member leaves
    assert Decision.decode(4, stop.encode()) == stop


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


# -- a failed vote: the component takes the same step again -----------------------------------
class _FailingVotes:
    """A stand-in for ReplicaGroups' hook: its calls numbered ``fail`` fail the vote (Redo),
    after scribbling NaN over the buffers they were given (the step's gradients must be dropped
    whatever they hold); the others leave the buffers as they are (one live group)."""

    def __init__(self, fail: tuple[int, ...]):
        self.fail, self.calls = fail, 0

    def reduce(self, buffers: list[torch.Tensor]) -> None:
        self.calls += 1
        if self.calls in self.fail:
            for b in buffers:
                b.fill_(float("nan"))
            raise Redo(f"call {self.calls}")


# the layouts the failed-vote test runs: (strategy, parallel fields). The data-parallel
# stages at world 2; tp and pp at world 4, so dp 2 x tp 2 and dp 2 x pp 2: the hook then sees
# what the component's reduction over dp left of this rank's tp slice / stage
RETAKE_LAYOUTS = {
    "ddp": ("ddp", {}), "zero1": ("zero1", {}), "zero2": ("zero2", {}), "zero3": ("zero3", {}),
    "tp": ("tp", {"tp": 2}), "tp-zero2": ("tp", {"tp": 2, "zero_stage": 2}),
    "pp": ("pp", {"pp": 2, "num_microbatches": 2}),
    "pp-zero1": ("pp", {"pp": 2, "num_microbatches": 2, "zero_stage": 1}),
    "pp-zero3": ("pp", {"pp": 2, "num_microbatches": 2, "zero_stage": 3}),
    # HSDP inside a group (dp 4 = 2 replicas x 2-rank shard groups): the hook sees the shards
    # after the replica all-reduce
    "hsdp-zero2": ("zero2", {"dp_shard": 2}), "hsdp-zero3": ("zero3", {"dp_shard": 2}),
    # context parallelism inside a group (dp 2 x cp 2): every sequence cut over the cp ranks
    "cp": ("ddp", {"cp": 2}), "cp-zero2": ("zero2", {"cp": 2}),
    # offloaded state inside a group: the hook averages shards that live in the store
    "zero2-offload-cpu": ("zero2", {"memory": {"offload": "cpu"}}),
    "zero3-offload-disk-params": ("zero3", {"memory": {"offload": "disk",
                                                       "offload_params": True}}),
    # fp16: the overflow check reads the gradients after the hook averaged them over the
    # groups, so an inf in any group's share skips the step in every group alike
    "ddp-fp16": ("ddp", {"memory": {"mixed_precision": "fp16"}}),
    "zero2-fp16": ("zero2", {"memory": {"mixed_precision": "fp16"}}),
}
RETAKE_WORLDS = {2: ("ddp", "zero1", "zero2", "zero3", "zero2-offload-cpu",
                     "zero3-offload-disk-params", "ddp-fp16", "zero2-fp16"),
                 4: ("tp", "tp-zero2", "pp", "pp-zero1", "pp-zero3", "hsdp-zero2", "hsdp-zero3",
                     "cp", "cp-zero2")}


def _retake_steps(rank: int, n: int, layouts: tuple[str, ...]) -> dict:
    """Per layout (RETAKE_LAYOUTS), 6 steps in this world twice (clipping on, 2 accumulation
    micro-steps, ~2 KB buckets): once with every vote passing, once with calls 2, 4 and 5 of
    the hook failing (step 1 retaken once, step 2 twice), as ReplicaGroups.train_step retakes
    them: Redo caught, ``strategy.zero_grad()``, train_step again on the same rows. Under pp
    the strategy is the pipeline driver: the hook set on it lands on its component."""
    import shardwise
    from dataclasses import replace
    from reference import tiny_config
    from shardwise.models import build_model
    from shardwise.run.api import optimizer_factory
    out = {}
    for layout in layouts:
        strategy, fields = RETAKE_LAYOUTS[layout]
        fields = dict(fields)
        memory = fields.pop("memory", {})
        cfg = tiny_config(strategy, steps=6, bucket_mb=0.002, **fields)
        cfg = replace(cfg, train=replace(cfg.train, grad_clip=0.5),
                      memory=replace(cfg.memory, grad_accum=2, **memory))
        runs = []
        for fail in ((), (2, 4, 5)):
            engine = shardwise.prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg)
            hook = engine.strategy.ft = _FailingVotes(fail)
            g = torch.Generator().manual_seed(3)
            losses = []
            for _ in range(cfg.train.steps):
                x = torch.randint(0, cfg.model.vocab_size, (8, 16), generator=g)
                xs, ys = engine.shard(x, torch.roll(x, -1, 1))
                while True:
                    try:
                        losses.append(engine.strategy.train_step(xs, ys))
                        break
                    except Redo:
                        engine.strategy.zero_grad()
            runs.append((hook.calls, losses, engine.full_state_dict()))
            engine.close()
        out[layout] = runs
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: 17-28 s
def test_a_failed_vote_leaves_every_stage_ready_to_retake_the_step(world):
    """DDP and ZeRO-1/2/3 at world 2; tensor parallelism (dp 2 x tp 2, DDP and ZeRO-2) and a
    pipeline (dp 2 x pp 2, DDP, ZeRO-1 and ZeRO-3) at world 4: on every rank the hook is
    called exactly once per taken step (clipping calls the gradient sync first, the step
    again; under pp the driver's flush, the tied sum and the loss broadcast come before it),
    and a run whose votes failed three times ends bit-identical to one whose votes all passed
    (the retaken steps recompute the same gradients from the same rows; nothing of the failed
    attempts reached the optimizer, and the pipeline has no send or receive left in flight
    after its flush)."""
    from harness import run_world
    results = run_world(_retake_steps, world, RETAKE_WORLDS[world], timeout=130)
    for rank, result in enumerate(results):
        for layout, ((calls, losses, params), (calls_r, losses_r, params_r)) in result.items():
            assert (calls, calls_r) == (6, 9), (rank, layout, calls, calls_r)
            assert losses == losses_r, (rank, layout)
            assert params.keys() == params_r.keys()
            assert all(torch.equal(params[k], params_r[k]) for k in params), (rank, layout)


# -- bad input: one line, exit 2 ----------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, words", [
    (["--nproc-per-node", "3", "--ft-replicas", "2", "--batch-size", "6"],
     "does not divide the data-parallel size 3"),
    (["--strategy", "ps", "--nproc-per-node", "3", "--ft-replicas", "2"],
     "the parameter server handles a lost worker itself"),
    (["--nproc-per-node", "6", "--pp", "2", "--num-microbatches", "2", "--ft-replicas", "3",
      "--batch-size", "6"], "x 1 rank(s) x grad_accum 1 x 2 micro-batches"),
    (["--strategy", "zero2", "--nproc-per-node", "4", "--dp-replicate", "2", "--ft-replicas",
      "2", "--batch-size", "8"], "--dp-replicate 2 under replica groups: the groups are the"),
    (["--strategy", "zero2", "--nproc-per-node", "8", "--dp-shard", "8", "--ft-replicas", "2",
      "--batch-size", "16"], "--dp-shard 8 does not divide a group's data-parallel size 4"),
    (["--nproc-per-node", "3", "--ft-replicas", "3", "--batch-size", "9"],
     "does not split into equal shares"),
    (["--nproc-per-node", "2", "--ft-replicas", "1"], "cannot survive"),
])
def test_refused_in_one_line(flags, words, capsys):
    code = cli.main(["train", "--device", "cpu", "--steps", "2", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: parallel.ft_replicas") and words in err, err


@pytest.mark.timeout(60)
def test_what_a_group_refuses_is_refused_before_launch(capsys):
    """A setting that only a group's own config refuses (``--bucket-mb`` reads nothing when
    each group has one rank: dp 1) stops in the launcher with one line naming the groups, exit
    2, instead of passing there and failing in every group's torchrun with its tracebacks."""
    code = cli.main(["train", "--device", "cpu", "--steps", "2", "--nproc-per-node", "2",
                     "--ft-replicas", "2", "--batch-size", "8", "--bucket-mb", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: parallel.bucket_mb = 1.0: in each of the 2 replica groups "
                          "(1 rank(s) each): dp = 1: there is no gradient"), err


# -- the must-show: a group killed at step 20 rejoins; the others never stop ------------------
def _events(run: str, group: int) -> list[dict]:
    with open(os.path.join(run, f"replica{group}", "ft.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _reference(flags: list[str]) -> list[float]:
    """One process training the same config, no groups and no kill (module docstring)."""
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    layout = ("--strategy", "--bucket-mb", "--tp", "--pp",     # the flag and its value
              "--num-microbatches", "--cp")                     # both dropped
    plain = [f for i, f in enumerate(flags)
             if f not in layout and not (i and flags[i - 1] in layout)]
    cfg, _ = cli.parse_config([*plain, "--strategy", "single", "--out-dir",
                               "/tmp/shardwise-test-runs", "--run-name", f"ft-ref-{os.getpid()}"])
    torch.set_num_threads(1)
    summary = train(cfg, init_runtime(cfg), quiet=True)
    summary["engine"].close()
    return summary["losses"]


def _run_killed(tmp_path, flags: list[str], nproc: int, groups: int, killed: int) -> str:
    """The launcher with ``groups`` replica groups of nproc / groups ranks, group ``killed``'s
    rank 0 SIGKILLed at the start of step KILL_STEP (its restart held for AWAY rounds);
    returns the run folder once it exited 0."""
    env = {**os.environ, "SHARDWISE_FT_TEST_KILL": f"{killed}:{KILL_STEP}:{AWAY}",
           "SHARDWISE_FT_TEST_PACE": str(PACE), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *flags, "--nproc-per-node",
           str(nproc), "--ft-replicas", str(groups), "--max-restarts", "2",
           "--collective-timeout", "60", "--out-dir", str(tmp_path), "--run-name", "ft"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(tmp_path / "ft")


def _check_killed_run(run: str, groups: int, ranks: int, killed: int,
                      reference: list[float] | None, rtol: float) -> None:
    """The survivors kept every rank's one process and stepped without ``killed`` from
    KILL_STEP; it rejoined by step 40 with new processes; the final parameters of every group
    are bit-identical; every group's losses equal ``reference`` within ``rtol``."""
    from safetensors.torch import load_file
    events = {g: _events(run, g) for g in range(groups)}
    live = [g for g in range(groups) if g != killed]
    back = None
    for g in live:        # the survivors: one process per rank, never restarted
        starts = sorted((e["rank"], e["restart"], e["pid"]) for e in events[g]
                        if e["event"] == "start")
        assert [(r, t) for r, t, _ in starts] == [(r, 0) for r in range(ranks)], starts
        assert {e["pid"] for e in events[g] if e["rank"] == 0} == {starts[0][2]}
        changes = [(e["step"], e["members"]) for e in events[g] if e["event"] == "members"]
        assert changes[0] == (KILL_STEP, live), changes        # stepped on without it
        back = changes[1]
        assert back[1] == list(range(groups)) and KILL_STEP + AWAY <= back[0] <= 40, changes
    starts = [e for e in events[killed] if e["event"] == "start"]
    joins = [e for e in events[killed] if e["event"] == "join"]
    for rank in range(ranks):     # every rank of the killed group: a first and a restarted pid
        mine = [e for e in starts if e["rank"] == rank]
        assert [e["restart"] for e in mine] == [0, 1] and mine[0]["pid"] != mine[1]["pid"], mine
    assert joins[-1]["step"] == back[0] and joins[-1]["pid"] == \
        [e for e in starts if e["rank"] == 0][1]["pid"]
    params = [load_file(os.path.join(run, f"replica{g}", "final.safetensors"))
              for g in range(groups)]
    for g in range(1, groups):        # bit-identical replicas at the end
        assert params[g].keys() == params[0].keys()
        assert all(torch.equal(params[g][k], params[0][k]) for k in params[0])
    for g in range(groups):
        with open(os.path.join(run, f"replica{g}", "summary.json")) as fh:
            summary = json.load(fh)
        losses = torch.tensor(summary["losses"], dtype=torch.float64)
        start = summary["start_step"]
        assert start == (back[0] if g == killed else 0) and len(losses) == STEPS - start
        if reference is not None:
            torch.testing.assert_close(losses, torch.tensor(reference, dtype=torch.float64)[start:],
                                       rtol=rtol, atol=0)


@pytest.mark.timeout(240)
def test_killed_group_rejoins_and_the_others_keep_stepping(tmp_path):
    """DDP over 3 one-rank groups, group 2 killed (module docstring)."""
    run = _run_killed(tmp_path, FLAGS, nproc=3, groups=3, killed=2)
    _check_killed_run(run, groups=3, ranks=1, killed=2, reference=_reference(FLAGS), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_background_saves_while_the_writer_group_is_killed_and_rejoins(tmp_path):
    """``--checkpoint-async --checkpoint-every 4`` over 2 one-rank DDP groups, group 0 (the
    writer) killed at step 20: group 1 writes the checkpoints while it is away, then group 0
    rejoins and writes again, group 1 finishing its own save before that (the hand-over of
    ReplicaGroups.finish_saves). Checked: the usual rejoin semantics and losses, ``latest``
    names the last step, every kept checkpoint is intact (checksums), no ``.partial`` folder
    is left, and the kept checkpoints are the newest ones."""
    from shardwise.checkpoint import store
    ckpt = str(tmp_path / "ckpt")
    flags = [*FLAGS, "--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--checkpoint-async"]
    run = _run_killed(tmp_path, flags, nproc=2, groups=2, killed=0)
    _check_killed_run(run, groups=2, ranks=1, killed=0,
                      reference=_reference(flags[:flags.index("--checkpoint-dir")]), rtol=1e-5)
    names = sorted(os.listdir(ckpt))
    assert not [n for n in names if n.endswith(".partial")], names
    assert os.path.basename(store.latest(ckpt)) == f"step-{STEPS}"
    kept = store.steps(ckpt)
    assert kept[-1] == STEPS and kept == sorted(kept)
    for step in kept:
        assert store.damage(os.path.join(ckpt, store.step_name(step))) is None, step


def _zero_flags(stage: int) -> list[str]:
    """FLAGS at ZeRO ``stage`` with ~0.05 MB buckets (stages 1-2; stage 3's units are the
    blocks), so each rank reduces several shards, and a batch of 8 (equal shares for 1 or 2
    groups of 2 ranks)."""
    buckets = ["--bucket-mb", "0.05"] if stage < 3 else []
    flags = [*FLAGS[2:], "--strategy", f"zero{stage}", *buckets]
    flags[flags.index("--batch-size") + 1] = "8"
    return flags


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_zero_groups_rejoin_with_their_shards(tmp_path, stage):
    """ZeRO inside each of 2 groups of 2 ranks (world 4): group 1's rank 0 is SIGKILLed at step
    20, torchrun restarts both of its ranks, and they rejoin with group 0's shards, in-group rank
    r from rank r (parallel/replicas.py). Group 0's two processes keep stepping alone from step
    20; group 1 is back by step 40; at step 60 both groups' final.safetensors (gathered from
    the masters) are bit-identical. ZeRO-2 runs in the default suite; ZeRO-1 and ZeRO-3, the
    same code path (the gradient shards, zero_state's per-rank state dict), with ``-m slow``.

    The reference is one process (plain training on the whole global batch of 8), not a plain
    ZeRO world: by the data rule every configuration here (2 groups of 2 shares, 1 group of 2)
    trains each step on that same batch, so one process is the ground truth all of them are
    compared with, and it needs no spawned world. Tolerance rtol 1e-5, the DDP test's, for the
    same reason: the shares' mean gradients (reduce-scatter inside a group, then the lane's
    allreduce over the groups) are summed in another order than one batch's backward; measured
    here at most 3.5e-6 over the 60 steps (ZeRO-2)."""
    flags = _zero_flags(stage)
    run = _run_killed(tmp_path, flags, nproc=4, groups=2, killed=1)
    _check_killed_run(run, groups=2, ranks=2, killed=1, reference=_reference(flags), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_offloaded_zero3_groups_rejoin_with_their_shards(tmp_path):
    """ZeRO-3 with parameters, gradients, masters and Adam states on disk (``--offload disk
    --offload-params``) inside each of 2 groups of 2 ranks: the lane averages shards that live
    in the offload files, group 1 is SIGKILLed at step 20 and its restarted ranks load group
    0's shards into fresh offload files (zero_state's per-rank state dict), and at step 60 both
    groups' final weights are bit-identical and every loss is within rtol 1e-5 of one process
    (the ZeRO test's reasons). ``-m slow`` like the other stages' kills; the default suite
    retakes a failed vote with the same layout (test_a_failed_vote_leaves_every_stage_...)."""
    flags = [*_zero_flags(3), "--offload", "disk", "--offload-params", "--offload-dir",
             str(tmp_path / "offload")]
    run = _run_killed(tmp_path, flags, nproc=4, groups=2, killed=1)
    reference = _reference([f for i, f in enumerate(flags) if not f.startswith("--offload")
                            and not (i and flags[i - 1] == "--offload-dir")
                            and not (i and flags[i - 1] == "--offload")])
    _check_killed_run(run, groups=2, ranks=2, killed=1, reference=reference, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fp16_groups_rejoin_with_the_loss_scale(tmp_path):
    """fp16 (dynamic loss scaling) over 3 one-rank DDP groups, group 2 killed at step 20: the
    overflow check reads the gradients after they were averaged over the live groups, so every
    group skips the same steps and moves its scale alike, and the rejoining group takes the
    scale with the weights (ReplicaGroups._state); at step 60 every replica's weights are
    bit-identical, every group logged the same loss bit for bit at every step it took (the
    lane's average) and ends at the same scale, and the two groups that were never killed
    skipped the same steps. Not compared with one fp16 process: a share's backward (its loss
    the mean of fewer rows, times the same scale) overflows at other steps than the whole
    batch's, so the skipped steps, and with them the losses, differ (measured: up to 6%)."""
    flags = [*FLAGS, "--mixed-precision", "fp16"]
    run = _run_killed(tmp_path, flags, nproc=3, groups=3, killed=2)
    _check_killed_run(run, groups=3, ranks=1, killed=2, reference=None, rtol=0)
    summaries = []
    for g in range(3):
        with open(os.path.join(run, f"replica{g}", "summary.json")) as fh:
            summaries.append(json.load(fh))
    start = summaries[2]["start_step"]
    assert summaries[0]["losses"] == summaries[1]["losses"]
    assert summaries[2]["losses"] == summaries[0]["losses"][start:]
    assert all(math.isfinite(x) for x in summaries[0]["losses"])
    scales = [s_["loss_scale"] for s_ in summaries]
    assert len({s_["loss_scale"] for s_ in scales}) == 1, scales
    assert scales[0]["skipped_steps"] == scales[1]["skipped_steps"], scales


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_groups_rejoin_with_their_shards(tmp_path):
    """HSDP inside each of 2 groups of 4 ranks (world 8, ZeRO-2, --dp-shard 2: 2 replicas of
    2-rank shard groups per group): the lane of in-group rank r averages the shards the replica
    all-reduce left on it, group 1 is SIGKILLed at step 20 and rejoins rank r from rank r, and
    at step 60 both groups' final weights are bit-identical, every loss within rtol 1e-5 of one
    process (the ZeRO test's reasons). ``-m slow``: 8 processes on this machine's 2 cores."""
    flags = [*_zero_flags(2), "--dp-shard", "2"]
    run = _run_killed(tmp_path, flags, nproc=8, groups=2, killed=1)
    reference = _reference([f for i, f in enumerate(flags)
                            if f != "--dp-shard" and not (i and flags[i - 1] == "--dp-shard")])
    _check_killed_run(run, groups=2, ranks=4, killed=1, reference=reference, rtol=1e-5)


def _axis_flags(axis: str) -> list[str]:
    """FLAGS with ``axis`` (tp, pp or cp) of 2 inside each group of 2 ranks (DDP over the
    group's dp of 1), a batch of 8 (equal shares for 1 or 2 groups; under pp 2 micro-batches
    each)."""
    extra = {"tp": ["--tp", "2"], "pp": ["--pp", "2", "--num-microbatches", "2"],
             "cp": ["--cp", "2"]}[axis]
    flags = [*FLAGS[2:], *extra]
    flags[flags.index("--batch-size") + 1] = "8"
    return flags


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_tp_and_pp_groups_rejoin_with_their_pieces(tmp_path, axis):
    """Tensor parallelism (tp 2), a pipeline (pp 2) or context parallelism (cp 2, ring
    attention: every sequence cut over the group's two ranks) inside each of 2 groups of 2
    ranks (world 4): the groups average, lane by lane, in-group rank r's gradients (its tp
    slice, its stage's parameters after the flush, or under cp the gradients the group's
    dp x cp reduction left whole on every rank) over the live groups; group 1's rank 0 is
    SIGKILLed at step 20, torchrun restarts both of its ranks, and in-group rank r rejoins
    with rank r's state of group 0 (its slice, its stage). Group 0's two processes keep their
    pids and step alone from step 20; group 1 is back by step 40; at step 60 both groups'
    final.safetensors (the whole model, gathered over tp or the stages) are bit-identical.
    All with ``-m slow``: each takes 74-79 s here (the 60 paced steps are 45 s of it), over
    the default suite's budget for one test; the default suite checks the same hook, once a
    step, and its retake at dp 2 x tp 2, dp 2 x pp 2 and dp 2 x cp 2 in
    test_a_failed_vote_leaves_every_stage_ready_to_retake_the_step.

    The reference is one process on the whole global batch of 8 (the data rule; see the ZeRO
    test), rtol 1e-5 for the same reason: the shares' mean gradients are summed over the lane
    in another order than one batch's backward, and under tp each split layer's partial
    products are summed by g / f in another order too, under pp the micro-batches' losses and
    gradients accumulate in pieces (fp32); measured here at most 4.9e-6 (tp) and 7.0e-6 (pp)
    over the 60 steps."""
    flags = _axis_flags(axis)
    run = _run_killed(tmp_path, flags, nproc=4, groups=2, killed=1)
    _check_killed_run(run, groups=2, ranks=2, killed=1, reference=_reference(flags), rtol=1e-5)


# -- a stop: every group at one step boundary, one checkpoint; a resume starts every group ----
@pytest.mark.timeout(180)
def test_find_unused_counts_a_parameter_any_live_group_used(tmp_path):
    """``--find-unused`` across groups: DDP over 2 one-rank groups (where find_unused is on by
    itself: one rank has nothing to wait for) with a user model whose ``extra`` layer runs only
    on some rows (tests/user_models.RowBranchLM), so in some steps one group's rows use it and
    the other's do not. A parameter counts as used when any live group used it (the groups
    sum their flags over the lane with the gradients): every group steps it with the mean
    gradient, or none does, as one process on the whole batch. Before, each group decided
    alone, the one without the rows skipped the step the other took, and the replicas drifted
    apart. Checked: the two groups' final weights bit-identical, both groups' losses equal one
    process's within rtol 1e-5 (module docstring). On the code before (each group's own
    flags) the final weights differed."""
    from safetensors.torch import load_file
    import user_models
    flags = [*FLAGS[:FLAGS.index("--steps")], "--steps", "20",
             *FLAGS[FLAGS.index("--steps") + 2:], "--model", "user_models:row_branch_lm"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(user_models.__file__),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *flags, "--nproc-per-node", "2",
           "--ft-replicas", "2", "--collective-timeout", "60", "--out-dir", str(tmp_path),
           "--run-name", "ft"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    params = [load_file(str(tmp_path / "ft" / f"replica{g}" / "final.safetensors"))
              for g in (0, 1)]
    assert params[0].keys() == params[1].keys() and "extra.weight" in params[0]
    assert all(torch.equal(params[1][k], params[0][k]) for k in params[0])
    reference = torch.tensor(_reference(flags), dtype=torch.float64)
    for g in (0, 1):
        losses = torch.tensor(_metric_losses(str(tmp_path / "ft" / f"replica{g}")),
                              dtype=torch.float64)
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


@pytest.mark.timeout(180)
def test_running_statistics_are_the_first_live_groups(tmp_path):
    """A model with BatchNorm (tests/user_models.BatchNormLM) in 2 one-rank groups: DDP gives
    every forward data-parallel rank 0's running statistics, so across groups every group
    must hold the first live group's (the lane carries them with the gradients), or each
    group evaluates with statistics of its own rows only. Checked: every evaluation's loss is
    the same in both groups (it reads the running statistics), and equal to a run without
    groups at world 2 (its rank 0 trains on the rows group 0 does) within rtol 1e-5."""
    import user_models
    flags = [*FLAGS[:FLAGS.index("--steps")], "--steps", "12",
             *FLAGS[FLAGS.index("--steps") + 2:], "--model", "user_models:batchnorm_lm"]
    flags[flags.index("--eval-every") + 1] = "3"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(user_models.__file__),
                                          os.environ.get("PYTHONPATH", "")])}
    base = [sys.executable, "-m", "shardwise.cli", "train", *flags, "--nproc-per-node", "2",
            "--collective-timeout", "60", "--out-dir", str(tmp_path)]
    for extra, name in ((["--ft-replicas", "2"], "ft"), ([], "plain")):
        done = subprocess.run([*base, *extra, "--run-name", name], env=env,
                              capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]

    def evals(folder) -> list[float]:
        with open(os.path.join(folder, "metrics.jsonl")) as fh:
            return [r["val_loss"] for r in map(json.loads, fh) if r.get("val_loss") is not None]
    groups = [evals(str(tmp_path / "ft" / f"replica{g}")) for g in (0, 1)]
    plain = evals(str(tmp_path / "plain"))
    assert len(groups[0]) == len(plain) >= 4
    assert groups[0] == groups[1]
    torch.testing.assert_close(torch.tensor(groups[0], dtype=torch.float64),
                               torch.tensor(plain, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.slow            # 16 s; the default suite keeps the sync stop test's checkpoints
@pytest.mark.timeout(180)
def test_move_last_is_the_writer_groups_and_resumes(tmp_path):
    """``--checkpoint-move-last`` under groups: ZeRO-2 with ``--offload disk`` in 2 one-rank
    groups; at the end only the writer group (the lowest-id live one) moves its offload files
    into the last checkpoint (two groups moving into one folder would clobber each other), the
    other writes nothing; the folder holds that one checkpoint, of a group's world (1 rank),
    and ``--resume`` starts both groups from it, ending bit-identical."""
    from safetensors.torch import load_file
    flags = [f for f in _zero_flags(2) if f not in ("--bucket-mb", "0.05")]  # dp 1 per group
    flags[flags.index("--steps") + 1] = "6"
    flags += ["--offload", "disk", "--nproc-per-node", "2", "--ft-replicas", "2",
              "--collective-timeout", "60", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--checkpoint-move-last", "--out-dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *flags]
    done = subprocess.run([*cmd, "--run-name", "moved"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-6"]
    with open(tmp_path / "ckpt" / "step-6" / "meta.json") as fh:
        assert json.load(fh)["world_size"] == 1
    cmd[cmd.index("--steps") + 1] = "8"
    done = subprocess.run([*cmd, "--resume", "--run-name", "resumed"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    params = [load_file(tmp_path / "resumed" / f"replica{g}" / "final.safetensors")
              for g in (0, 1)]
    assert all(torch.equal(params[1][k], params[0][k]) for k in params[0])
    for g in (0, 1):
        with open(tmp_path / "resumed" / f"replica{g}" / "summary.json") as fh:
            assert json.load(fh)["start_step"] == 6


def _metric_losses(folder: str) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("save", [pytest.param([], marks=pytest.mark.slow),
                                  ["--checkpoint-async"]], ids=["sync", "async"])
def test_stop_saves_one_checkpoint_and_every_group_resumes_from_it(tmp_path, save):
    """ZeRO-2 in 2 groups of 2 ranks, 30 steps of PACE_STOP s each (so that the signal lands
    mid-run), ``--checkpoint-dir``: SIGTERM to the launcher once group 1 logged 8 steps. Every
    group stops at the same step N (agreed in the quorum: parallel/replicas.py), the launcher
    exits 143 with one ``stopped at step N`` line, and the folder holds exactly one
    checkpoint, step-N, written by one group (its world is a group's 2 ranks). ``--resume``
    then starts both groups from step N; they end bit-identical, and the losses of both
    halves equal one process's uninterrupted run within rtol 1e-5 (the reason and the measured
    size in test_zero_groups_rejoin_with_their_shards; the resume itself is exact). With
    ``--checkpoint-async`` the stop's save is written in the background and every group
    waits for it before it leaves: the same one checkpoint, complete (every file matches its
    checksum in meta.json); the resume, the same code as above, is not repeated."""
    from safetensors.torch import load_file
    flags = _zero_flags(2)
    flags[flags.index("--steps") + 1] = "30"
    flags += ["--nproc-per-node", "4", "--ft-replicas", "2", "--collective-timeout", "60",
              "--checkpoint-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path), *save]
    env = {**os.environ, "SHARDWISE_FT_TEST_PACE": str(PACE_STOP), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *flags]
    proc = subprocess.Popen([*cmd, "--run-name", "stopped"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watched = tmp_path / "stopped" / "replica1" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (watched.exists() and len(watched.read_text().splitlines()) >= 8):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and err.startswith("stopped at step "), err
    n = int(err.split()[3].rstrip(";"))
    assert 8 <= n < 30
    for g in (0, 1):
        folder = str(tmp_path / "stopped" / f"replica{g}")
        with open(os.path.join(folder, "stopped.json")) as fh:
            assert json.load(fh)["step"] == n
        assert len(_metric_losses(folder)) == n
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", f"step-{n}"]
    with open(tmp_path / "ckpt" / f"step-{n}" / "meta.json") as fh:
        assert json.load(fh)["world_size"] == 2
    if save:        # --checkpoint-async: published, and intact file by file
        from shardwise.checkpoint import store
        assert store.damage(str(tmp_path / "ckpt" / f"step-{n}")) is None
        return
    done = subprocess.run([*cmd, "--resume", "--run-name", "resumed"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "resumed"
    params = [load_file(run / f"replica{g}" / "final.safetensors") for g in (0, 1)]
    assert all(torch.equal(params[1][k], params[0][k]) for k in params[0])
    reference = torch.tensor(_reference(flags[:flags.index("--nproc-per-node")]),
                             dtype=torch.float64)
    first = torch.tensor(_metric_losses(str(tmp_path / "stopped" / "replica0")),
                         dtype=torch.float64)
    torch.testing.assert_close(first, reference[:n], rtol=1e-5, atol=0)
    for g in (0, 1):
        with open(run / f"replica{g}" / "summary.json") as fh:
            summary = json.load(fh)
        assert summary["start_step"] == n
        torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64),
                                   reference[n:], rtol=1e-5, atol=0)
