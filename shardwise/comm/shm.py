"""Same-host shared-memory collectives: all-reduce (DDP), reduce-scatter and all-gather (ZeRO
1-3), with ``parallel.allreduce = shm``, or ``auto`` on one CPU host.

Why: gloo moves every byte of an allreduce through TCP sockets, even between processes on one
machine. Measured here (13.3 MB, world 2, one thread per rank, after compute): gloo 18-19 ms,
this 8-9 ms. NCCL's intra-node transports and DeepSpeed's CPU allreduce do the same thing: the
ranks of one host share memory, so each reads the others' bytes directly.

Layout: one file in /dev/shm (else the temp dir) that every member maps (``torch.from_file``,
shared), unlinked as soon as all have mapped it, so nothing is left behind if a rank dies. It
holds one slot of ``chunk_bytes`` per member, one result region of ``chunk_bytes`` and one
arrival counter per member (each on its own 64-byte line).

Algorithm, per chunk of the tensor: every member copies its chunk into its slot; barrier; member
r sums slice r of every slot (member order 0..N-1, the same on every rank) into the result;
barrier; every member copies the whole result back. Two barriers per chunk suffice: a slot is
rewritten only after the second barrier (every sum has read it), and the result only after the
next chunk's first barrier (every member has copied it out). Every rank ends with the same bits.

In place (``share``): a caller whose tensors can live in shared memory from the start (DDP's
gradient buckets: the ``.grad`` views backward writes into) asks for ``share(nbytes)``, a
collective that maps one file of N x ``nbytes`` holding every member's part; this member's part
is returned and allocated from. An all-reduce of a tensor inside that part copies nothing in or
out: barrier; member r sums slice r of every member's copy (member order 0..N-1) into its own
copy's slice r; barrier; member r copies every other slice i from member i's copy into its own;
barrier (every member has read slice r of ours: it may change again). Memory traffic per member
2.5 K bytes for a K-byte tensor at N = 2, against 5.5 K through the slots (each chunk copied in,
summed, copied out). The price: each member reads the others' parts, so their pages count in
its RSS too (shared pages: the machine holds each member's part once).

Reduce-scatter (ZeRO's gradients, ``out`` = the group's sum or mean of slice ``rank`` of every
member's ``inp``), through the slots, per round of ``m`` elements of each slice (a slot holds N
of them): every member copies its N slices' next ``m`` elements into its slot; barrier; member r
sums piece r of every slot (member order 0..N-1) into ``out``; barrier. Traffic per member: K
bytes copied in, K read; the backend's (gloo's) reduce-scatter all-reduces the whole tensor.
All-gather (ZeRO's updated parameters, ``out`` = every member's ``inp`` in rank order), per
round of up to a slot: every member copies its piece into its slot; barrier; each copies every
other member's piece out of the slots (its own from ``inp``, nothing where ``inp`` is already
``out``'s piece r); barrier.

Barrier: each member raises its own counter and polls the others' (the cores stay awake, as with
``train.comm_wait = spin``), backing off to 50 us sleeps after 1 ms so that ranks sharing cores
still progress; a member that has not arrived within the collective timeout raises
CollectiveError naming it. Stores become visible in program order only on x86 (TSO), so the
path is refused elsewhere.

Memory: (N + 1) x chunk_bytes of shared pages (4 MiB chunks: 12 MiB at N = 2), which each
member's RSS counts once it has read them. Traffic (metered as the backend's allreduce): each
member reads N-1 other slices of each chunk and its slice of the result is read by N-1 others,
2(N-1)/N x K bytes, as a ring would move.
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
import tempfile
import time

import torch

from shardwise.comm.collectives import SKIPPED, Comm, CollectiveError, Group

CHUNK_BYTES = 4 << 20
_LINE = 64                     # bytes between two members' counters (no false sharing)
SUMMABLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def unusable(comm: Comm, group: Group, device: torch.device, need_polling: bool) -> str | None:
    """Why the shared-memory path cannot serve ``group`` (None: it can). A collective over
    ``group``: every member sends its answers once, and all decide on the same gathered list.
    ``need_polling`` (``auto``): only where this rank's collectives are polled (comm.spin)."""
    mine = {"host": _host(), "device": device.type, "arch": platform.machine().lower(),
            "spin": bool(comm.spin)}
    every = comm.all_gather_object(mine, group)
    if any(m["device"] != "cpu" for m in every):
        return "some members' tensors are not on the cpu"
    if any(m["arch"] not in ("x86_64", "amd64") for m in every):
        return "some members are not on x86-64 (elsewhere stores may be seen out of order)"
    if len({m["host"] for m in every}) > 1:
        return f"the members run on {len({m['host'] for m in every})} hosts"
    if need_polling and not all(m["spin"] for m in every):
        return "the ranks wait by blocking (train.comm_wait), so they share cores"
    return None


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def poll(done, timeout_s: float, failure) -> float:
    """Call ``done()`` until it is true, yielding the core between calls and sleeping 50 us
    once 1 ms has passed; after ``timeout_s`` raise ``failure()``. Returns the seconds waited."""
    t0 = time.monotonic()
    while not done():
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise failure()
        if waited > 1e-3:
            time.sleep(5e-5)
        else:
            os.sched_yield()
    return time.monotonic() - t0


