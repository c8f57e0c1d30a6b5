"""Pipeline schedules as data: for each stage (rank of the pipeline group), the list of actions
it runs, in order.

Actions: ``F i`` / ``B i`` (forward / backward of micro-batch i), ``W i`` (the weight-gradient
half of a split backward; then ``B i`` computes only the input gradient), and the transfers
``SEND_F i`` (activation to the next stage), ``RECV_F i``, ``SEND_B i`` (input gradient to the
previous stage), ``RECV_B i``. Each action also names a model *chunk* (``F3.1``: micro-batch 3
on chunk 1; chunk 0 is not printed): with V chunks per rank the model is cut into p x V virtual
stages and rank s holds virtual stages s, s + p, ..., so the virtual stage of (s, c) is c·p + s
and its neighbours may wrap around the ring of ranks. Consecutive transfers form one *batch*
that the executor posts together (comm/p2p.py), which is what makes 1F1B's steady state
deadlock-free.

    GPipe (Huang et al., 2019): all m forwards, then all m backwards; a stage holds m
    micro-batches of activations at the peak.
    1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs min(p-s-1, m) warm-up forwards,
    then alternates one forward / one backward (steady state), then the remaining backwards
    (cool-down); a stage holds at most p - s <= p micro-batches.
    Both leave the bubble (p-1)/(m+p-1) of the step idle when F and B take the same time on
    every stage.
    Interleaved 1F1B (interleaved.py; Narayanan et al., 2021, Megatron's virtual pipeline): V
    chunks per rank, bubble (p-1)/(V·m + p-1) of the step ((p-1)/(V·m) of the ideal time).
    ZB-H1 (zero_bubble.py; Qi et al., 2023): 1F1B with the backward split into B (input
    gradient, sent upstream at once) and W (weight gradient, deferred into the cool-down
    bubble); bubble (p-1)/(3m + p-1) with equal F, B and W costs.

:func:`check` runs before launch: each stage does every F and B (and, where it splits, W) once
per micro-batch and chunk, in a legal order; the k-th message a rank sends to another matches
the k-th that the other receives from it (same kind, micro-batch and chunk, never to itself:
messages between two ranks are matched in the order posted, whatever their kind); and a
simulation in which a transfer batch completes once every message it receives has been posted
by its sender (sends do not wait: the executor leaves them in flight and waits for them at the
end of the step) finishes, so no stage waits forever. :func:`simulate` also gives the ideal timeline
for chosen F / B / W costs.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE, TRANSFER = ("F", "B", "W"), ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
PEER = {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}   # virtual-stage offset per transfer
PAIR = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}
NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class ScheduleError(ValueError):
    """A schedule that would compute wrongly or deadlock."""


@dataclass(frozen=True)
class Action:
    op: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def peer_of(s: int, p: int, v: int, a: Action) -> tuple[int, int] | None:
    """(rank, chunk) of the virtual stage that transfer ``a`` of rank ``s`` talks to, or None
    when there is none (before the first or after the last of the p x v virtual stages)."""
    vs = a.chunk * p + s + PEER[a.op]
    return (vs % p, vs // p) if 0 <= vs < p * v else None


def _forward(s: int, p: int, i: int, c: int = 0, v: int = 1) -> list[Action]:
    vs, last = c * p + s, p * v - 1
    return ([Action("RECV_F", i, c)] if vs > 0 else []) + [Action("F", i, c)] + \
        ([Action("SEND_F", i, c)] if vs < last else [])


def _backward(s: int, p: int, i: int, c: int = 0, v: int = 1) -> list[Action]:
    vs, last = c * p + s, p * v - 1
    return ([Action("RECV_B", i, c)] if vs < last else []) + [Action("B", i, c)] + \
        ([Action("SEND_B", i, c)] if vs > 0 else [])


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


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The named schedule (``v``: chunks per rank, interleaved 1F1B only), checked."""
    from shardwise.parallel.pipeline import interleaved, zero_bubble   # they build on this module
    if name == "interleaved-1f1b":
        schedule = interleaved.interleaved_1f1b(p, m, v)
    elif v != 1:
        raise ScheduleError(f"{name} runs one chunk per rank (v = {v}); use interleaved-1f1b")
    elif name == "zb-h1":
        schedule = zero_bubble.zb_h1(p, m)
    else:
        schedule = SCHEDULES[name](p, m)
    check(schedule, m, v)
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


