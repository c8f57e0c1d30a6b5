"""Pipeline sends and receives through shared memory between the stages of one host
(``parallel.pp_transport = shm``, or ``auto`` where it applies; comm/p2p.py routes to it).

Why: gloo moves a point-to-point message through a TCP socket and its send / recv Works cannot
be polled, so a stage that waits for an activation sleeps and pays the wake-up (comm/shm.py,
comm/collectives.py). Here each ordered pair of members (src, dst) shares a byte ring: src
copies a message in and advances ``head``; dst copies it out and advances ``tail``. Messages of
one direction are matched in the order posted, as with gloo, so the schedule checker's proof
carries over unchanged.

Progress: a send copies as much as fits at once and is complete when its last byte is in the
ring (the receiver has not read it yet; nothing else is needed from the sender). A send or
receive that cannot finish stays pending, and *every* wait advances every pending operation of
this rank, on every ring, before it polls again: a stage waiting for a gradient still drains its
own activation into a full ring, so two stages that each send before they receive never wait for
each other. A message larger than the ring streams through it in pieces.

Waits poll (the cores stay awake), backing off to 50 us sleeps after 1 ms; an operation not done
within the collective timeout raises CollectiveError naming its peer. As in comm/shm.py, the
counters are read and written in program order only on x86 (TSO), so ``auto`` takes this path
only there, on CPU tensors, with every member on this host and polling.

Memory: one ring of ``capacity`` bytes (at most 4 MiB; the pipeline asks for two of its
activation messages, :func:`ring_bytes`) per ordered pair of neighbours (s, s +- 1 mod p), in
one shared file unlinked once mapped; each rank touches its own sending and receiving rings.
"""
from __future__ import annotations

import datetime
from collections import deque

import torch

from shardwise.comm import shm
from shardwise.comm.collectives import SKIPPED, Comm, CollectiveError, Group

CAPACITY = 4 << 20
_LINE = 64
KINDS = ("auto", "native", "shm")


def neighbours(p: int) -> list[tuple[int, int]]:
    """The ordered pairs a pipeline of ``p`` stages sends between (s to s + 1 and back, the
    last to the first for interleaving)."""
    return sorted({pair for s in range(p) for pair in ((s, (s + 1) % p), ((s + 1) % p, s))
                   if pair[0] != pair[1]})