def _folder(nbytes: int) -> str:
    """/dev/shm when it has room for ``nbytes`` (a container's is often 64 MB, and touching a
    page beyond a full tmpfs kills the process with SIGBUS), else the temp dir (page cache)."""
    for folder in ("/dev/shm", tempfile.gettempdir()):
        if os.access(folder, os.W_OK):
            st = os.statvfs(folder)
            if st.f_bavail * st.f_frsize >= 2 * nbytes:
                return folder
    raise RuntimeError(f"shared memory: neither /dev/shm nor {tempfile.gettempdir()} has "
                       f"{2 * nbytes >> 20} MiB free; fix: free space there, or use the "
                       "backend's collectives (--allreduce native / --pp-transport native)")


def map_shared(comm: Comm, group: Group, nbytes: int, prefix: str) -> torch.Tensor:
    """``nbytes`` of zeroed memory that every member of ``group`` maps (collective): member 0
    creates the file, all map it, and its name is unlinked once all have, so nothing is left
    behind whatever happens to the ranks later."""
    path = None
    if group.rank == 0:
        try:
            fd, path = tempfile.mkstemp(prefix=prefix, dir=_folder(nbytes))
            os.ftruncate(fd, nbytes)
            os.close(fd)
        except (OSError, RuntimeError) as exc:   # every member must hear of it, not hang
            path = RuntimeError(str(exc))
    path = comm.all_gather_object(path, group)[0]
    if isinstance(path, RuntimeError):
        raise path
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        comm.barrier(group)          # every member has it mapped: the name can go
        if group.rank == 0:
            os.unlink(path)


