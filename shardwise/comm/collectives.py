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
really moved. Nothing here synchronises a device (the backend orders the work), but for the copies
of gloo's staging (below).

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
only where each rank has cores of its own (``train.comm_wait``). ``Work(pause=s)`` sleeps s
between polls instead, which costs no core: comm/replicas.py waits so, to let a signal's Python
handler run during a wait (a blocking wait holds it until the wait ends). Polling is for gloo
only: an NCCL collective is never polled (below).

Waiting on NCCL. torch's ``WorkNCCL.wait(timeout)`` spins the host until the GPU has finished,
which would serialise the host with every collective it meant to overlap; ``wait()`` without a
timeout only orders the caller's CUDA stream after the collective and returns at once. So an
NCCL Work is always waited without a timeout (and never polled), blocking or not. NCCL stalls
are still bounded: runtime.py passes ``train.collective_timeout`` to ``init_process_group`` for
NCCL too, and NCCL's watchdog thread, which checks every collective in flight against that
timeout, tears the process down when one outlives it (``TORCH_NCCL_ASYNC_ERROR_HANDLING``:
torch's default, 3, does; 0 would leave a stalled rank hanging, and ``TORCH_NCCL_BLOCKING_WAIT=1``
would make every wait block the host again: leave both unset).
A stalled NCCL rank therefore dies with the watchdog's timeout message instead of raising
:class:`CollectiveError`, which stays gloo's (and the ring's) report of a stall.

