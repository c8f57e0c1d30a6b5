"""Pipeline schedules as data: for each stage, the list of actions it runs, in order.

Actions: ``F i`` / ``B i`` (forward / backward of micro-batch i) and the transfers ``SEND_F i``
(activation to the next stage), ``RECV_F i``, ``SEND_B i`` (input gradient to the previous
stage), ``RECV_B i``. Consecutive transfers form one *batch* that the executor posts together
(comm/p2p.py), which is what makes 1F1B's steady state deadlock-free.

    GPipe (Huang et al., 2019): all m forwards, then all m backwards; a stage holds m
    micro-batches of activations at the peak.
    1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs min(p-s-1, m) warm-up forwards,
    then alternates one forward / one backward (steady state), then the remaining backwards
    (cool-down); a stage holds at most p - s <= p micro-batches.
    Both leave the bubble (p-1)/(m+p-1) of the step idle when F and B take the same time on
    every stage.

:func:`check` runs before launch: each stage does every F and B once, in a legal order; the k-th
send from a stage to a neighbour matches the neighbour's k-th receive from it (same kind, same
micro-batch, never to itself); and a simulation in which a transfer batch completes only once
every peer has posted its matching operations finishes, so no stage waits forever.
:func:`simulate` also gives the ideal timeline for chosen F / B costs.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE, TRANSFER = ("F", "B"), ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
PEER = {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}   # neighbour offset per transfer


class ScheduleError(ValueError):
    """A schedule that would compute wrongly or deadlock."""


@dataclass(frozen=True)
class Action:
    op: str
    mb: int

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}"


def _forward(s: int, p: int, i: int) -> list[Action]:
    return ([Action("RECV_F", i)] if s > 0 else []) + [Action("F", i)] + \
        ([Action("SEND_F", i)] if s < p - 1 else [])


def _backward(s: int, p: int, i: int) -> list[Action]:
    return ([Action("RECV_B", i)] if s < p - 1 else []) + [Action("B", i)] + \
        ([Action("SEND_B", i)] if s > 0 else [])


def gpipe(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (in micro-batch order)."""
    return [[a for i in range(m) for a in _forward(s, p, i)] +
            [a for i in range(m) for a in _backward(s, p, i)] for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [a for i in range(warmup) for a in _forward(s, p, i)]        # warm-up
        for j in range(m - warmup):                                            # steady
            actions += _forward(s, p, warmup + j) + _backward(s, p, j)
        for j in range(m - warmup, m):                                         # cool-down
            actions += _backward(s, p, j)
        out.append(actions)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, p: int, m: int) -> list[list[Action]]:
    """The named schedule, checked."""
    schedule = SCHEDULES[name](p, m)
    check(schedule, m)
    return schedule


def steps(actions: list[Action]) -> list[list[Action]]:
    """Group a stage's actions: each compute action alone, consecutive transfers together."""
    out: list[list[Action]] = []
    for a in actions:
        if a.op in TRANSFER and out and out[-1][0].op in TRANSFER:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def _check_stage(s: int, p: int, m: int, actions: list[Action]) -> None:
    seen: dict[tuple[str, int], int] = {}
    for k, a in enumerate(actions):
        if a.op not in COMPUTE + TRANSFER or not 0 <= a.mb < m:
            raise ScheduleError(f"stage {s}: unknown action {a!r}")
        if a.op in TRANSFER and not 0 <= s + PEER[a.op] < p:
            raise ScheduleError(f"stage {s}: {a!r} has no neighbour to talk to")
        if (a.op, a.mb) in seen:
            raise ScheduleError(f"stage {s}: {a!r} appears twice")
        seen[(a.op, a.mb)] = k
    need = [("RECV_F", "F"), ("F", "SEND_F"), ("F", "B"), ("RECV_B", "B"), ("B", "SEND_B")]
    for i in range(m):
        for op in ("F", "B"):
            if (op, i) not in seen:
                raise ScheduleError(f"stage {s}: no {op}{i}")
        for before, after in need:
            if (before, i) in seen and (after, i) in seen and seen[(before, i)] > seen[(after, i)]:
                raise ScheduleError(f"stage {s}: {after}{i} comes before {before}{i}")
    if s > 0 and any(("RECV_F", i) not in seen or ("SEND_B", i) not in seen for i in range(m)):
        raise ScheduleError(f"stage {s}: must receive every activation and return its gradient")
    if s < p - 1 and any(("SEND_F", i) not in seen or ("RECV_B", i) not in seen for i in range(m)):
        raise ScheduleError(f"stage {s}: must send every activation and receive its gradient")


