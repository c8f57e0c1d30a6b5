"""Replica groups that survive a lost rank (``--ft-replicas R``), after torchft's design.

Partition: the data-parallel world is R replica groups, each a world of its own (its own
torchrun, its own process group, its own layout inside: DDP, or ZeRO stage 1, 2 or 3 over its
g dp ranks, optionally with tensor parallelism over tp and a pipeline over pp: the same mesh
in every group), all holding the whole training state between them: in-group rank r holds
the same part of it in every group (its stage, its tp slice, and under ZeRO its shard of
those; under plain DDP with tp = pp = 1 all of it), since the groups have equal sizes and
layouts (except a group the launcher restarted at ``--ft-rejoin-nproc`` ranks: below). Each
step the live groups agree on who takes part (the quorum, through the launcher's store:
comm/quorum.py), train on shares of the step's global batch in proportion to their dp sizes,
and average their gradients over the live groups only.

Data rule: the global batch of step s is the one a run without ``--ft-replicas`` takes (a pure
function of seed and step: data/sampler.py), cut into one equal slice per dp rank of the live
groups: the group at position i among the members (sorted by id), whose members before it hold
D_i dp ranks, and its dp rank d take slice D_i + d of D = the live groups' dp sizes summed
(replicas_checks.share; with L groups of g each: slice i*g + d of L*g; a rank's tp and pp
peers take the same rows). So every step trains on the whole global batch, whatever the live
groups and their sizes: no batch is skipped or repeated, and the losses equal an uninterrupted
run's up to the order of summation.

Groups of different sizes (``--ft-rejoin-nproc N``: the launcher restarts a group that lost a
rank with N ranks, which keeps its tp, pp and cp and changes its dp size only: any DDP, ZeRO,
HSDP or offload layout inside). Lane r no longer pairs like with like, but each group holds
the same *pieces* of the model (a stage's tp slice, piece index pp_rank x tp + tp_rank), and
under DDP every rank of a piece holds its group's whole mean gradient of it after its own
allreduce over dp x cp (under ZeRO the leader does, once its shard group's ranks sent it their
gradient shards, into each chunk's whole flat, whose unpadded part is laid out alike in
groups of any size: parallel/data/zero_resize.py), so only the piece's *leaders* (its rank 0
over dp x cp in each member) form the piece's lane: each sums [its group's mean gradient x
the group's dp size | the buffers as below | its group's loss sum (one tiny allreduce over dp
x cp first, divided by cp)] over the leaders, broadcasts the result (ZeRO: all but the
gradient, whose slices it sends each rank) and its verdict over its dp x cp peers, and every
rank divides by D: the gradient of the whole batch's mean loss, the weighted
sum of the groups' means (weight: their share of the rows); ZeRO's ranks then copy their
slices back into their gradient shards and clip by the whole gradient's norm. A joining
piece's leader receives the source piece leader's DDP state (model, optimizer, RNG, loss
scaler, of the piece; under ZeRO the layout-free state of the piece that its dp ranks in the
source group built together: the piece and its optimizer state by name, whole over dp) and
broadcasts it over its dp x cp peers before anyone loads it (ZeRO: each rank its own shards
of it), so the parameters are bit-identical across the groups afterwards.

Collectives, per step: the group's own gradient reduction (DDP's allreduce over its dp group;
ZeRO's reduce-scatter into this rank's 1/g gradient shards), then, when two or more groups are
live, one allreduce (sum) over the lane of this in-group rank (comm/replicas.py) of [what that
reduction left on this rank: DDP's whole gradient buckets, ZeRO's gradient shards, of its tp
slice and its stage | the model's floating-point buffers | this rank's loss], divided by L
(the buffers, BatchNorm's running statistics, are not averaged: only the first live group
puts its own in, the others zeros, so every group continues with the first live group's, as
DDP gives every forward dp rank 0's). The component calls
:meth:`ReplicaGroups.reduce` exactly once a step, in its ``_finish_grad_sync``, when those are
final and before clipping, the fp16 verdict or the optimizer read them; so the norm clipping
(its squares then summed over tp and pp by the TensorPlan) sees, and the optimizer steps on, the
mean over all live groups. Then every rank of every member votes (comm/quorum.py), and the
optimizer steps only when all succeeded. A peer lost mid-step makes the vote fail everywhere:
``reduce`` raises :class:`Redo` before the optimizer, the component drops the step's gradients
(``strategy.zero_grad()``: no optimizer state touched, no reduction left in flight), and the
survivors form a new quorum for the same step and redo it on their new shares (no step is lost,
none is applied twice). A synced group left out of a quorum (its heartbeat stopped for a while)
leaves with an error; its launcher restarts it. A group that (re)starts joins at a step
boundary: the lowest-id synced member sends it its state over the new link, lane by lane (the
strategy's state dict, the RNG state and the fp16 loss scaler of in-group rank r go to in-group
rank r: DDP's whole
state of its tp slice and stage, ZeRO's shard r of the masters and the optimizer state, whose
load then all-gathers the parameters inside the joining group), and it continues from that
member's step, so every replica's parameters are bit-identical afterwards. Whenever a decision
builds a link or copies state, the ranks of each group agree (one allreduce, min, over the
group) that every lane succeeded before anything is loaded, so a group never splits between two
rounds.

Tensor parallelism inside a group needs nothing more: its own traffic (f / g, --sp's sums of the
norms' gradients) finishes inside backward, so the component's buffers hold this rank's final
tp-slice gradients and lane r joins in-group rank r of every group (the same (dp, tp)
coordinates, the same slice). Under a pipeline the strategy is the driver
(parallel/pipeline/driver.py): the hook set on it (``strategy.ft``) lands on its component,
which calls it after the schedule's flush and the tied-weight sum, so stage s of every group is
averaged together; the driver broadcasts the last stage's loss over pp first, so every lane's
loss is its dp rank's. A Redo leaves no send or receive in flight (the flush is over), and
``zero_grad`` is the component's.

Checkpoints and stops (``--checkpoint-dir``): the lowest-id member of the step just taken
writes the run's checkpoints (:meth:`ReplicaGroups.writes_checkpoints`; its own world saves as
a run without groups would, so a ``--resume`` starts every group from it, each with its
group's layout). A SIGINT / SIGTERM is only recorded (run/deferred_stop.py) and goes into the
rank's next round (comm/quorum.py's ``n/stop``); the decision carries it, and every member
raises :class:`StopAgreed` before that step instead of training: all groups leave at the same
step boundary, and the lowest-id synced one saves that step's checkpoint first.

Memory: one flat fp32 copy of what the lane reduces (4P under DDP, 4P/g under ZeRO: the
cross-group buffer; P this rank's part: the model / (tp x pp) roughly) plus the serialised
state while a join is served. Traffic per step: 2(L-1)/L x 4P bytes per rank over the lane
under DDP, 2(L-1)/L x 4P/g under ZeRO (each lane carries one shard), and the state (model +
optimizer, about 12P bytes with Adam; 12P/g per lane under ZeRO) once to each joining group.
Groups of different sizes: 2(L-1)/L x 4P over each piece's leaders' lane for each leader only
(P: the piece), then a broadcast of 4P over its dp x cp peers (the root sends 4P, every other
rank receives it), and the piece's state (12P with Adam) once to the joining leader, then
broadcast over its dp x cp peers; under ZeRO
no broadcast of the gradient but each rank's shard sent to the leader and its slice of the
sum sent back (the leader receives and sends (g-1)/g of the gradient per step), and 4P of whole
gradient plus the 4P flat on the leader only (every other rank its 4P/g).

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
from shardwise.comm.replicas import ReplicaLink, broadcast_state
from shardwise.parallel.replicas_checks import group_restarts, share
from shardwise.parallel.replicas_sum import LaneSum

# test hook "G:STEP:AWAY": group G's rank 0 SIGKILLs itself at the start of step STEP (its first
# attempt), and its restart waits until the others took AWAY more rounds before it rejoins (a
# slow restart, on a clock of steps: a fast machine cannot rejoin before the others noticed)
ENV_KILL = "SHARDWISE_FT_TEST_KILL"
ENV_PACE = "SHARDWISE_FT_TEST_PACE"   # test hook: each step lasts at least this many seconds


class Redo(RuntimeError):
    """The step's cross-group reduction did not commit on every member: take it again."""


