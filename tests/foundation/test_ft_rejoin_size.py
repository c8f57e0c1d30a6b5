"""``--ft-rejoin-nproc N``: a replica group that lost a rank rejoins at another size
(docs/checkpoints.md, "Rejoining at another size").

The must-show (``-m slow``): DDP as 2 groups of 2 ranks (world 4), ``--ft-rejoin-nproc 1
--max-restarts 2``. Group 1's rank 0 SIGKILLs itself at the start of step KILL_STEP (the test
hook of tests/foundation/test_ft_replicas.py, SHARDWISE_FT_TEST_KILL); torchrun's agent ends
that group (it has no restarts of its own), shardwise's launcher starts it again with one
rank, and the restart waits AWAY rounds before it rejoins. Checked: group 0's two processes
are never relaunched (one start each, the same pids) and step without group 1 from KILL_STEP;
group 1 comes back as one process (restart 1, one rank) that joins with group 0's state; at
the end both groups' final.safetensors are bit-identical; every loss either group logged
equals one process on the whole global batch within rtol 1e-5. The same the other way round
(2 one-rank groups, group 1 back with two ranks: its second rank takes the state, and every
step the weighted sum, from its leader's broadcast). And with ZeRO inside the groups (ZeRO-2
as 2 x 2 back with 1, ZeRO-3 as 2 x 1 back with 2): each group gathers its gradient shards
into whole chunks for the leaders' sum and scatters the result back, and the joiner loads its
own shards of the source group's layout-free state (parallel/data/zero_resize.py); the same
checks and the same tolerance (the same sums, up to their order). And groups that keep their
pieces of the model and change their dp size (2 groups of 2 ranks, group 1 back at 4): tp 2,
tp 2 with ZeRO-2 clipped, pp 2 (DDP and ZeRO-1), cp 2, ZeRO-2 back as HSDP; ZeRO with
--offload cpu and with --offload disk --offload-params; a restart under --checkpoint-dir that
resumes a checkpoint of another world first; Hugging Face Llama (tp 2) and GPT-2 (tied,
ZeRO-3).

The losses. The data rule (replicas_checks.share) cuts each step's global batch of 12 into
one slice per live dp rank (4 slices with 2 + 2 ranks, 2 with group 0 alone, 3 with 2 + 1),
and the leaders sum each group's mean gradient weighted by its dp size, divided by the total:
the whole batch's mean gradient up to the order of summation (and the division by 3, which
rounds). The tolerance is rtol 1e-5 on fp32 losses for that reason, at lr 3e-3: at the other
tests' lr 1e-2, AdamW amplifies that rounding on this configuration to about 2e-4 within 30
steps. Both figures were found by simulating the same splits in one process (the per-step
deviations of a launched run at lr 1e-2 matched the simulation's step for step, so they are
rounding, not a wrong weight); at lr 3e-3 the simulation stays near 2e-7 over 60 steps for
any rejoin step from 14 to 40. 60 paced steps (45 s) leave the killed group's teardown and
restart time to rejoin before the end, as in test_ft_replicas.py.

The default suite checks what needs no launch: the data rule and every reachable live total
as pure functions, the quorum carrying each group's size (a real store: a 2-rank and a 1-rank
group decide one round together), a joining leader's broadcast of the state over its group (a
forked world of 2), a rank's config in a group restarted at another size, ZeRO-3's (with
-m slow also ZeRO-2's) whole gradients and layout-free state across a group of 2 and one of 3
(forked worlds), and the refusals (one line, exit 2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from shardwise import cli
from shardwise.comm import quorum as q
from shardwise.comm.quorum import Decision, Quorum, propose
from shardwise.parallel import replicas_checks as rc
from test_ft_replicas import FLAGS, _events, _reference

STEPS, KILL_STEP, AWAY, PACE = 60, 10, 4, 0.75


# -- the data rule and the batch check's totals (pure) ---------------------------------------
def test_share_gives_each_live_dp_rank_one_slice_in_group_order():
    """Groups sorted by id, each rank's slice after the dp ranks of the groups before it: the
    slices cover 0..total-1 once, whatever the sizes (so no row is skipped or repeated)."""
    for members, sizes in (((0, 1), (2, 1)), ((0, 1, 2), (1, 2, 3)), ((1, 3), (2, 2)),
                           ((2,), (1,))):
        got = [rc.share(members, sizes, g, d) for g, n in zip(members, sizes) for d in range(n)]
        assert [i for i, _ in got] == list(range(sum(sizes)))
        assert {c for _, c in got} == {sum(sizes)}
    assert rc.share((0, 1), (2, 2), 1, 1) == (3, 4)     # equal sizes: slice i*g + d of L*g


def test_live_totals_cover_every_combination_of_sizes():
    """1 to R live groups, each at its launch size or (after a restart) at the rejoin size."""
    assert rc.live_totals(2, 2, 1) == [1, 2, 3, 4]
    assert rc.live_totals(3, 2, 0) == [2, 4, 6]               # no rejoin: L x g only
    assert rc.live_totals(2, 2, 2) == [2, 4]
    assert rc.live_totals(3, 1, 2) == sorted({k + 2 * (n - k) for n in (1, 2, 3)
                                              for k in range(n + 1)})


# -- the quorum carries each group's size ------------------------------------------------------
def test_decision_carries_sizes_and_a_size_change_is_a_new_link():
    first = propose(0, {0: (0, False, True), 1: (0, False, True)}, None, sizes={0: 2, 1: 2})
    assert first.sizes == (2, 2) and first.even and first.size_of(1) == 2
    lost = propose(1, {0: (1, True, False)}, first, sizes={0: 2})
    back = propose(2, {0: (2, True, False), 1: (0, False, True)}, lost, sizes={0: 2, 1: 1})
    assert (back.sizes, back.even, back.link, back.source) == ((2, 1), False, 2, 0)
    assert Decision.decode(2, back.encode()) == back
    same = propose(3, {0: (3, True, False), 1: (3, True, False)}, back, sizes={0: 2, 1: 1})
    assert same.link == back.link                   # same members and sizes: the same link


@pytest.mark.timeout(60)
def test_a_round_waits_for_every_rank_of_each_groups_own_size(monkeypatch):
    """On a real store: group 0 has 2 ranks, group 1 one (a group restarted at another size).
    Round 0 is decided only once group 0's second rank registered too, and every rank reads
    one decision with sizes (2, 1); the vote waits for the 3 ranks of both groups."""
    monkeypatch.setattr(q, "HEARTBEAT_S", 0.1)
    server = q.serve()
    address = f"127.0.0.1:{server.port}"
    clients = [Quorum(address, 0, 0, 2, 2, 30), Quorum(address, 0, 1, 2, 2, 30),
               Quorum(address, 1, 0, 1, 2, 30)]
    out: dict[int, Decision] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, clients[i].round(
        0, 0, synced=False, fresh=True, bound=30))) for i in (0, 2)]
    for t in threads:
        t.start()
    threads[0].join(0.5)
    assert not out, out              # group 0's rank 1 has not registered: nothing decided
    late = threading.Thread(target=lambda: out.__setitem__(1, clients[1].round(
        0, 0, synced=False, fresh=True, bound=30)))
    late.start()
    for t in (*threads, late):
        t.join(30)
    assert len(set(out.values())) == 1 and out[0].sizes == (2, 1) and out[0].members == (0, 1)
    votes: dict[int, bool] = {}
    voters = [threading.Thread(target=lambda i=i: votes.__setitem__(i, clients[i].vote(
        out[0], True, bound=30))) for i in range(3)]
    for t in voters:
        t.start()
    for t in voters:
        t.join(30)
    assert votes == {0: True, 1: True, 2: True}
    for c in clients:
        c.close()


def _broadcast_a_state(rank: int, n: int) -> dict:
    """Member 0 of the world holds a state (a model's, an optimizer's, the RNG's); the others
    receive it by comm/replicas.broadcast_state."""
    from shardwise.comm.collectives import Comm
    from shardwise.comm.replicas import broadcast_state
    from shardwise.mesh import Mesh
    state = None
    if rank == 0:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        state = {"strategy": {"model": model.state_dict(), "optimizer": opt.state_dict()},
                 "rng": torch.get_rng_state()}
    return broadcast_state(Comm(), Mesh.build(1, n, 1).world, state)


@pytest.mark.timeout(60)
def test_a_joining_leader_broadcasts_the_state_over_its_group():
    """A joining group of several ranks: its leader's state reaches every rank whole (the
    same tensors bit for bit, optimizer state included)."""
    from harness import run_world
    got = run_world(_broadcast_a_state, 2, timeout=50)
    flat = [torch.cat([v.reshape(-1).float() for v in s["strategy"]["model"].values()]
                      + [v.reshape(-1).float() for st in s["strategy"]["optimizer"]["state"]
                         .values() for v in st.values()] + [s["rng"].float()]) for s in got]
    assert torch.equal(flat[0], flat[1])


def test_a_rank_of_a_resized_group_gets_its_own_config(monkeypatch):
    """In a rank the launcher restarted (SHARDWISE_FT_RESTART 1) under --ft-rejoin-nproc 1:
    one process, dp 1 (the launcher's groups had 2); a rank of a 2-rank group keeps dp 2 and
    has find_unused on (its used flags travel over the lane like the one-rank group's)."""
    cfg, _ = cli.parse_config(["--nproc-per-node", "4", "--dp", "4", "--ft-replicas", "2",
                               "--ft-rejoin-nproc", "1", "--max-restarts", "1"])
    monkeypatch.setenv(rc.ENV_GROUP, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    first = rc.group_config(cfg).parallel
    assert (first.nproc_per_node, first.dp, first.find_unused) == (2, 2, True)
    monkeypatch.setenv(rc.ENV_RESTART, "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    again = rc.group_config(cfg).parallel
    assert (again.nproc_per_node, again.dp, again.find_unused) == (1, 1, False)
    assert rc.resized(cfg) and rc.group_restarts() == 1
    # a group under tp 2 x pp 2 restarted at 8 ranks keeps its pieces: dp 2 (it had 1)
    cfg, _ = cli.parse_config(["--nproc-per-node", "8", "--tp", "2", "--pp", "2", "--dp", "2",
                               "--num-microbatches", "2", "--ft-replicas", "2",
                               "--ft-rejoin-nproc", "8", "--max-restarts", "1"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    tp_pp = rc.group_config(cfg).parallel
    assert (tp_pp.nproc_per_node, tp_pp.dp, tp_pp.tp, tp_pp.pp) == (8, 2, 2, 2)


# -- ZeRO at another size: whole gradients and the layout-free state (zero_resize.py) ----------
class _WholeGradients:
    """A stand-in for ReplicaGroups' hook on groups of different sizes: it gathers each chunk's
    whole gradient on rank 0 (None elsewhere), scatters it back, and records whether the shards
    came back bit for bit and the whole gradient's squares (which clipping then uses; rank 0
    also an fp64 sum of its wholes' squares)."""

    def __init__(self, strategy):
        self.strategy, self.same, self.sq = strategy, [], []

    def reduce(self, buffers: list[torch.Tensor]) -> None:
        before = [b.clone() for b in buffers]
        wholes = self.strategy.gather_grad_shards()
        assert (wholes is not None) == (self.strategy.group.rank == 0)
        self.strategy.scatter_grad_shards(None if wholes is None else
                                          [w.clone() for w in wholes])
        self.same.append(all(torch.equal(a, b) for a, b in zip(before, buffers)))
        self.sq.append((float(self.strategy._whole_sq), None if wholes is None else
                        sum(float(w.double().square().sum()) for w in wholes)))


def _zero_at_size(rank: int, n: int, stage: int, state: dict | None) -> dict:
    """ZeRO-``stage`` on the tiny GPT (~2 KB buckets: several chunks, each padded to n).
    Without ``state``: 2 steps through the whole-gradient hook, then the layout-free state.
    With it: load it (another world size), then the layout-free state again."""
    import shardwise
    from reference import tiny_config
    from shardwise.models import build_model
    from shardwise.run.api import optimizer_factory
    from dataclasses import replace
    cfg = tiny_config(f"zero{stage}", steps=2, bucket_mb=0.002)
    cfg = replace(cfg, train=replace(cfg.train, batch_size=6))     # splits over 2 or 3 ranks
    engine = shardwise.prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg)
    zero, hook = engine.strategy, None
    if state is None:
        hook = zero.ft = _WholeGradients(zero)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randint(0, cfg.model.vocab_size, (6, 16), generator=g)
            zero.train_step(*engine.shard(x, torch.roll(x, -1, 1)))
    else:
        zero.load_layout_free_state(state)
    out = {"state": zero.layout_free_state(), "params": engine.full_state_dict(),
           "hook": None if hook is None else (hook.same, hook.sq)}
    engine.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_state_and_gradients_cross_group_sizes(stage):
    """A ZeRO group of 2 ranks (chunks padded to 2) trains 2 steps: its whole gradients
    gathered on rank 0 and scattered back leave every shard bit-identical, and their squares
    equal the whole gradient's (fp64 reference: rtol 1e-5, fp32 accumulation) on both ranks
    to the bit; its layout-free
    state, loaded by a group of 3 ranks (other padding, other shard bounds), gives back the
    same parameters, optimizer state and buffers bit for bit. ZeRO-3 (units, each padded)
    in the default suite (about 5 s); ZeRO-2, the same functions over buckets, with -m slow."""
    from harness import run_world
    source = run_world(_zero_at_size, 2, stage, None, timeout=100)
    leader = source[0]["hook"][1]
    for got, want in leader:
        assert got == pytest.approx(want, rel=1e-5)
    for result in source:
        same, squares = result["hook"]
        assert same == [True, True]
        assert [got for got, _ in squares] == [got for got, _ in leader]   # bit for bit
    state = source[0]["state"]
    joined = run_world(_zero_at_size, 3, stage, state, timeout=100)
    for result in joined:
        for name, value in source[0]["params"].items():
            assert torch.equal(result["params"][name], value), name
        for name, entry in state["optimizer"].items():
            got = result["state"]["optimizer"][name]
            assert got.keys() == entry.keys() and all(torch.equal(got[k], v)
                                                      for k, v in entry.items()), name
        for name, value in state["buffers"].items():
            assert torch.equal(result["state"]["buffers"][name], value), name


# -- refusals: one line, exit 2 ----------------------------------------------------------------
GROUPS = ["--nproc-per-node", "4", "--ft-replicas", "2", "--max-restarts", "1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, field, words", [
    (["--ft-rejoin-nproc", "1", "--max-restarts", "1"], "parallel.ft_rejoin_nproc",
     "restarts a replica group, and there are none"),
    (["--nproc-per-node", "4", "--ft-replicas", "2", "--ft-rejoin-nproc", "1",
      "--batch-size", "12"], "parallel.ft_rejoin_nproc", "--max-restarts is 0"),
    ([*GROUPS, "--ft-rejoin-nproc", "-1"], "parallel.ft_rejoin_nproc", "is negative"),
    ([*GROUPS, "--tp", "2", "--ft-rejoin-nproc", "1", "--batch-size", "12"],
     "parallel.ft_rejoin_nproc", "keeps its pieces of the model (tp 2 = 2 ranks per "
     "data-parallel rank) and changes only its dp size, and 1 is not a multiple of 2; fix: "
     "give a multiple of 2, or 2 (a group's own size)"),
    ([*GROUPS, "--pp", "2", "--num-microbatches", "2", "--ft-rejoin-nproc", "3",
      "--batch-size", "24"], "parallel.ft_rejoin_nproc", "(pp 2 = 2 ranks per"),
    (["--nproc-per-node", "8", "--ft-replicas", "2", "--max-restarts", "1", "--tp", "2",
      "--cp", "2", "--ft-rejoin-nproc", "2", "--batch-size", "12"],
     "parallel.ft_rejoin_nproc", "(tp 2 x cp 2 = 4 ranks per"),
    (["--strategy", "zero2", "--nproc-per-node", "8", "--dp-shard", "2", "--ft-replicas", "2",
      "--max-restarts", "1", "--ft-rejoin-nproc", "3", "--batch-size", "168"],
     "parallel.dp_shard", "in a replica group restarted at 3 rank(s) (--ft-rejoin-nproc)"),
    ([*GROUPS, "--ft-rejoin-nproc", "1", "--batch-size", "8"], "parallel.ft_replicas",
     "x 2 or 1 (--ft-rejoin-nproc) rank(s) each x grad_accum 1; fix: use a --batch-size that "
     "is a multiple of 12"),
    ([*GROUPS, "--ft-rejoin-nproc", "1", "--batch-size", "12", "--bucket-mb", "1"],
     "parallel.bucket_mb", "in a replica group restarted at 1 rank(s) (--ft-rejoin-nproc)"),
    ([*GROUPS, "--ft-rejoin-nproc", "1", "--batch-size", "12", "--optimizer", "adamw8bit",
      "--checkpoint-dir", "{tmp}"], "parallel.ft_rejoin_nproc", "8-bit AdamW"),
])
def test_refused_in_one_line(flags, field, words, capsys, tmp_path):
    flags = [f.replace("{tmp}", str(tmp_path / "ckpt")) for f in flags]
    code = cli.main(["train", "--device", "cpu", "--steps", "2", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {field}") and words in err, err


# -- the must-show: group 1 killed, back with one rank -----------------------------------------
def _flags() -> list[str]:
    """FLAGS (test_ft_replicas.py) for STEPS steps, a batch of 12 (lcm of every live total
    1..4 dp ranks), lr 3e-3 (module docstring)."""
    flags = list(FLAGS)
    for name, value in (("--steps", STEPS), ("--batch-size", 12), ("--lr", "3e-3")):
        flags[flags.index(name) + 1] = str(value)
    return flags


def _plain(flags: list[str]) -> list[str]:
    """The flags one process takes for the reference: without ZeRO's, HSDP's or offload's
    (_reference drops the strategy and the axes)."""
    pairs = ("--zero-stage", "--dp-shard", "--offload", "--checkpoint-dir", "--checkpoint-every")
    single = ("--offload-params",)
    return [f for i, f in enumerate(flags)
            if f not in pairs + single and not (i and flags[i - 1] in pairs)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, nproc, size, rejoin, extra", [
    ("ddp", 4, 2, 1, []), ("ddp", 2, 1, 2, []), ("zero2", 4, 2, 1, []), ("zero3", 2, 1, 2, []),
    ("zero1", 4, 2, 1, ["--grad-clip", "0.05"]),
    (None, 4, 2, 4, ["--tp", "2"]),
    (None, 4, 2, 4, ["--tp", "2", "--zero-stage", "2", "--grad-clip", "0.05"]),
    (None, 4, 2, 4, ["--pp", "2", "--num-microbatches", "2", "--zero-stage", "1",
                     "--batch-size", "24"]),
    (None, 4, 2, 4, ["--cp", "2"]),
    (None, 4, 2, 4, ["--pp", "2", "--num-microbatches", "2", "--batch-size", "24"]),
    (None, 4, 2, 4, ["--zero-stage", "2", "--dp-shard", "2", "--batch-size", "24"]),
    ("zero2", 4, 2, 1, ["--offload", "cpu"]),
    ("zero3", 2, 1, 2, ["--offload", "disk", "--offload-params"]),
    ("ddp", 4, 2, 1, ["--checkpoint-dir", "{tmp}", "--checkpoint-every", "4"]),
    (None, 4, 2, 4, ["--model", "hf:llama", "--tp", "2"]),
    ("zero3", 2, 1, 2, ["--model", "hf:gpt2"])],
    ids=["2x2-back-with-1", "2x1-back-with-2", "zero2-2x2-back-with-1", "zero3-2x1-back-with-2",
         "zero1-clipped-2x2-back-with-1", "tp2-back-at-dp2", "zero2-tp2-clipped-back-at-dp2",
         "zero1-pp2-back-at-dp2", "cp2-back-at-dp2", "pp2-back-at-dp2",
         "zero2-2x2-back-as-hsdp-2x2", "zero2-offload-cpu-2x2-back-with-1",
         "zero3-offload-disk-params-2x1-back-with-2", "checkpoints-2x2-back-with-1",
         "hf-llama-tp2-back-at-dp2", "hf-gpt2-tied-zero3-2x1-back-with-2"])
def test_a_group_rejoins_at_another_size(tmp_path, strategy, nproc, size, rejoin, extra):
    """Module docstring: 2 DDP groups of 2 ranks, group 1 back with one rank; and the other
    way, 2 one-rank groups, group 1 back with two ranks (its second rank gets the state from
    its leader's broadcast, and takes the weighted sum's broadcast every step). The same with
    ZeRO-2 (2x2, back with 1) and ZeRO-3 (2x1, back with 2) inside the groups: the leaders
    sum each group's whole gradient (its shards gathered in the group, parallel/data/
    zero_resize.py) and the joiner loads its own shards of the source group's layout-free
    state; the same tolerance, since the sums are the same up to their order. ZeRO-1 with
    ``--grad-clip`` small enough to clip every step: every group clips by the whole gradient's
    norm (zero_resize.scatter_grads' squares), as one process does."""
    from safetensors.torch import load_file
    flags = _flags() + [f.replace("{tmp}", str(tmp_path / "ckpt")) for f in extra]
    at = flags.index("--strategy")
    if strategy is None:            # the axis flags (and --zero-stage) compose alone
        del flags[at:at + 2]
    else:
        flags[at + 1] = strategy
    env = {**os.environ, "SHARDWISE_FT_TEST_KILL": f"1:{KILL_STEP}:{AWAY}",
           "SHARDWISE_FT_TEST_PACE": str(PACE), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *flags, "--nproc-per-node",
           str(nproc), "--ft-replicas", "2", "--ft-rejoin-nproc", str(rejoin), "--max-restarts",
           "2", "--collective-timeout", "60", "--out-dir", str(tmp_path), "--run-name", "ft"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"replica group 1: torchrun exited with 1; restarting it with {rejoin} rank(s) " \
        "(restart 1 of 2)" in done.stderr, done.stderr[-3000:]
    if "--checkpoint-dir" in flags:     # group 1 at 1 rank resumed a checkpoint of 2 first
        assert "resharded into this layout" in done.stdout + done.stderr, done.stdout[-3000:]
    run = str(tmp_path / "ft")
    survivors = [e for e in _events(run, 0) if e["event"] == "start"]
    assert sorted((e["rank"], e["restart"], e["ranks"]) for e in survivors) == \
        [(r, 0, size) for r in range(size)]           # group 0: never relaunched
    assert {e["pid"] for e in _events(run, 0) if e["rank"] == 0} == \
        {e["pid"] for e in survivors if e["rank"] == 0}
    changes = [(e["step"], e["members"]) for e in _events(run, 0) if e["event"] == "members"]
    assert changes[0] == (KILL_STEP, [0]) and changes[1][1] == [0, 1], changes
    back = changes[1][0]
    assert KILL_STEP + AWAY <= back < STEPS, changes
    events = _events(run, 1)
    starts = [(e["rank"], e["restart"], e["ranks"]) for e in events if e["event"] == "start"]
    assert sorted(starts) == sorted([(r, 0, size) for r in range(size)]
                                    + [(r, 1, rejoin) for r in range(rejoin)]), starts
    restarted = next(e["pid"] for e in events if e["event"] == "start" and e["restart"] == 1
                     and e["rank"] == 0)
    join = [e for e in events if e["event"] == "join"][-1]
    assert (join["step"], join["pid"]) == (back, restarted)
    params = [load_file(os.path.join(run, f"replica{g}", "final.safetensors")) for g in (0, 1)]
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    reference = torch.tensor(_reference(_plain(flags)), dtype=torch.float64)
    for g in (0, 1):
        with open(os.path.join(run, f"replica{g}", "summary.json")) as fh:
            summary = json.load(fh)
        start = summary["start_step"]
        assert start == (back if g else 0) and len(summary["losses"]) == STEPS - start
        torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64),
                                   reference[start:], rtol=1e-5, atol=0)