def _match(schedule: list[list[Action]]) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair the k-th send on each link with the k-th receive; {(stage, action index): peer's}."""
    pairs = {}
    for s, actions in enumerate(schedule):
        for send_op, recv_op in (("SEND_F", "RECV_F"), ("SEND_B", "RECV_B")):
            d = s + PEER[send_op]
            if not 0 <= d < len(schedule):
                continue
            sends = [k for k, a in enumerate(actions) if a.op == send_op]
            recvs = [k for k, a in enumerate(schedule[d]) if a.op == recv_op]
            if len(sends) != len(recvs):
                raise ScheduleError(f"stage {s} sends {len(sends)} x {send_op} to stage {d}, "
                                    f"which receives {len(recvs)}")
            for ks, kr in zip(sends, recvs):
                if actions[ks].mb != schedule[d][kr].mb:
                    raise ScheduleError(f"stage {s}'s {actions[ks]!r} would arrive at stage {d} "
                                        f"as {schedule[d][kr]!r}")
                pairs[(s, ks)], pairs[(d, kr)] = (d, kr), (s, ks)
    return pairs


def check(schedule: list[list[Action]], m: int) -> None:
    """Raise ScheduleError unless the schedule is complete, ordered, matched and deadlock-free."""
    p = len(schedule)
    for s, actions in enumerate(schedule):
        _check_stage(s, p, m, actions)
    simulate(schedule, 1.0, 1.0)


def simulate(schedule: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0) -> dict:
    """Run the schedule on an ideal machine (F costs t_f, B t_b, transfers 0; a transfer batch
    ends when every peer has posted its half). Returns {'intervals': per stage [(op, mb, t0, t1)],
    'makespan', 'bubble'}; raises ScheduleError on a deadlock, naming the stuck stages."""
    p = len(schedule)
    pairs = _match(schedule)
    grouped = [steps(a) for a in schedule]
    index_of = [{} for _ in range(p)]            # action index -> step index, per stage
    for s, actions in enumerate(schedule):
        k = 0
        for j, step in enumerate(grouped[s]):
            for _ in step:
                index_of[s][k] = j
                k += 1
    pos, clock = [0] * p, [0.0] * p
    arrived: list[dict[int, float]] = [{} for _ in range(p)]   # step index -> time posted
    intervals: list[list] = [[] for _ in range(p)]
    first_action = [[sum(len(x) for x in g[:j]) for j in range(len(g))] for g in grouped]
    while any(pos[s] < len(grouped[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(grouped[s]):
                step, j = grouped[s][pos[s]], pos[s]
                arrived[s].setdefault(j, clock[s])
                if step[0].op in COMPUTE:
                    cost = t_f if step[0].op == "F" else t_b
                    intervals[s].append((step[0].op, step[0].mb, clock[s], clock[s] + cost))
                    clock[s] += cost
                else:
                    peers = [pairs[(s, first_action[s][j] + k)] for k in range(len(step))]
                    ready = [(d, index_of[d][kd]) for d, kd in peers]
                    if any(pos[d] < jd for d, jd in ready):
                        break                             # a peer has not posted its half yet
                    clock[s] = max([clock[s]] + [arrived[d].get(jd, clock[d]) for d, jd in ready])
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: grouped[s][pos[s]] for s in range(p) if pos[s] < len(grouped[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    makespan = max(clock)
    busy = sum(t1 - t0 for iv in intervals for _, _, t0, t1 in iv)
    return {"intervals": intervals, "makespan": makespan,
            "bubble": 1 - busy / (p * makespan) if makespan else 0.0}


def bubble_formula(p: int, m: int) -> float:
    """The idle fraction of GPipe / 1F1B with uniform stages: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose activations a stage holds at once (F done, B not yet)."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1}.get(a.op, 0)
        peak = max(peak, live)
    return peak
