"""Replica groups agreeing, step by step, on who is alive: the quorum (``--ft-replicas``).

The launcher (launch/replicas.py) serves one TCPStore, the *lighthouse* (:func:`serve`); every
rank of every replica group is a client. Keys (n: a round, one per attempt at a step; g: a
group id; r: a rank inside its group):

    hb/g/r        heartbeat: rank r of group g adds 1 every HEARTBEAT_S (a thread of its own,
                  started when the rank first registers for a round: a restarted rank that is
                  still starting, or held back, beats nothing, so its group's old members are
                  seen dead STALE_S after the kill rather than alive by the new process's beat)
    n/reg/g       how many of group g's ranks registered for round n (an atomic add)
    n/info/g      "step,synced,fresh,size" of group g in round n (size: its rank count, which
                  a group the launcher restarted at --ft-rejoin-nproc ranks changes)
    n/stop        the signal a rank registering for round n was asked to stop by (set before
                  its registration, so the proposer, who waits for the registrations, sees it)
    n/decision    the round's decision, written once (compare_set):
                  "members|synced|step|link|stop|sizes"
    n/vote/g/r    "1" when rank r of group g finished round n's cross-group reduction, "0" not
    latest        a recent round (a joining group starts looking there)
    done          set by a group that trained its last step

The rule of round n (:func:`propose` is its pure part): the expected groups are round n-1's
members (round 0: every group). A registered rank polls until the decision exists; it proposes
once every expected group has all its ranks registered (as many as its size says), or every
expected group that has not has a rank whose heartbeat stood still for STALE_S (dead; never in
round 0, where groups are still starting), or ``bound`` seconds passed. ``compare_set`` keeps
the first proposal, and every rank reads that one: one decision per round, whoever wrote it.
Members: every group whose ranks all registered; synced: the members that hold the training
state (a restarted group does not); step: the synced members' step; link: n when the members
(or their sizes) differ from round n-1's or a member asks for a fresh link (after a failure, or joining), else
round n-1's link; stop: the signal any registered rank asked to stop by (0: none), so every
member of the round stops at the same step boundary (parallel/replicas.py); sizes: each member's
rank count (the groups may differ: parallel/replicas.py then reduces over the groups' leaders).

Commit (:meth:`Quorum.vote`): after the cross-group reduction every rank of every member votes;
the round commits only when all voted "1", so a peer that died mid-reduction makes every
survivor redo the step in a new round, none having applied it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 0.5     # how often each rank's heartbeat thread adds 1
STALE_S = 5.0         # a heartbeat that stood still this long: that rank is gone
POLL_S = 0.005        # how often a waiting rank reads the store


@dataclass(frozen=True)
class Decision:
    """One round's outcome: who trains this step, from which state, over which link."""
    round: int
    members: tuple[int, ...]     # group ids, sorted
    synced: tuple[int, ...]      # members that hold the training state
    step: int                    # the step the members take
    link: int                    # the round whose cross-group process group they use
    stop: int = 0                # a signal: the members stop before this step (0: they train)
    sizes: tuple[int, ...] = ()  # each member's rank count, in the order of ``members``

    def encode(self) -> str:
        return "|".join([",".join(map(str, self.members)), ",".join(map(str, self.synced)),
                         str(self.step), str(self.link), str(self.stop),
                         ",".join(map(str, self.sizes))])

    @staticmethod
    def decode(n: int, text: str) -> "Decision":
        members, synced, step, link, stop, sizes = text.split("|")
        ids = lambda s: tuple(int(v) for v in s.split(",") if v)   # noqa: E731
        return Decision(n, ids(members), ids(synced), int(step), int(link), int(stop),
                        ids(sizes))

    def size_of(self, group: int) -> int | None:
        """Member ``group``'s rank count (None: not a member, or sizes unknown)."""
        if group not in self.members or not self.sizes:
            return None
        return self.sizes[self.members.index(group)]

    @property
    def even(self) -> bool:
        """Whether every member has the same rank count (lane r pairs rank r of each)."""
        return len(set(self.sizes)) <= 1

    @property
    def source(self) -> int:
        """The group whose state the others copy: the lowest synced one (else the lowest)."""
        return min(self.synced) if self.synced else min(self.members)


def propose(n: int, infos: dict[int, tuple[int, bool, bool]], prev: Decision | None,
            stop: int = 0, sizes: dict[int, int] | None = None) -> Decision:
    """Round n's proposal from the fully registered groups' (step, synced, fresh), the
    signal a registered rank asked to stop by (0: none) and each group's rank count."""
    members = tuple(sorted(infos))
    synced = tuple(g for g in members if infos[g][1])
    steps = {infos[g][0] for g in (synced or members[:1])}
    step = min(steps)          # the synced groups are in lock-step: one value
    counts = tuple(sizes[g] for g in members) if sizes else ()
    fresh = prev is None or prev.members != members or prev.sizes != counts or \
        any(infos[g][2] for g in members)
    return Decision(n, members, synced, step, n if fresh else prev.link, stop, counts)