def ring_bytes(message: int) -> int:
    """A ring for messages of ``message`` bytes: room for two (a send need not wait for the
    receiver to take the one before), at least 64 KiB, at most CAPACITY (a larger message
    streams through in pieces), whole pages."""
    size = min(CAPACITY, max(64 << 10, 2 * message))
    return -(-size // 4096) * 4096


def transport_for(comm: Comm, group: Group, device: torch.device, kind: str,
                  pairs: list[tuple[int, int]] | None = None,
                  capacity: int = CAPACITY) -> "ShmP2P | None":
    """The shared-memory transport for ``group`` (None: the backend's p2p), with rings of
    ``capacity`` bytes. Collective over ``group`` unless ``kind`` is native or the group is
    one member."""
    if kind not in KINDS:
        raise ValueError(f"pp_transport {kind!r} is not one of {KINDS}")
    if kind == "native" or group.size == 1:
        return None
    why = shm.unusable(comm, group, device, need_polling=kind == "auto")
    if why is None:
        return ShmP2P(comm, group, capacity=capacity, pairs=pairs)
    if kind == "shm":
        raise RuntimeError(f"parallel.pp_transport = shm: {why}; fix: --pp-transport auto "
                           "(shared memory where it applies) or native")
    return None


class _Op:
    """One send or receive: its bytes, its peer, how many bytes have moved."""

    def __init__(self, transport: "ShmP2P", kind: str, tensor: torch.Tensor, peer: int, name: str):
        self.transport, self.kind, self.peer, self.name = transport, kind, peer, name
        self.tensor = tensor                                  # kept alive until done
        self.bytes = tensor.reshape(-1).view(torch.uint8)
        self.moved = 0
        self.recorded = None                                  # the flight recorder's end

    @property
    def done(self) -> bool:
        return self.moved == self.bytes.numel()

    def wait(self, timeout=None) -> None:
        self.transport.wait_for(self)


class ShmP2P:
    """Byte rings between the ordered pairs ``pairs`` of ``group``'s members (every ordered
    pair when None), created collectively by every member."""

    def __init__(self, comm: Comm, group: Group, capacity: int = CAPACITY,
                 pairs: list[tuple[int, int]] | None = None):
        n = group.size
        self.comm, self.group, self.capacity = comm, group, capacity
        self.pairs = sorted(pairs if pairs is not None else
                            [(s, d) for s in range(n) for d in range(n) if s != d])
        stride = capacity + 2 * _LINE
        nbytes = len(self.pairs) * stride
        buf = shm.map_shared(comm, group, nbytes, "shardwise-p2p-")
        self.nbytes = nbytes
        # what this rank touches (its sending and receiving rings): the ledger's comm_buffers
        self.local_bytes = sum(stride for pair in self.pairs if group.rank in pair)
        self.rings = {}
        for i, pair in enumerate(self.pairs):
            base = i * stride
            counters = buf[base + capacity:base + stride].view(torch.int64)
            self.rings[pair] = (buf[base:base + capacity], counters[0:1], counters[_LINE // 8:
                                                                                  _LINE // 8 + 1])
        # local copies of the counters this rank owns: head of each ring it writes, tail of each
        # it reads
        self.head = {p: 0 for p in self.pairs if p[0] == group.rank}
        self.tail = {p: 0 for p in self.pairs if p[1] == group.rank}
        self.pending: dict[tuple[str, int], deque] = {}
        timeout = comm.timeout or datetime.timedelta(minutes=5)
        self.timeout_s = timeout.total_seconds()

    # -- posting and progress --------------------------------------------------------------
    def post(self, kind: str, tensor: torch.Tensor, peer: int, name: str) -> _Op:
        pair = (self.group.rank, peer) if kind == "send" else (peer, self.group.rank)
        if pair not in self.rings:
            raise ValueError(f"shared-memory p2p: no ring for {kind} with member {peer}")
        op = _Op(self, kind, tensor, peer, name)
        recorded = self.comm.recording(name, tuple(self.group.global_rank(i) for i in pair),
                                       op.bytes.numel())
        op.recorded = recorded if callable(recorded) and recorded is not SKIPPED else None
        self.pending.setdefault((kind, peer), deque()).append(op)
        self.progress()
        return op

    def progress(self) -> bool:
        """Move every pending operation as far as the rings allow; whether anything moved."""
        moved = False
        for (kind, peer), queue in self.pending.items():
            while queue:
                op = queue[0]
                moved |= self._send(op) if kind == "send" else self._recv(op)
                if not op.done:
                    break
                queue.popleft()
                self._meter(op)
        return moved

    def _send(self, op: _Op) -> bool:
        pair = (self.group.rank, op.peer)
        data, head_c, tail_c = self.rings[pair]
        head = self.head[pair]
        free = self.capacity - (head - int(tail_c.item()))
        k = min(free, op.bytes.numel() - op.moved)
        if k <= 0:
            return False
        self._copy(data, head, op.bytes[op.moved:op.moved + k], into_ring=True)
        self.head[pair] = head + k
        head_c.fill_(head + k)                 # published after the bytes (x86 store order)
        op.moved += k
        return True

    def _recv(self, op: _Op) -> bool:
        pair = (op.peer, self.group.rank)
        data, head_c, tail_c = self.rings[pair]
        tail = self.tail[pair]
        ready = int(head_c.item()) - tail
        k = min(ready, op.bytes.numel() - op.moved)
        if k <= 0:
            return False
        self._copy(data, tail, op.bytes[op.moved:op.moved + k], into_ring=False)
        self.tail[pair] = tail + k
        tail_c.fill_(tail + k)                 # the space is free once the bytes are out
        op.moved += k
        return True

    def _copy(self, ring: torch.Tensor, position: int, part: torch.Tensor, into_ring: bool):
        """Copy ``part`` into / out of the ring at ``position`` (wrapping at its end)."""
        start = position % self.capacity
        first = min(part.numel(), self.capacity - start)
        for r, p in ((ring[start:start + first], part[:first]),
                     (ring[:part.numel() - first], part[first:])):
            if p.numel():
                (r.copy_(p) if into_ring else p.copy_(r))

    def _meter(self, op: _Op) -> None:
        if op.recorded is not None:
            op.recorded()
        k = op.bytes.numel()
        self.comm.meter.record(op.name, k if op.kind == "send" else 0,
                               k if op.kind == "recv" else 0)

    def wait_for(self, op: _Op) -> None:
        """Progress everything until ``op`` is done (its blocked time metered)."""
        if op.done:
            return

        def done() -> bool:      # progress first: a wait moves every pending transfer
            while self.progress() and not op.done:
                pass
            return op.done

        def failure() -> CollectiveError:
            return CollectiveError(op.name, TimeoutError(
                f"shared-memory {op.kind} with pipeline member {op.peer}: not done within "
                f"{self.timeout_s:.0f} s ({op.moved} of {op.bytes.numel()} bytes)"))
        self.comm.meter.add_time(op.name, shm.poll(done, self.timeout_s, failure))
