"""ZeRO's transient memory (stages 1-3): the bytes of the buffers that come and go, by kind, and
their high-water marks. One :class:`ZeroMemory` is owned by the strategy (``strategy.memory``);
the strategy's ``memory_ledger()`` reads its peak as the ``comm_buffers`` category.

Partition: nothing is sharded here; this is bookkeeping, per rank. Collectives: none. Memory: a
few integers. Traffic: none. Transient buffers are accounted by kind, when they are allocated and
freed:

    staging    whole-size gradient buffers (stages 2-3) and reduce-scatter temporaries
    gathered   stage 3's whole units, from the start of their all-gather to their release
    backend    what the backend itself allocates for a collective in flight: gloo (the CPU
               backend) runs ``reduce_scatter_tensor`` as an allreduce of a copy of the whole
               input, and ``all_gather_into_tensor`` into a whole-size temporary (measured: a 50 MiB
               reduce-scatter or all-gather raises resident memory by 50 MiB, an in-place
               allreduce by 2 MiB); each lives from the launch until the collective is waited.
               shardwise's ring (``--allreduce ring``) works in place, and so does shared
               memory (comm/shm.py): nothing is counted.
    shared     the shared-memory collectives' region ((N + 1) slots of 4 MiB, comm/shm.py),
               from the first collective that decided to use it, for the rest of the run.

``comm_buffers`` is the high-water mark of all kinds together (``peaks()['total']``). Each
change calls ``on_change`` (the strategy's parallel/ledger.py ``_note_instant``), which samples
the instant activations + transient buffers peak together. The ledger is what this rank's
training state costs: with malloc returning freed memory (shardwise/bench/memory.py) the
measured peak resident memory minus the resident memory after ``import torch`` should come
within a few percent of it.
"""
from __future__ import annotations

from typing import Callable

KINDS = ("staging", "gathered", "backend", "shared")


class ZeroMemory:
    """Transient bytes alive now and their high-water marks, by kind (module docstring)."""

    def __init__(self, on_change: Callable[[], None], backend_copies: Callable[[], bool]):
        self.on_change = on_change
        self.backend_copies = backend_copies     # whether gloo's native collectives serve (copy)
        self.live = dict.fromkeys(KINDS, 0)                # transient bytes now, by kind
        self.peak = {**dict.fromkeys(KINDS, 0), "total": 0}   # their high-water marks

    def alloc(self, kind: str, nbytes: int) -> None:
        """Account a transient buffer; the ledger reports high-water marks."""
        self.live[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        self.peak["total"] = max(self.peak["total"], self.live_total())
        self.on_change()

    def release(self, kind: str, nbytes: int) -> None:
        self.live[kind] -= nbytes

    def live_total(self) -> int:
        return sum(self.live.values())

    def backend_bytes(self, nbytes: int) -> int:
        """Bytes the backend allocates for a reduce-scatter / all-gather over ``nbytes`` (the
        whole, unsharded size): gloo's native collectives copy it; the ring, shared memory and
        a group of one do not (``backend_copies()``)."""
        return nbytes if self.backend_copies() else 0

    def peaks(self) -> dict[str, int]:
        """High-water marks: ``staging`` (whole-size gradient buffers and temporaries),
        ``gathered`` (stage 3's whole units), ``backend`` (the backend's own copies),
        ``shared`` (the shared-memory region), ``total`` (all at once)."""
        return dict(self.peak)