def split_chunks(actions: list[Action]) -> set[int]:
    """The chunks whose backward this stage splits into B (input gradient) and W (weights)."""
    return {a.chunk for a in actions if a.op == "W"}


def _check_stage(s: int, p: int, m: int, v: int, actions: list[Action]) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    for k, a in enumerate(actions):
        if a.op not in COMPUTE + TRANSFER or not 0 <= a.mb < m or not 0 <= a.chunk < v:
            raise ScheduleError(f"stage {s}: unknown action {a!r}")
        if a.op in TRANSFER and peer_of(s, p, v, a) is None:
            raise ScheduleError(f"stage {s}: {a!r} has no neighbour to talk to")
        if (a.op, a.mb, a.chunk) in seen:
            raise ScheduleError(f"stage {s}: {a!r} appears twice")
        seen[(a.op, a.mb, a.chunk)] = k
    need = [("RECV_F", "F"), ("F", "SEND_F"), ("F", "B"), ("RECV_B", "B"), ("B", "SEND_B"),
            ("B", "W")]
    split = split_chunks(actions)
    for c in range(v):
        vs = c * p + s
        for i in range(m):
            for op in ("F", "B") + (("W",) if c in split else ()):
                if (op, i, c) not in seen:
                    raise ScheduleError(f"stage {s}: no {Action(op, i, c)!r}")
            for before, after in need:
                kb, ka = seen.get((before, i, c)), seen.get((after, i, c))
                if kb is not None and ka is not None and kb > ka:
                    raise ScheduleError(f"stage {s}: {Action(after, i, c)!r} comes before "
                                        f"{Action(before, i, c)!r}")
        if vs > 0 and any(("RECV_F", i, c) not in seen or ("SEND_B", i, c) not in seen
                          for i in range(m)):
            raise ScheduleError(f"stage {s}: must receive every activation and return its gradient")
        if vs < p * v - 1 and any(("SEND_F", i, c) not in seen or ("RECV_B", i, c) not in seen
                                  for i in range(m)):
            raise ScheduleError(f"stage {s}: must send every activation and receive its gradient")


