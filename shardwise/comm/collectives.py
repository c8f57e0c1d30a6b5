"""The only door to torch.distributed: thin collective wrappers with a per-rank traffic meter.

Every call takes an explicit :class:`Group` (no default group, no module globals). A group of
size 1 short-circuits: no backend call, the tensor is already the answer, nothing is metered.
Asynchronous calls return a :class:`Work` whose ``wait()`` must be called visibly by the caller.

Metering: each call records, per operation name, the number of calls, the bytes this rank sends
and receives, and the seconds this rank spent blocked in the call or its ``wait()``. For the
backend's own collectives the bytes are the algorithmic volume of a bandwidth-optimal (ring)
implementation on K bytes among N ranks, the figure the literature uses:

    all_reduce      sent = recv = 2(N-1)/N * K
    reduce_scatter  sent = recv = (N-1)/N * K      (K = the whole input)
    all_gather      sent = recv = (N-1)/N * K      (K = the whole output)
    broadcast       root sends K, the others receive K
    send / recv     exactly the tensor's bytes

shardwise's own ring (comm/ring.py) is built from send / recv, so its meter shows the bytes that
really moved. Nothing here touches a device (no synchronize): the backend orders the work.

Waiting (``Comm(spin=True)``). A blocking wait sleeps the thread on a condition variable
until gloo's worker finishes. On a virtual machine whose cores sleep when idle, that costs
milliseconds per collective: measured here, a 1 KiB allreduce right after 8 ms of compute took
3-4 ms between ranks that block and 0.3 ms between ranks that poll. With ``spin``, all_reduce,
broadcast, all_gather and barrier (blocking calls too) are launched asynchronously and waited by
polling ``is_completed()`` with ``sched_yield`` between polls, so the core stays awake and a
runnable thread still gets it. The timeout still holds: a poll that outlives it fails as a
blocking wait would. The others always block, because their gloo Works report completion only
once ``wait()`` is called (send / recv, and reduce_scatter, whose poll never ends: tested), or
have no asynchronous form (all_gather_object). Polling costs a core, so runtime.py turns it on
only where each rank has cores of its own (``train.comm_wait``).
"""
from __future__ import annotations

import datetime
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": None}  # avg = sum then divide (gloo has no AVG)


@dataclass(frozen=True)
class Group:
    """A process group: its members' global ranks, and this process's index among them."""
    pg: object | None  # torch ProcessGroup; None when the group is this process alone
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @staticmethod
    def solo(global_rank: int = 0) -> "Group":
        """The group of this process alone (world size 1 paths, single-process strategies)."""
        return Group(pg=None, ranks=(global_rank,), rank=0)

    def global_rank(self, index: int) -> int:
        """The global rank of the group member at ``index``."""
        return self.ranks[index]


@dataclass
class OpStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0