class StopAgreed(RuntimeError):
    """The members agreed to stop before this step (a rank of some group was asked to stop by
    ``signum``): every live group leaves at the same step boundary; ``writer``: this group is
    the lowest-id one that holds the state, which saves the checkpoint of that step."""

    def __init__(self, signum: int, writer: bool):
        super().__init__(f"the replica groups stop by signal {signum}")
        self.signum, self.writer = signum, writer


class LeftOut(CollectiveError):
    """This synced group was left out of a quorum: it leaves, and its launcher restarts it."""


class ReplicaGroups:
    """This rank's part in the replica groups (module docstring)."""

    def __init__(self, strategy, quorum: Quorum, group: int, timeout: float, run_dir: str,
                 resizable: bool = False):
        self.strategy, self.quorum, self.group, self.timeout = strategy, quorum, group, timeout
        self.lane, self.ranks = strategy.mesh.rank, quorum.ranks
        # the gradient-sync component (a pipeline's driver holds one: parallel/pipeline/)
        self.component = getattr(strategy, "component", strategy)
        # groups of different sizes (--ft-rejoin-nproc): the leader of this rank's piece of
        # the model (its pp stage and tp slice) is its rank 0 over dp x cp, and the leaders
        # of one piece form its lane (the same piece in every group, whatever the dp sizes)
        mesh = strategy.mesh
        self.sync_group = mesh.grad_group
        self.piece = mesh.pp_rank * mesh.tp + mesh.tp_rank
        # DDP sends its used flags in every group when sizes may differ (a one-rank group has
        # them on by itself), so the flats line up
        self.resizable = resizable
        self.run_dir = run_dir
        self.n, self.synced, self.fresh = 0, False, True
        self.link, self.link_id = None, None
        self.current: Decision | None = None
        self.pending: Decision | None = None
        # the step's sum over the groups (replicas_sum.py; it also carries the first live
        # group's floating-point buffers, BatchNorm's running statistics, to the others)
        self.sums, self.loss = LaneSum(strategy, group), None
        self.kill_at, self.hold_until = self._kill_hook()
        self.pace = float(os.environ.get(ENV_PACE) or 0)
        self.finish_saves = None          # run/train.py: waits for a --checkpoint-async save
        strategy.ft = self                # the component's _finish_grad_sync calls reduce()

    # -- joining --------------------------------------------------------------------------
    def join(self, start: int) -> int:
        """Rounds until this group is a member; take the source's state; return its step."""
        self._event("start", every=True, step=start, restart=group_restarts(),
                    ranks=self.ranks)
        while self.hold_until is not None and self.quorum.latest() < self.hold_until \
                and not self.quorum.finished():
            time.sleep(0.05)
        self.n = self.quorum.first_open_round()
        while True:
            d = self.quorum.round(self.n, start, synced=False, fresh=True, bound=self.timeout)
            self.n = d.round + 1
            if d.stop:              # the others stop: nothing to join (no state to save)
                raise StopAgreed(d.stop, writer=False)
            if self.group in d.members and self._use(d):
                break
        self.synced, self.fresh, self.pending = True, False, d
        self._event("join", step=d.step, members=list(d.members))
        return d.step

    # -- one step -------------------------------------------------------------------------
    def train_step(self, step: int, batch, requested=None) -> tuple[float, object, object]:
        """One committed step on this rank's share: (global loss, x, y). ``batch(index,
        count)`` gives this rank's rows of the step's global batch; ``requested()`` the signal
        this rank was asked to stop by, or None (run/deferred_stop.py): it goes into the round,
        and a round that any rank asked to stop raises StopAgreed on every member instead of
        training (the same step boundary everywhere)."""
        self._hooks(step)
        began = time.monotonic()
        while True:
            d = self._round(step, (requested() if requested is not None else None) or 0)
            if d is None:
                continue
            if self.group != min(d.members) and self.finish_saves is not None:
                # not the writer (a lower-id group is back): a background save this group
                # began as the writer is published before this step's vote lets the new
                # writer save (its begin() clears .partial folders: checkpoint/store.py)
                self.finish_saves()
            g = self.strategy.mesh.dp
            x, y = batch(*share(d.members, self._dp_sizes(d), self.group,
                                self.strategy.mesh.dp_rank))
            self.current = d
            try:
                loss = self.strategy.train_step(x, y)
            except Redo:
                self.strategy.zero_grad()    # the step's gradients dropped, nothing in flight
                self.fresh = True
                continue
            break
        if self.pace:
            time.sleep(max(0.0, self.pace - (time.monotonic() - began)))
        if len(d.members) == 1:     # the group's own mean is the global one
            return loss, x, y
        if not d.even:              # the leaders' weighted sum: every rank holds it
            return float(self.loss), x, y
        if g == 1 and self.strategy.mesh.cp == 1:      # one lane's loss covers the group's
            return float(self.loss), x, y
        # the lanes' means, over the group's dp ranks and, under --cp, their sequence parts
        return self.strategy.reduce_mean(self.loss), x, y

    def _round(self, step: int, stop: int) -> Decision | None:
        """This step's decision (the join's, or a new round); None: take another round."""
        if self.pending is not None:   # the others train this step with us: a stop waits
            d, self.pending = self.pending, None     # for the next round
            return d
        prev = self.current.members if self.current is not None else None
        d = self.quorum.round(self.n, step, synced=True, fresh=self.fresh, bound=self.timeout,
                              stop=stop)
        self.n = d.round + 1
        if d.stop:
            raise StopAgreed(d.stop, writer=bool(d.synced) and self.group == min(d.synced))
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
        False when a peer was lost meanwhile (take another round). Every rank of this group
        reaches the same answer: when anything was attempted they agree on it first."""
        receivers = [m for m in d.members if m not in d.synced and m != d.source]
        attempted = d.link != self.link_id or (receivers and self.group in (d.source, *receivers))
        # groups of one size: lane r pairs in-group rank r of each; else only the leaders'
        # lanes (rank 0 over dp x cp of each piece: DDP's every rank of the piece holds its
        # whole state, ZeRO's the layout-free state of the piece its group built) are built
        leads = self.sync_group.rank == 0
        on_lane = d.even or leads
        lane = self.lane if d.even else self.piece
        # ZeRO at another size: the source group's ranks build the layout-free state together
        whole = not d.even and hasattr(self.component, "layout_free_state")
        ok, state = True, None
        try:
            if d.link != self.link_id:
                self.link, self.link_id = None, None
                if len(d.members) > 1 and on_lane:
                    self.link = ReplicaLink(self.quorum.store, d.link, lane,
                                            d.members.index(self.group), len(d.members),
                                            self.timeout, self.strategy.comm.meter)
                self.link_id = d.link
            if self.group == d.source and receivers and (on_lane or whole):
                sent = self._state(whole)       # whole: a collective over this group
                if on_lane:
                    self.link.send_state(sent, [d.members.index(m) for m in receivers])
            elif self.group in receivers and on_lane:
                state = self.link.recv_state(d.members.index(d.source))
        except RuntimeError:
            ok = False
        if attempted:
            ok = self._agree(ok)
        if not ok:
            self.link, self.link_id, self.fresh = None, None, True
            return False
        if self.group in receivers and not d.even:    # the leader's, to its piece's ranks
            state = broadcast_state(self.strategy.comm, self.sync_group, state)
        if state is not None:
            self._load(state)       # ZeRO: gathers the whole parameters inside this group
        return True

    def _agree(self, ok: bool) -> bool:
        """True when every rank of this group succeeded (one allreduce, min, over the group's
        own world: a lane that failed sends the whole group to another round)."""
        flag = torch.tensor([1.0 if ok else 0.0], device=self.strategy.device)
        self.strategy.comm.all_reduce(flag, self.strategy.mesh.world, op="min", name="ft_agree")
        return bool(flag.item() > 0)

    def _state(self, whole: bool = False) -> dict:
        """What a joining group takes: the strategy's state (rank r's; ``whole``: ZeRO's
        layout-free state, built by every rank of this group, for a group of another size),
        the RNG and the fp16 loss scaler (its scale and clean-step count: every group scales
        alike)."""
        # (ZeRO: only the leader, who sends it, keeps the layout-free state it helped build)
        strategy = self.component.layout_free_state(keep=self.sync_group.rank == 0) if whole \
            else self.strategy.state_dict()
        return {"strategy": strategy, "whole": whole, "rng": torch.get_rng_state(),
                "scaler": self.strategy.scaler.state_dict()}

    def _load(self, state: dict) -> None:
        if state.get("whole"):      # ZeRO from a group of another size: this rank's shards
            self.component.load_layout_free_state(state["strategy"])
        else:
            self.strategy.load_state_dict(state["strategy"])
        self.strategy.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])

    # -- the cross-group reduction (the component's _finish_grad_sync calls it) -------------
    @torch.no_grad()
    def reduce(self, buffers: list[torch.Tensor]) -> None:
        """Average this rank's reduced gradient ``buffers`` (DDP's buckets, ZeRO's gradient
        shards; and its loss) over the live groups, in place (parallel/replicas_sum.py: over
        the lanes when the members have one size, else the leaders' weighted sum, of ZeRO's
        whole gradients gathered from the shards and scattered back after); raises
        Redo when any member's reduction failed (the buffers are then unchanged). DDP's
        ``find_unused`` flags come last among the buffers (1 where the group gave a
        parameter a gradient): summed too, so a flag is above 0 where any live group used
        the parameter."""
        d = self.current
        local = self.strategy.local_loss
        if len(d.members) == 1:
            self.loss = local
            return
        first = self.group == min(d.members)
        sharded = hasattr(self.component, "gather_grad_shards")
        if d.even:
            ok = self.sums.launch_even(self.link, buffers, local, first)
            divisor = len(d.members)
        else:
            sizes = self._dp_sizes(d)
            if sharded:     # ZeRO: each chunk's whole gradient on the leader (None elsewhere)
                buffers = self.component.gather_grad_shards() or []
            ok = self.sums.launch_weighted(self.link, buffers, local, first,
                                           sizes[d.members.index(self.group)], self.sync_group,
                                           leader_only=sharded)
            divisor = sum(sizes)
        if not self.quorum.vote(d, ok, self.timeout):
            raise Redo(f"round {d.round}")
        self.loss = self.sums.finish(buffers, divisor, weighted=not d.even)
        if sharded and not d.even:      # every rank's slices back into its gradient shards
            self.component.scatter_grad_shards(buffers if self.sync_group.rank == 0 else None)

    def _dp_sizes(self, d: Decision) -> tuple[int, ...]:
        """Each member's dp size (its rank count over tp x pp x cp, the same in every group)."""
        mesh = self.strategy.mesh
        per = mesh.world_size // mesh.dp        # ranks per dp rank
        return tuple(s // per for s in d.sizes) if d.sizes else (mesh.dp,) * len(d.members)

    def writes_checkpoints(self) -> bool:
        """Whether this group saves the run's checkpoints after the step just taken: the
        lowest-id member of its round (every member holds the state once the step committed),
        so exactly one group writes each one."""
        return self.current is not None and self.group == min(self.current.members)

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
        if group_restarts():
            return None, step + away
        return (step if self.lane == 0 else None), None

    def _hooks(self, step: int) -> None:
        if self.kill_at is not None and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)     # a real SIGKILL, as from outside

    def _event(self, event: str, every: bool = False, **fields) -> None:
        """One line of ``ft.jsonl`` in the group's run folder: from its rank 0, or with
        ``every`` (the start: each rank's pid) from each of its ranks (one short append each)."""
        if self.lane != 0 and not every:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "ft.jsonl"), "a") as fh:
            fh.write(json.dumps({"event": event, "group": self.group, "rank": self.lane,
                                 "pid": os.getpid(), "time": time.time(), **fields}) + "\n")


def attach(strategy, cfg, run_dir: str) -> ReplicaGroups | None:
    """The replica-groups part of a rank a --ft-replicas launcher started, else None."""
    from shardwise.parallel.replicas_checks import ENV_STORE, in_group
    group = in_group()
    if not cfg.parallel.ft_replicas or group is None:
        return None
    world = strategy.mesh.world_size
    quorum = Quorum(os.environ[ENV_STORE], group, strategy.mesh.rank, world,
                    cfg.parallel.ft_replicas, cfg.train.collective_timeout)
    return ReplicaGroups(strategy, quorum, group, cfg.train.collective_timeout, run_dir,
                         resizable=bool(cfg.parallel.ft_rejoin_nproc))