Gloo and CUDA tensors (staging). Gloo moves host memory only: handed a CUDA tensor it aborts the
process ("gloo::IoException ... Bad address", seen on an H200). When a group's backend is gloo,
every tensor that is not on the CPU is therefore staged: copied into a fresh host tensor, the
collective runs on that copy, and what the collective writes is copied back into the caller's
tensor once it is complete (for an asynchronous call, in the Work's ``wait()``). The cost, per
collective and rank: one device-to-host copy of each tensor the backend reads and one
host-to-device copy of each it writes (each synchronises the calling stream), and host buffers of
the tensors' size, alive until the collective is done. That is what lets a gloo world of several
ranks train on one GPU (NCCL refuses two ranks on one device); a real multi-GPU run uses NCCL,
which takes CUDA tensors directly. ``stages_through_host`` is the decision.

Device check (``Comm(check_devices=True)``; runtime.py turns it on when the environment sets
``SHARDWISE_CHECK_DEVICES=1``, and the test harness, shardwise/launch/world.py, always does). Every
tensor handed to a collective is checked before anything runs, including in a group of one
(which otherwise short-circuits), against: CUDA for an NCCL group (NCCL moves CUDA tensors
only), and the run's device (``Comm.device``) when the runtime declared one. So a tensor made
without ``device=comm.device`` (a flag from ``torch.tensor(...)``) fails in a CPU test of a
CUDA-declared comm, not first on a GPU; the error names the operation, the tensor's device,
the expected one and the fix. Off, the check costs nothing.
"""
from __future__ import annotations

import datetime
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor forms (the old names warn there); torch 2.11 has only the old
# ones (seen on the H200). Same arguments either way.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                  else "reduce_scatter_tensor")
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


class DeviceMismatchError(ValueError):
    """Debug mode (``Comm(check_devices=True)``): a tensor handed to a collective is not on the
    device its group's backend, or the run, needs (module docstring)."""


def _failed(op: str, exc: BaseException) -> CollectiveError:
    return exc if isinstance(exc, CollectiveError) else CollectiveError(op, exc)


class Work:
    """A launched collective; ``wait()`` blocks until it is done and meters the blocked time."""

    def __init__(self, work, meter: CommMeter | None, op: str, after=None, timeout=None,
                 spin: bool = False, done=None, pause: float = 0.0):
        self._work, self._meter, self._op, self._after = work, meter, op, after
        self._done = done         # called once the collective completed (the flight recorder)
        self._timeout = timeout   # timedelta: an async gloo wait gives up after it (gloo's
                                  # process-group timeout does not bound an async wait); None
                                  # for NCCL, whose timed wait spins the host (module docstring)
        self._spin = spin         # poll is_completed() instead of sleeping (module docstring)
        self._pause = pause       # seconds slept between polls; 0: sched_yield (core stays awake)

    def _poll(self) -> None:
        """Poll until the collective is done or the timeout has passed (then the wait below
        fails at once, as a blocking wait would have)."""
        limit = self._timeout.total_seconds() if self._timeout is not None else float("inf")
        deadline = time.monotonic() + limit
        while not self._work.is_completed():
            if time.monotonic() > deadline:
                self._timeout = datetime.timedelta(milliseconds=1)
                return
            if self._pause:
                time.sleep(self._pause)
            else:
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
            if self._done is not None:
                self._done()
                self._done = None
        if self._after is not None:
            self._after()
            self._after = None


DONE = Work(None, None, "")


def SKIPPED() -> None:
    """What Comm.recording returns for a collective the flight recorder's test hook skips."""

_POLLED = ("all_reduce", "broadcast", "all_gather", "barrier")
"""Collectives whose gloo Works turn completed by themselves, so ``spin`` may poll them."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def backend_for(name: str, device) -> str:
    """Which backend of a process group's backend string (``dist.get_backend``: 'gloo', 'nccl',
    or per device type, 'cpu:gloo,cuda:nccl') handles tensors on ``device``."""
    if ":" not in name:
        return name
    pairs = dict(part.split(":", 1) for part in name.split(","))
    return pairs.get(torch.device(device).type, name)


def stages_through_host(backend: str | None, device) -> bool:
    """Whether a tensor on ``device`` goes to ``backend`` through a host copy: gloo moves host
    memory only (on CUDA tensors it aborts the process), so everything off the CPU is staged."""
    return backend == "gloo" and torch.device(device).type != "cpu"


def _same_device(actual: torch.device, want: torch.device) -> bool:
    """Same type, and the same index where both name one ('cuda' matches 'cuda:1')."""
    return actual.type == want.type and (want.index is None or actual.index is None
                                         or actual.index == want.index)


def _chain(fns: list):
    """One callable running ``fns`` in order (None when there are none)."""
    return (lambda: [f() for f in fns]) if fns else None


class Comm:
    """Collectives over explicit groups, all metered into one CommMeter (one per rank)."""

    def __init__(self, meter: CommMeter | None = None, timeout=None, spin: bool = False,
                 device=None, check_devices: bool = False, flight=None):
        """timeout: a datetime.timedelta after which waiting for an async gloo collective fails
        with CollectiveError (None: wait as the backend does; never applied to NCCL). spin: wait
        for gloo collectives by polling. device: the run's compute device (the runtime's), where
        tensors that callers make for a collective (flags, scalars, buffers) belong.
        check_devices: check every tensor's device before a collective (module docstring).
        flight: this rank's FlightRecorder (comm/flight.py), or None: every collective's start
        and end are recorded there."""
        self.flight = flight
        self.device = torch.device(device if device is not None else "cpu")
        self._declared = device is not None   # checked against only when someone declared it
        self.meter = meter if meter is not None else CommMeter()
        self.timeout = timeout
        self.spin = spin
        self.check_devices = check_devices
        self._scratch: dict = {}
        self._backends: dict = {}             # process group -> dist.get_backend's string

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

    def backend(self, group: Group, device=None) -> str | None:
        """The backend that runs ``group``'s collectives on tensors of ``device`` (default: the
        run's): 'gloo', 'nccl', ...; None for a group of this process alone."""
        if group.pg is None:
            return None
        name = self._backends.get(group.pg)
        if name is None:
            name = self._backends[group.pg] = str(dist.get_backend(group.pg))
        return backend_for(name, device if device is not None else self.device)

    def wait_timeout(self, group: Group, device=None):
        """The timeout to hand a Work on ``group``: ``timeout``, but None on NCCL, where a timed
        wait spins the host (module docstring)."""
        return None if self.backend(group, device) == "nccl" else self.timeout

    # -- debug checks and gloo staging (module docstring) ----------------------------------
    def _check(self, op: str, group: Group, *tensors: torch.Tensor) -> None:
        """With ``check_devices``: each tensor on CUDA for an NCCL group, and on ``device`` where
        the runtime declared one; else a DeviceMismatchError naming op, devices and the fix."""
        if not self.check_devices:
            return
        for t in tensors:
            backend = self.backend(group, t.device)
            want = self.device if self._declared else None
            if backend == "nccl" and (want is None or want.type != "cuda"):
                want = torch.device("cuda")
            if want is None or _same_device(t.device, want):
                continue
            why = ("NCCL moves CUDA tensors only" if want.type == "cuda" and backend == "nccl"
                   else f"the run's device is {self.device} (Comm.device)")
            raise DeviceMismatchError(
                f"{op}: a tensor on {t.device} was handed to a collective on a "
                f"{backend or 'one-rank'} group, which needs it on {want} ({why}); fix: create "
                f"it there (torch.tensor(..., device=comm.device), or .to(comm.device))")

    def _host(self, group: Group, t: torch.Tensor, read: bool, write: bool,
              backs: list) -> torch.Tensor:
        """``t`` itself, or on a gloo group a host copy of a tensor off the CPU: filled from
        ``t`` when the collective reads it; when it writes it, copied back by ``backs``."""
        if not stages_through_host(self.backend(group, t.device), t.device):
            return t
        host = t.to("cpu", copy=True) if read else torch.empty(t.shape, dtype=t.dtype)
        if write:
            backs.append(lambda: t.copy_(host))
        return host

    def _run(self, op, group, fn, sent, recv, async_op, after=None, name=None,
             device=None) -> Work:
        """Call ``fn(async_op)`` (the backend call), meter it, and hand back a Work (DONE when
        blocking); ``after`` runs once the collective is done. With ``spin`` a blocking gloo
        collective is launched async and polled. NCCL Works get no timeout (module docstring)."""
        backend = self.backend(group, device)
        timeout = None if backend == "nccl" else self.timeout
        spin = self.spin and backend == "gloo" and op in _POLLED
        polled = spin and not async_op
        done = self.recording(name or op, group.ranks, max(sent, recv))
        if done is SKIPPED:
            return DONE
        t0 = time.perf_counter()
        try:
            result = fn(async_op or polled)
            if polled:
                Work(result, None, name or op, None, timeout, spin=True).wait()
        except RuntimeError as exc:
            raise _failed(name or op, exc) from exc
        self.meter.record(name or op, sent, recv, time.perf_counter() - t0)
        if async_op:
            return Work(result, self.meter, name or op, after, timeout, spin=spin, done=done)
        if done is not None:
            done()
        if after is not None:
            after()
        return DONE

    def at_step(self, step: int) -> None:
        """The training step the next collectives belong to (for the flight recorder)."""
        if self.flight is not None:
            self.flight.step = step

    def recording(self, op: str, ranks: tuple, nbytes: float):
        """Record a collective's start in the flight recorder; returns what records its end
        (None without a recorder). Our own transports (shm.py, shm_p2p.py) call it too."""
        if self.flight is None:
            return None
        if self.flight.skips_next():
            return SKIPPED
        seq = self.flight.begin(op, ranks, int(nbytes))
        return lambda: self.flight.end(seq)

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum", async_op=False,
                   name: str | None = None) -> Work:
        """Reduce ``t`` in place across ``group`` (op: sum, avg, max, min)."""
        self._check(name or "all_reduce", group, t)
        n = group.size
        if n == 1:
            return DONE
        k = _nbytes(t)
        red = _OPS["sum"] if op == "avg" else _OPS[op]
        backs = []
        h = self._host(group, t, True, True, backs)
        if op == "avg":
            backs.append(lambda: t.div_(n))
        vol = 2 * (n - 1) / n * k
        return self._run("all_reduce", group, lambda a: dist.all_reduce(h, red, group=group.pg,
                         async_op=a), vol, vol, async_op, _chain(backs), name, t.device)

    def broadcast(self, t: torch.Tensor, src: int, group: Group, async_op=False,
                  name: str | None = None) -> Work:
        """Copy ``t`` from group member ``src`` to every member, in place."""
        self._check(name or "broadcast", group, t)
        if group.size == 1:
            return DONE
        k = _nbytes(t)
        root = group.rank == src
        sent, recv = (k, 0) if root else (0, k)
        backs = []
        h = self._host(group, t, root, not root, backs)
        return self._run("broadcast", group, lambda a: dist.broadcast(h, group.global_rank(src),
                         group=group.pg, async_op=a), sent, recv, async_op, _chain(backs), name,
                         t.device)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op=False,
                   name: str | None = None) -> Work:
        """``out`` (N*k elements) receives every member's ``inp`` (k elements), in rank order."""
        self._check(name or "all_gather", group, out, inp)
        n = group.size
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            return DONE
        vol = (n - 1) / n * _nbytes(out)
        backs = []
        h_out, h_in = self._host(group, out, False, True, backs), self._host(group, inp, True,
                                                                              False, backs)
        return self._run("all_gather", group, lambda a: getattr(dist, ALL_GATHER)(
            h_out, h_in, group=group.pg, async_op=a), vol, vol, async_op, _chain(backs), name,
            out.device)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group, op="sum",
                       async_op=False, name: str | None = None) -> Work:
        """``out`` (k elements) receives the reduction of every member's slice ``rank`` of ``inp``."""
        self._check(name or "reduce_scatter", group, out, inp)
        n = group.size
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            if op == "avg":
                pass  # dividing by 1 changes nothing
            return DONE
        red = _OPS["sum"] if op == "avg" else _OPS[op]
        vol = (n - 1) / n * _nbytes(inp)
        backs = []
        h_out, h_in = self._host(group, out, False, True, backs), self._host(group, inp, True,
                                                                              False, backs)
        if op == "avg":
            backs.append(lambda: out.div_(n))
        return self._run("reduce_scatter", group, lambda a: getattr(dist, REDUCE_SCATTER)(
            h_out, h_in, red, group=group.pg, async_op=a), vol, vol, async_op, _chain(backs),
            name, out.device)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: Group, async_op=False,
                   name: str | None = None) -> Work:
        """Member j's ``out`` piece i (dimension 0 cut into N equal pieces) receives member i's
        ``inp`` piece j (DeepSpeed-Ulysses' exchange; torch's all_to_all_single)."""
        self._check(name or "all_to_all", group, out, inp)
        n = group.size
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            return DONE
        vol = (n - 1) / n * _nbytes(inp)
        backs = []
        h_out, h_in = self._host(group, out, False, True, backs), self._host(group, inp, True,
                                                                              False, backs)
        return self._run("all_to_all", group, lambda a: dist.all_to_all_single(
            h_out, h_in, group=group.pg, async_op=a), vol, vol, async_op, _chain(backs), name,
            out.device)

    def send(self, t: torch.Tensor, dst: int, group: Group, name: str | None = None) -> None:
        """Blocking send of ``t`` to group member ``dst``."""
        self._check(name or "send", group, t)
        h = self._host(group, t, True, False, [])
        self._run("send", group, lambda a: dist.send(h, group.global_rank(dst), group=group.pg),
                  _nbytes(t), 0, False, name=name, device=t.device)

    def recv(self, t: torch.Tensor, src: int, group: Group, name: str | None = None) -> None:
        """Blocking receive into ``t`` from group member ``src``."""
        self._check(name or "recv", group, t)
        backs = []
        h = self._host(group, t, False, True, backs)
        self._run("recv", group, lambda a: dist.recv(h, group.global_rank(src), group=group.pg),
                  0, _nbytes(t), False, _chain(backs), name, t.device)

    def isend(self, t: torch.Tensor, dst: int, group: Group, name: str | None = None) -> Work:
        """Asynchronous send; ``t`` (or its host copy, held by the Work) must stay unchanged
        until the Work is waited."""
        self._check(name or "send", group, t)
        h = self._host(group, t, True, False, [])
        return self._run("send", group, lambda a: dist.isend(h, group.global_rank(dst),
                         group=group.pg), _nbytes(t), 0, True, name=name, device=t.device)

    def irecv(self, t: torch.Tensor, src: int, group: Group, name: str | None = None) -> Work:
        """Asynchronous receive into ``t``, filled once the Work is waited."""
        self._check(name or "recv", group, t)
        backs = []
        h = self._host(group, t, False, True, backs)
        return self._run("recv", group, lambda a: dist.irecv(h, group.global_rank(src),
                         group=group.pg), 0, _nbytes(t), True, _chain(backs), name, t.device)

    def barrier(self, group: Group) -> None:
        if group.size > 1:
            self._run("barrier", group, lambda a: dist.barrier(group=group.pg, async_op=a),
                      0, 0, False)

    def all_gather_object(self, obj, group: Group) -> list:
        """Every member's picklable ``obj``, in rank order (metered as 'objects', size unknown)."""
        if group.size == 1:
            return [obj]
        out = [None] * group.size
        self._run("objects", group, lambda a: dist.all_gather_object(out, obj, group=group.pg),
                  0, 0, False)
        return out