@dataclass
class CommMeter:
    """Calls, bytes and blocked seconds per operation, for this rank."""
    ops: dict = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, sent: float, recv: float, seconds: float = 0.0, calls: int = 1):
        s = self.ops[op]
        s.calls += calls
        s.bytes_sent += int(sent)
        s.bytes_recv += int(recv)
        s.seconds += seconds

    def add_time(self, op: str, seconds: float) -> None:
        self.ops[op].seconds += seconds

    def snapshot(self) -> dict:
        """{op: {calls, bytes_sent, bytes_recv, seconds}} (a copy)."""
        return {k: dict(vars(v)) for k, v in sorted(self.ops.items())}

    def total(self, exclude: tuple[str, ...] = ("metrics",)) -> OpStats:
        """Totals over all operations but ``exclude`` (the loop's own logging traffic)."""
        t = OpStats()
        for name, s in self.ops.items():
            if name in exclude:
                continue
            t.calls += s.calls
            t.bytes_sent += s.bytes_sent
            t.bytes_recv += s.bytes_recv
            t.seconds += s.seconds
        return t

    def reset(self) -> None:
        self.ops.clear()


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or none answered within the process group's timeout
    (``train.collective_timeout``). ``op`` is the metered name of the operation; the training
    loop adds ``step``."""

    def __init__(self, op: str, cause: BaseException):
        lines = str(cause).strip().splitlines() or [type(cause).__name__]
        super().__init__(f"{op}: {lines[0][:300]}")
        self.op, self.step = op, None


def _failed(op: str, exc: BaseException) -> CollectiveError:
    return exc if isinstance(exc, CollectiveError) else CollectiveError(op, exc)


class Work:
    """A launched collective; ``wait()`` blocks until it is done and meters the blocked time."""

    def __init__(self, work, meter: CommMeter | None, op: str, after=None, timeout=None,
                 spin: bool = False):
        self._work, self._meter, self._op, self._after = work, meter, op, after
        self._timeout = timeout   # timedelta: an async wait gives up after it (gloo's own
                                  # process-group timeout does not bound an async wait)
        self._spin = spin         # poll is_completed() instead of sleeping (module docstring)

    def _poll(self) -> None:
        """Poll until the collective is done or the timeout has passed (then the wait below
        fails at once, as a blocking wait would have)."""
        limit = self._timeout.total_seconds() if self._timeout is not None else float("inf")
        deadline = time.monotonic() + limit
        while not self._work.is_completed():
            if time.monotonic() > deadline:
                self._timeout = datetime.timedelta(milliseconds=1)
                return
            os.sched_yield()

    def wait(self) -> None:
        if self._work is not None:
            t0 = time.perf_counter()
            try:
                if self._spin:
                    self._poll()
                if self._timeout is not None:
                    self._work.wait(self._timeout)
                else:
                    self._work.wait()
            except (RuntimeError, TimeoutError) as exc:
                raise _failed(self._op, exc) from exc
            if self._meter is not None:
                self._meter.add_time(self._op, time.perf_counter() - t0)
            self._work = None
        if self._after is not None:
            self._after()
            self._after = None


DONE = Work(None, None, "")

_POLLED = ("all_reduce", "broadcast", "all_gather", "barrier")
"""Collectives whose gloo Works turn completed by themselves, so ``spin`` may poll them."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Collectives over explicit groups, all metered into one CommMeter (one per rank)."""

    def __init__(self, meter: CommMeter | None = None, timeout=None, spin: bool = False):
        """timeout: a datetime.timedelta after which waiting for an async collective fails
        with CollectiveError (None: wait as the backend does). spin: wait for collectives by
        polling (module docstring)."""
        self.meter = meter if meter is not None else CommMeter()
        self.timeout = timeout
        self.spin = spin
        self._scratch: dict = {}

    def scratch(self, key: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A reusable 1-D buffer of at least ``numel`` elements (grown on demand, never shrunk).

        Used by algorithms built on send / recv (the ring) for their receive space: allocating
        fresh memory each call costs more than the transfer on CPU.
        """
        buf = self._scratch.get((key, dtype, str(device)))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[(key, dtype, str(device))] = buf
        return buf[:numel]

    def _run(self, op, fn, sent, recv, async_op, after=None, name=None) -> Work:
        """Call ``fn(async_op)`` (the backend call), meter it, and hand back a Work (DONE when
        blocking). With ``spin`` a blocking collective is launched async and polled."""
        polled = self.spin and not async_op and op in _POLLED
        t0 = time.perf_counter()
        try:
            result = fn(async_op or polled)
            if polled:
                Work(result, None, name or op, None, self.timeout, spin=True).wait()
        except RuntimeError as exc:
            raise _failed(name or op, exc) from exc
        self.meter.record(name or op, sent, recv, time.perf_counter() - t0)
        if async_op:
            return Work(result, self.meter, name or op, after, self.timeout,
                        spin=self.spin and op in _POLLED)
        if after is not None:
            after()
        return DONE

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum", async_op=False,
                   name: str | None = None) -> Work:
        """Reduce ``t`` in place across ``group`` (op: sum, avg, max, min)."""
        n = group.size
        if n == 1:
            return DONE
        k = _nbytes(t)
        red = _OPS["sum"] if op == "avg" else _OPS[op]
        after = (lambda: t.div_(n)) if op == "avg" else None
        vol = 2 * (n - 1) / n * k
        return self._run("all_reduce", lambda a: dist.all_reduce(t, red, group=group.pg,
                         async_op=a), vol, vol, async_op, after, name)

    def broadcast(self, t: torch.Tensor, src: int, group: Group, async_op=False,
                  name: str | None = None) -> Work:
        """Copy ``t`` from group member ``src`` to every member, in place."""
        if group.size == 1:
            return DONE
        k = _nbytes(t)
        sent, recv = (k, 0) if group.rank == src else (0, k)
        return self._run("broadcast", lambda a: dist.broadcast(t, group.global_rank(src),
                         group=group.pg, async_op=a), sent, recv, async_op, name=name)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op=False,
                   name: str | None = None) -> Work:
        """``out`` (N*k elements) receives every member's ``inp`` (k elements), in rank order."""
        n = group.size
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            return DONE
        vol = (n - 1) / n * _nbytes(out)
        return self._run("all_gather", lambda a: dist.all_gather_single(out, inp, group=group.pg,
                         async_op=a), vol, vol, async_op, name=name)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group, op="sum",
                       async_op=False, name: str | None = None) -> Work:
        """``out`` (k elements) receives the reduction of every member's slice ``rank`` of ``inp``."""
        n = group.size
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            if op == "avg":
                pass  # dividing by 1 changes nothing
            return DONE
        red = _OPS["sum"] if op == "avg" else _OPS[op]
        after = (lambda: out.div_(n)) if op == "avg" else None
        vol = (n - 1) / n * _nbytes(inp)
        return self._run("reduce_scatter", lambda a: dist.reduce_scatter_single(
            out, inp, red, group=group.pg, async_op=a), vol, vol, async_op, after, name)

    def send(self, t: torch.Tensor, dst: int, group: Group, name: str | None = None) -> None:
        """Blocking send of ``t`` to group member ``dst``."""
        self._run("send", lambda a: dist.send(t, group.global_rank(dst), group=group.pg),
                  _nbytes(t), 0, False, name=name)

    def recv(self, t: torch.Tensor, src: int, group: Group, name: str | None = None) -> None:
        """Blocking receive into ``t`` from group member ``src``."""
        self._run("recv", lambda a: dist.recv(t, group.global_rank(src), group=group.pg),
                  0, _nbytes(t), False, name=name)

    def isend(self, t: torch.Tensor, dst: int, group: Group, name: str | None = None) -> Work:
        return self._run("send", lambda a: dist.isend(t, group.global_rank(dst), group=group.pg),
                         _nbytes(t), 0, True, name=name)

    def irecv(self, t: torch.Tensor, src: int, group: Group, name: str | None = None) -> Work:
        return self._run("recv", lambda a: dist.irecv(t, group.global_rank(src), group=group.pg),
                         0, _nbytes(t), True, name=name)

    def barrier(self, group: Group) -> None:
        if group.size > 1:
            self._run("barrier", lambda a: dist.barrier(group=group.pg, async_op=a), 0, 0, False)

    def all_gather_object(self, obj, group: Group) -> list:
        """Every member's picklable ``obj``, in rank order (metered as 'objects', size unknown)."""
        if group.size == 1:
            return [obj]
        out = [None] * group.size
        self._run("objects", lambda a: dist.all_gather_object(out, obj, group=group.pg), 0, 0, False)
        return out
