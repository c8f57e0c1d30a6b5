"""Replica groups that survive a lost rank (``--ft-replicas R``), after torchft's design.

Partition: the data-parallel world is R replica groups, each a world of its own (its own
torchrun, its own process group, its own layout inside: DDP today), all holding the whole
training state. Each step the live groups agree on who takes part (the quorum, through the
launcher's store: comm/quorum.py), train on equal shares of the step's global batch, and
average their gradients over the live groups only.

Data rule: the global batch of step s is the one a run without ``--ft-replicas`` takes (a pure
function of seed and step: data/sampler.py); with L live groups of g ranks each, the group at
position i among the members (sorted by id) and its dp rank d take rows (i*g + d) of L*g equal
slices. So every step trains on the whole global batch, whatever the live count: no batch is
skipped or repeated, and the losses equal an uninterrupted run's up to the order of summation.

Collectives, per step: the group's own gradient reduction (DDP's allreduce over its dp group),
then, when two or more groups are live, one allreduce (sum) over the lane of this in-group rank
(comm/replicas.py) of [the gradient buckets | this rank's loss], divided by L; then every rank
of every member votes (comm/quorum.py), and the optimizer steps only when all succeeded. A peer
lost mid-step makes the vote fail everywhere: the survivors form a new quorum for the same step
and redo it on their new shares (no step is lost, none is applied twice). A synced group left
out of a quorum (its heartbeat stopped for a while) leaves with an error; its launcher restarts
it. A group that (re)starts joins at a step boundary: the lowest-id synced member sends it its
whole state (the strategy's state dict and the RNG state) over the new link, and it continues
from that member's step, so every replica's parameters are bit-identical afterwards.

Memory: one flat fp32 copy of the gradients (the cross-group buffer) plus the serialised state
while a join is served. Traffic per step: 2(L-1)/L x 4P bytes per rank over the lane, and
the state (model + optimizer, about 12P bytes with Adam) once to each joining group.

Reference: torchft (PyTorch), "Fault Tolerance for Large Scale Training" (the quorum, the
per-step commit, recovery from a live peer).
"""
from __future__ import annotations

import json
import os
import signal
import time

import torch

from shardwise.comm.collectives import CollectiveError
from shardwise.comm.quorum import Decision, Quorum
from shardwise.comm.replicas import ReplicaLink

# test hook "G:STEP:AWAY": group G's rank 0 SIGKILLs itself at the start of step STEP (its first
# attempt), and its restart waits until the others took AWAY more rounds before it rejoins (a
# slow restart, on a clock of steps: a fast machine cannot rejoin before the others noticed)
ENV_KILL = "SHARDWISE_FT_TEST_KILL"
ENV_PACE = "SHARDWISE_FT_TEST_PACE"   # test hook: each step lasts at least this many seconds


class Redo(RuntimeError):
    """The step's cross-group reduction did not commit on every member: take it again."""


class LeftOut(CollectiveError):
    """This synced group was left out of a quorum: it leaves, and its launcher restarts it."""