class ShmCollectives:
    """All-reduce, reduce-scatter and all-gather of CPU tensors among the members of ``group``
    on this host (module docstring)."""

    def __init__(self, comm: Comm, group: Group, chunk_bytes: int = CHUNK_BYTES):
        self.comm, self.group, self.chunk = comm, group, chunk_bytes
        n, r = group.size, group.rank
        self.nbytes = (n + 1) * chunk_bytes + n * _LINE
        self.buf = map_shared(comm, group, self.nbytes, "shardwise-allreduce-")
        self.counters = self.buf[(n + 1) * chunk_bytes:].view(torch.int64)[::_LINE // 8]
        self.mine = self.counters[r]
        self.generation = 0
        self.parts: list[torch.Tensor] | None = None     # share(): every member's part
        timeout = comm.timeout or datetime.timedelta(minutes=5)
        self.timeout_s = timeout.total_seconds()

    def share(self, nbytes: int) -> torch.Tensor:
        """Collective: map every member's ``nbytes`` (rounded up to 64 bytes) of shared memory
        and return this member's part, zeroed (uint8). Tensors viewed from it are all-reduced
        in place (module docstring). Once per object."""
        if self.parts is not None:
            raise RuntimeError("ShmCollectives.share: already shared once")
        part = -(-nbytes // _LINE) * _LINE
        whole = map_shared(self.comm, self.group, part * self.group.size, "shardwise-grads-")
        self.parts = [whole[i * part:(i + 1) * part] for i in range(self.group.size)]
        return self.parts[self.group.rank]

    def _offset(self, t: torch.Tensor) -> int | None:
        """Byte offset of ``t`` in this member's shared part (None: not inside it)."""
        if self.parts is None:
            return None
        mine = self.parts[self.group.rank]
        off = t.data_ptr() - mine.data_ptr()
        k = t.numel() * t.element_size()
        return off if 0 <= off and off + k <= mine.numel() else None

    def _region(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``index`` (0..N-1) or the result (N), as a 1-D tensor of ``dtype``."""
        return self.buf[index * self.chunk:(index + 1) * self.chunk].view(dtype)

    def _barrier(self, name: str) -> None:
        self.generation += 1
        self.mine.fill_(self.generation)
        gen = self.generation

        def late() -> CollectiveError:
            who = (self.counters < gen).nonzero().flatten().tolist()
            return CollectiveError(name, TimeoutError(
                f"shared-memory allreduce: group member(s) {who} did not arrive within "
                f"{self.timeout_s:.0f} s"))
        poll(lambda: bool((self.counters >= gen).all()), self.timeout_s, late)

    def all_reduce(self, t: torch.Tensor, name: str, op: str = "sum") -> None:
        """``t`` = the group's sum of ``t`` (``op="avg"``: the sum divided by N, each slice by
        the member that summed it), in place (contiguous, a float dtype). A ``t`` inside this
        member's shared part (:meth:`share`) must sit at the same offset on every member."""
        if op not in ("sum", "avg"):
            raise ValueError(f"{name}: the shared-memory allreduce sums or averages, not {op!r}")
        if t.dtype not in SUMMABLE or not t.is_contiguous():
            raise ValueError(f"{name}: the shared-memory allreduce takes contiguous float "
                             f"tensors, got {t.dtype} (contiguous={t.is_contiguous()})")
        k = t.numel() * t.element_size()
        off = self._offset(t)
        if off is not None:
            body = lambda: self._in_place(t, off, name, op == "avg")     # noqa: E731
        else:
            body = lambda: self._through_slots(t, name, op == "avg")     # noqa: E731
        self._metered(name, k, 2 * (self.group.size - 1) / self.group.size * k, body)

    def _metered(self, name: str, nbytes: int, vol: float, body) -> None:
        """``body()`` as one collective of ``nbytes``: recorded (the flight recorder; a test
        hook may skip it), inside a profiler range ``shm:name``, its time and ``vol`` bytes
        each way metered under ``name``."""
        done = self.comm.recording(name, self.group.ranks, nbytes)
        if done is SKIPPED:
            return
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"shm:{name}"):
            body()
        self.comm.meter.record(name, vol, vol, time.perf_counter() - t0)
        if done is not None:
            done()

    def _in_place(self, t: torch.Tensor, off: int, name: str, average: bool) -> None:
        """All-reduce ``t``, which lies ``off`` bytes into this member's shared part."""
        n, r = self.group.size, self.group.rank
        k = t.numel()
        copies = [p[off:off + k * t.element_size()].view(t.dtype) for p in self.parts]
        share = -(-k // n)
        bounds = [(min(k, i * share), min(k, (i + 1) * share)) for i in range(n)]
        self._barrier(name)                       # every member's t is complete
        lo, hi = bounds[r]
        if hi > lo:
            total = (copies[r][lo:hi] if r < 2 else       # out may alias an input only
                     torch.empty_like(copies[r][lo:hi]))  # where that input is read first
            torch.add(copies[0][lo:hi], copies[1][lo:hi], out=total)
            for i in range(2, n):
                total.add_(copies[i][lo:hi])
            if average:
                total.div_(n)
            if r >= 2:
                copies[r][lo:hi].copy_(total)
        self._barrier(name)                       # every slice summed
        for i, (a, z) in enumerate(bounds):
            if i != r and z > a:
                copies[r][a:z].copy_(copies[i][a:z])
        self._barrier(name)                       # every member has read our slice

    def serves(self, out: torch.Tensor, inp: torch.Tensor, summing: bool) -> bool:
        """Whether :meth:`reduce_scatter` (``summing``) or :meth:`all_gather` takes these
        tensors: contiguous, one dtype (a float one to sum) and N x ``out`` or N x ``inp``."""
        n = self.group.size
        k = out.numel() if summing else inp.numel()
        whole = inp if summing else out
        return (out.is_contiguous() and inp.is_contiguous() and out.dtype == inp.dtype
                and whole.numel() == n * k and self.chunk % inp.element_size() == 0
                and (inp.dtype in SUMMABLE or not summing))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, name: str,
                       op: str = "avg") -> None:
        """``out`` (k elements) = the group's sum (``avg``: divided by N) of every member's
        slice ``rank`` of ``inp`` (N x k elements), through the slots (module docstring)."""
        if op not in ("sum", "avg") or not self.serves(out, inp, summing=True):
            raise ValueError(f"{name}: the shared-memory reduce-scatter sums or averages "
                             f"contiguous float tensors, inp N x out (got {op!r}, {inp.dtype} "
                             f"{inp.numel()} -> {out.dtype} {out.numel()})")
        n, r, k = self.group.size, self.group.rank, out.numel()
        slices, dst = inp.view(n, k), out.view(-1)
        per = self.chunk // inp.element_size() // n      # elements of each slice per round
        slots = [self._region(i, inp.dtype) for i in range(n)]

        def rounds() -> None:
            for a in range(0, k, per):
                m = min(per, k - a)
                slots[r][:n * m].view(n, m).copy_(slices[:, a:a + m])
                self._barrier(name)
                total = dst[a:a + m]       # may be inp's slice r: its round was copied above
                torch.add(slots[0][r * m:(r + 1) * m], slots[1][r * m:(r + 1) * m], out=total)
                for i in range(2, n):
                    total.add_(slots[i][r * m:(r + 1) * m])
                if op == "avg":
                    total.div_(n)
                self._barrier(name)                   # every member has read its pieces
        whole = inp.numel() * inp.element_size()
        self._metered(name, whole, (n - 1) / n * whole, rounds)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, name: str) -> None:
        """``out`` (N x k elements) = every member's ``inp`` (k elements) in rank order, through
        the slots (module docstring); ``inp`` may be ``out``'s piece ``rank``."""
        if not self.serves(out, inp, summing=False):
            raise ValueError(f"{name}: the shared-memory all-gather takes contiguous tensors of "
                             f"one dtype, out N x inp (got {inp.dtype} {inp.numel()} -> "
                             f"{out.dtype} {out.numel()})")
        n, r, k = self.group.size, self.group.rank, inp.numel()
        src, pieces = inp.view(-1), out.view(n, k)
        in_place = pieces[r].data_ptr() == src.data_ptr()
        per = self.chunk // inp.element_size()
        slots = [self._region(i, inp.dtype) for i in range(n)]

        def rounds() -> None:
            for a in range(0, k, per):
                m = min(per, k - a)
                slots[r][:m].copy_(src[a:a + m])
                self._barrier(name)
                for i in range(n):
                    if i != r:
                        pieces[i, a:a + m].copy_(slots[i][:m])
                    elif not in_place:
                        pieces[i, a:a + m].copy_(src[a:a + m])
                self._barrier(name)                   # every member has read our slot
        whole = out.numel() * out.element_size()
        self._metered(name, whole, (n - 1) / n * whole, rounds)

    def _through_slots(self, t: torch.Tensor, name: str, average: bool) -> None:
        """All-reduce ``t`` chunk by chunk through the slots (module docstring)."""
        n, r = self.group.size, self.group.rank
        flat = t.view(-1)
        per = self.chunk // t.element_size()
        slots = [self._region(i, t.dtype) for i in range(n)]
        result = self._region(n, t.dtype)
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            m = piece.numel()
            slots[r][:m].copy_(piece)
            self._barrier(name)
            share = -(-m // n)
            lo, hi = min(m, r * share), min(m, (r + 1) * share)
            if hi > lo:
                out = result[lo:hi]
                torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
                for i in range(2, n):
                    out.add_(slots[i][lo:hi])
                if average:
                    out.div_(n)
            self._barrier(name)
            piece.copy_(result[:m])