def _match(schedule: list[list[Action]], v: int = 1) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair the k-th message sent on each link (rank s -> rank d, any kind) with the k-th one
    that d receives from s; {(stage, action index): peer's}."""
    p, pairs = len(schedule), {}
    links: dict[tuple[int, int], tuple[list, list]] = {}
    for s, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            if a.op not in TRANSFER:
                continue
            d, _ = peer_of(s, p, v, a)
            if d == s:
                raise ScheduleError(f"stage {s}: {a!r} would talk to itself")
            sending = a.op in PAIR
            link = links.setdefault((s, d) if sending else (d, s), ([], []))
            link[0 if sending else 1].append(k)
    for (s, d), (sends, recvs) in sorted(links.items()):
        if len(sends) != len(recvs):
            raise ScheduleError(f"stage {s} sends {len(sends)} messages to stage {d}, "
                                f"which receives {len(recvs)}")
        for ks, kr in zip(sends, recvs):
            a, b = schedule[s][ks], schedule[d][kr]
            if (PAIR[a.op], a.mb) != (b.op, b.mb) or peer_of(s, p, v, a) != (d, b.chunk) \
                    or peer_of(d, p, v, b) != (s, a.chunk):
                raise ScheduleError(f"stage {s}'s {a.op} {a!r} would arrive at stage {d} "
                                    f"as {b.op} {b!r}")
            pairs[(s, ks)], pairs[(d, kr)] = (d, kr), (s, ks)
    return pairs


def check(schedule: list[list[Action]], m: int, v: int = 1) -> None:
    """Raise ScheduleError unless the schedule is complete, ordered, matched and deadlock-free."""
    p = len(schedule)
    for s, actions in enumerate(schedule):
        _check_stage(s, p, m, v, actions)
    simulate(schedule, 1.0, 1.0, v=v)


def _cost(a: Action, split: set[int], t_f: float, t_b: float, t_w: float) -> float:
    """An action's ideal time: F t_f, W t_w, B the whole backward t_b or, split, t_b - t_w."""
    if a.op == "F":
        return t_f
    if a.op == "W":
        return t_w
    return t_b - t_w if a.chunk in split else t_b


def _step_of_action(grouped: list[list[Action]]) -> dict[int, int]:
    """One stage's action index -> the index of the step (transfer batch or compute) holding it."""
    return {k: j for k, j in enumerate(j for j, step in enumerate(grouped) for _ in step)}


def simulate(schedule: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0,
             t_w: float | None = None, v: int | None = None) -> dict:
    """Run the schedule on an ideal machine (transfers free; sends never wait, as the executor
    leaves them in flight; a transfer batch ends when every message it receives has been sent). Costs per action: F t_f; an unsplit B the whole backward t_b; a
    split one t_b - t_w and its W t_w (default t_w = t_b / 2). Returns {'intervals': per stage
    [(op, mb, t0, t1)], 'chunks': each interval's chunk, 'makespan', 'bubble'}; raises ScheduleError on a deadlock, naming the
    stuck stages."""
    p = len(schedule)
    v = v or 1 + max(a.chunk for actions in schedule for a in actions)
    t_w = t_b / 2 if t_w is None else t_w
    pairs = _match(schedule, v)
    grouped = [steps(a) for a in schedule]
    splits = [split_chunks(a) for a in schedule]
    index_of = [_step_of_action(g) for g in grouped]   # action index -> step index, per stage
    pos, clock = [0] * p, [0.0] * p
    arrived: list[dict[int, float]] = [{} for _ in range(p)]   # step index -> time posted
    intervals: list[list] = [[] for _ in range(p)]
    chunks: list[list[int]] = [[] for _ in range(p)]           # each interval's chunk
    first_action = [[sum(len(x) for x in g[:j]) for j in range(len(g))] for g in grouped]
    while any(pos[s] < len(grouped[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(grouped[s]):
                step, j = grouped[s][pos[s]], pos[s]
                arrived[s].setdefault(j, clock[s])
                if step[0].op in COMPUTE:
                    cost = _cost(step[0], splits[s], t_f, t_b, t_w)
                    intervals[s].append((step[0].op, step[0].mb, clock[s], clock[s] + cost))
                    chunks[s].append(step[0].chunk)
                    clock[s] += cost
                else:
                    # sends never wait (comm/p2p.py leaves them in flight); a receive waits
                    # until its sender has posted the matching send
                    peers = [pairs[(s, first_action[s][j] + k)] for k, a in enumerate(step)
                             if a.op not in PAIR]
                    ready = [(d, index_of[d][kd]) for d, kd in peers]
                    if any(pos[d] < jd for d, jd in ready):
                        break                             # a sender has not posted yet
                    clock[s] = max([clock[s]] + [arrived[d].get(jd, clock[d]) for d, jd in ready])
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: grouped[s][pos[s]] for s in range(p) if pos[s] < len(grouped[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    makespan = max(clock)
    busy = sum(t1 - t0 for iv in intervals for _, _, t0, t1 in iv)
    return {"intervals": intervals, "chunks": chunks, "makespan": makespan,
            "bubble": 1 - busy / (p * makespan) if makespan else 0.0}


FORMULA = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
           "interleaved-1f1b": "(p-1)/(v*m+p-1)", "zb-h1": "(p-1)/(3m+p-1)"}


def bubble_formula(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """The idle fraction of a step with uniform stages and equal F, B (and W) costs:
    GPipe / 1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v·m+p-1) (its per-chunk F and B are
    1/v of a stage's); ZB-H1 (p-1)/(3m+p-1), the case T_F = T_B = T_W of Qi et al.'s
    (p-1)(T_F+T_B-T_W) idle per stage against m(T_F+T_B+T_W) of work."""
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batch chunks whose activations a stage holds at once (F done, its backward
    not yet: B, or W where the backward is split)."""
    split = split_chunks(actions)
    live = peak = 0
    for a in actions:
        if a.op == "F":
            live += 1
        elif (a.op == "B" and a.chunk not in split) or a.op == "W":
            live -= 1
        peak = max(peak, live)
    return peak