class ReplicaGroups:
    """This rank's part in the replica groups (module docstring)."""

    def __init__(self, strategy, quorum: Quorum, group: int, timeout: float, run_dir: str):
        self.strategy, self.quorum, self.group, self.timeout = strategy, quorum, group, timeout
        self.lane, self.ranks = strategy.mesh.rank, quorum.ranks
        self.run_dir = run_dir
        self.n, self.synced, self.fresh = 0, False, True
        self.link, self.link_id = None, None
        self.current: Decision | None = None
        self.pending: Decision | None = None
        self.flat, self.loss = None, None
        self.kill_at, self.hold_until = self._kill_hook()
        self.pace = float(os.environ.get(ENV_PACE) or 0)
        strategy.replicas = self          # the component's _finish_grad_sync calls reduce()

    # -- joining --------------------------------------------------------------------------
    def join(self, start: int) -> int:
        """Rounds until this group is a member; take the source's state; return its step."""
        self._event("start", step=start, restart=int(os.environ.get(
            "TORCHELASTIC_RESTART_COUNT") or 0))
        while self.hold_until is not None and self.quorum.latest() < self.hold_until \
                and not self.quorum.finished():
            time.sleep(0.05)
        self.n = self.quorum.first_open_round()
        while True:
            d = self.quorum.round(self.n, start, synced=False, fresh=True, bound=self.timeout)
            self.n = d.round + 1
            if self.group in d.members and self._use(d):
                break
        self.synced, self.fresh, self.pending = True, False, d
        self._event("join", step=d.step, members=list(d.members))
        return d.step

    # -- one step -------------------------------------------------------------------------
    def train_step(self, step: int, batch) -> tuple[float, object, object]:
        """One committed step on this rank's share: (global loss, x, y). ``batch(index,
        count)`` gives this rank's rows of the step's global batch."""
        self._hooks(step)
        began = time.monotonic()
        while True:
            d = self._round(step)
            if d is None:
                continue
            g = self.strategy.mesh.dp
            x, y = batch(d.members.index(self.group) * g + self.strategy.mesh.dp_rank,
                         len(d.members) * g)
            self.current = d
            try:
                loss = self.strategy.train_step(x, y)
            except Redo:
                self.strategy.zero_grad()
                self.fresh = True
                continue
            break
        if self.pace:
            time.sleep(max(0.0, self.pace - (time.monotonic() - began)))
        if g == 1 or len(d.members) == 1:
            return (float(self.loss) if self.loss is not None else loss), x, y
        return self.strategy.reduce_mean(self.loss), x, y

    def _round(self, step: int) -> Decision | None:
        """This step's decision (the join's, or a new round); None: take another round."""
        if self.pending is not None:
            d, self.pending = self.pending, None
            return d
        prev = self.current.members if self.current is not None else None
        d = self.quorum.round(self.n, step, synced=True, fresh=self.fresh, bound=self.timeout)
        self.n = d.round + 1
        if self.group not in d.members:
            raise LeftOut("ft_quorum", RuntimeError(
                f"replica group {self.group} was left out of the quorum at step {step} "
                f"(members {list(d.members)}); it leaves and its launcher restarts it"))
        if d.step != step:
            raise LeftOut("ft_quorum", RuntimeError(
                f"replica group {self.group} is at step {step} but the quorum at {d.step}"))
        if not self._use(d):
            return None
        self.fresh = False
        if d.members != prev:
            self._event("members", step=step, members=list(d.members))
        return d

    def _use(self, d: Decision) -> bool:
        """The decision's link (built when new) and the state copy to joining members;
        False when a peer was lost meanwhile (take another round)."""
        try:
            if d.link != self.link_id:
                self.link, self.link_id = None, None
                if len(d.members) > 1:
                    self.link = ReplicaLink(self.quorum.store, d.link, self.lane,
                                            d.members.index(self.group), len(d.members),
                                            self.timeout, self.strategy.comm.meter)
                self.link_id = d.link
            receivers = [m for m in d.members if m not in d.synced and m != d.source]
            if self.group == d.source and receivers:
                self.link.send_state(self._state(), [d.members.index(m) for m in receivers])
            elif self.group in receivers:
                self._load(self.link.recv_state(d.members.index(d.source)))
        except RuntimeError:
            self.link, self.link_id, self.fresh = None, None, True
            return False
        return True

    def _state(self) -> dict:
        return {"strategy": self.strategy.state_dict(), "rng": torch.get_rng_state()}

    def _load(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        torch.set_rng_state(state["rng"])

    # -- the cross-group reduction (the component's _finish_grad_sync calls it) -------------
    @torch.no_grad()
    def reduce(self, buffers: list[torch.Tensor]) -> None:
        """Average this rank's reduced gradient ``buffers`` (and its loss) over the members'
        lane, in place; raises Redo when any member's reduction failed."""
        d = self.current
        local = self.strategy.local_loss
        if len(d.members) == 1:
            self.loss = local
            return
        total = sum(b.numel() for b in buffers) + 1
        if self.flat is None or self.flat.numel() != total:
            self.flat = torch.empty(total, dtype=torch.float32, device=buffers[0].device)
        views, at = [], 0
        for b in buffers:
            views.append(self.flat[at:at + b.numel()])
            views[-1].copy_(b.reshape(-1))
            at += b.numel()
        self.flat[-1] = local
        ok = self.link.all_reduce_sum(self.flat)
        if not self.quorum.vote(d, ok, self.timeout):
            raise Redo(f"round {d.round}")
        self.flat.div_(len(d.members))
        for b, v in zip(buffers, views):
            b.copy_(v.view_as(b))
        self.loss = self.flat[-1].clone()

    # -- the end, hooks, events -----------------------------------------------------------
    def finish(self) -> None:
        """After the last step: a group still trying to join stops (comm/quorum.RunFinished)."""
        self.quorum.mark_finished()
        self.quorum.close()

    def _kill_hook(self) -> tuple[int | None, int | None]:
        """(the step to SIGKILL this rank at, the round to wait for before rejoining)."""
        hook = os.environ.get(ENV_KILL, "").split(":")
        if len(hook) != 3 or int(hook[0]) != self.group:
            return None, None
        step, away = int(hook[1]), int(hook[2])
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0):
            return None, step + away
        return (step if self.lane == 0 else None), None

    def _hooks(self, step: int) -> None:
        if self.kill_at is not None and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)     # a real SIGKILL, as from outside

    def _event(self, event: str, **fields) -> None:
        """One line of ``ft.jsonl`` in the group's run folder (its rank 0)."""
        if self.lane != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "ft.jsonl"), "a") as fh:
            fh.write(json.dumps({"event": event, "group": self.group, "pid": os.getpid(),
                                 "time": time.time(), **fields}) + "\n")


def attach(strategy, cfg, run_dir: str) -> ReplicaGroups | None:
    """The replica-groups part of a rank a --ft-replicas launcher started, else None."""
    from shardwise.parallel.replicas_checks import ENV_STORE, in_group
    group = in_group()
    if not cfg.parallel.ft_replicas or group is None:
        return None
    world = strategy.mesh.world_size
    quorum = Quorum(os.environ[ENV_STORE], group, strategy.mesh.rank, world,
                    cfg.parallel.ft_replicas, cfg.train.collective_timeout)
    return ReplicaGroups(strategy, quorum, group, cfg.train.collective_timeout, run_dir)