def serve(host: str = "127.0.0.1") -> dist.TCPStore:
    """The lighthouse: a store server on a free port (``.port``), kept by the launcher."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)


class RunFinished(RuntimeError):
    """The other groups trained the last step before this one could rejoin."""


class Quorum:
    """One rank's client of the lighthouse: heartbeat, rounds, votes."""

    def __init__(self, address: str, group: int, rank: int, ranks: int, groups: int,
                 timeout: float):
        host, port = address.rsplit(":", 1)
        self.group, self.rank, self.ranks, self.groups = group, rank, ranks, groups
        self.timeout = timeout
        self.store = self._client(host, int(port))
        self._beat_store = self._client(host, int(port))   # the heartbeat thread's own client
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}
        self._stop = threading.Event()
        self._beating = False

    def _client(self, host: str, port: int) -> dist.TCPStore:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout),
                             use_libuv=True)

    def _start_heartbeat(self) -> None:
        """From this rank's first round on (module docstring): once."""
        if not self._beating:
            self._beating = True
            threading.Thread(target=self._heartbeat, daemon=True, name="ft-heartbeat").start()

    def _heartbeat(self) -> None:
        key = f"hb/{self.group}/{self.rank}"
        while not self._stop.is_set():
            try:
                self._beat_store.add(key, 1)
            except Exception:      # the lighthouse is gone: the launcher ended the run
                return
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()

    # -- reading the store ----------------------------------------------------------------
    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _decision(self, n: int) -> Decision | None:
        key = f"{n}/decision"
        return Decision.decode(n, self.store.get(key).decode()) if self._has(key) else None

    def _alive(self, g: int, size: int | None = None) -> bool:
        """False once any rank of group g (``size`` ranks; default: this group's count) has
        had a still heartbeat for STALE_S."""
        now = time.monotonic()
        for r in range(size or self.ranks):
            beat = self._count(f"hb/{g}/{r}")
            last = self._seen.get((g, r))
            if last is None or last[0] != beat:
                self._seen[(g, r)] = (beat, now)
            elif now - last[1] > STALE_S:
                return False
        return True

    def finished(self) -> bool:
        return self._has("done")

    def mark_finished(self) -> None:
        self.store.set("done", "1")

    def latest(self) -> int:
        """A recent decided round (-1 before the first)."""
        return int(self.store.get("latest").decode()) if self._has("latest") else -1

    def first_open_round(self) -> int:
        """A round no decision was written for yet (a joining group registers there)."""
        n = max(0, self.latest())
        while self._has(f"{n}/decision"):
            n += 1
        return n

    # -- one round ------------------------------------------------------------------------
    def round(self, n: int, step: int, synced: bool, fresh: bool, bound: float,
              stop: int = 0) -> Decision:
        """Register this rank for round n and return the round's decision (module docstring);
        ``stop``: the signal this rank was asked to stop by (0: none)."""
        self._start_heartbeat()
        if stop:
            self.store.set(f"{n}/stop", str(stop))
        self.store.set(f"{n}/info/{self.group}",
                       f"{step},{int(synced)},{int(fresh)},{self.ranks}")
        self.store.add(f"{n}/reg/{self.group}", 1)
        prev = self._decision(n - 1) if n > 0 else None
        expected = prev.members if prev is not None else tuple(range(self.groups))
        sizes: dict[int, int] = {}      # each registering group's rank count (its info)
        began = time.monotonic()
        while True:
            found = self._decision(n)
            if found is not None:
                return found
            if not synced and self.finished():
                raise RunFinished("the other replica groups finished the run")
            full = [g for g in range(self.groups) if self._full(n, g, sizes)]
            missing = [g for g in expected if g not in full]
            waited = time.monotonic() - began
            alive = lambda g: self._alive(g, prev.size_of(g) if prev else None)  # noqa: E731
            if not missing or waited > bound or (n > 0 and not any(map(alive, missing))):
                return self._settle(n, full, prev)
            time.sleep(POLL_S)

    def _full(self, n: int, g: int, sizes: dict[int, int]) -> bool:
        """Whether every rank of group g registered for round n (its info gives the count)."""
        count = self._count(f"{n}/reg/{g}")
        if count and g not in sizes:
            sizes[g] = int(self.store.get(f"{n}/info/{g}").decode().split(",")[3])
        return count > 0 and count >= sizes[g]

    def _settle(self, n: int, full: list[int], prev: Decision | None) -> Decision:
        infos, sizes = {}, {}
        for g in full:
            step, synced, fresh, size = self.store.get(f"{n}/info/{g}").decode().split(",")
            infos[g] = (int(step), synced == "1", fresh == "1")
            sizes[g] = int(size)
        stop = int(self.store.get(f"{n}/stop").decode()) if self._has(f"{n}/stop") else 0
        text = propose(n, infos, prev, stop, sizes).encode()
        decided = self.store.compare_set(f"{n}/decision", "", text).decode()
        self.store.set("latest", str(n))
        return Decision.decode(n, decided)

    def vote(self, d: Decision, ok: bool, bound: float) -> bool:
        """This rank's vote on round d; True when every rank of every member voted "1"."""
        self.store.set(f"{d.round}/vote/{self.group}/{self.rank}", "1" if ok else "0")
        keys = [(g, f"{d.round}/vote/{g}/{r}") for g in d.members
                for r in range(d.size_of(g) or self.ranks)]
        began = time.monotonic()
        while True:
            present = [(g, k) for g, k in keys if self._has(k)]
            if any(self.store.get(k) != b"1" for _, k in present):
                return False
            if len(present) == len(keys):
                return True
            absent = {g for g, k in keys if (g, k) not in present}
            if time.monotonic() - began > bound or \
                    not all(self._alive(g, d.size_of(g)) for g in absent):
                return False
            time.sleep(POLL_S)
