"""The data-parallel reducer every stage shares: all-reduce (DDP), reduce-scatter and all-gather
(ZeRO 1-3), over one group, with the backend's own collectives or shardwise's point-to-point ring
(shardwise/comm/ring.py, ``parallel.allreduce = ring``; on gloo the ring's reduce-scatter is
~3.5x faster than the backend's).

``shm`` (and ``auto`` where it applies) serves all three from shared memory when every member
runs on this host (shardwise/comm/shm.py; the all-reduce about half gloo's time on CPU, less
again for tensors allocated in the shared mapping itself: ``shared_buffer``; gloo's
reduce-scatter all-reduces the whole tensor, the shared-memory one reads each slice once). They
run on the calling thread: a Work returned for them is already done, so they overlap nothing.
``auto`` takes it when every member is on one x86 CPU host and waits by polling
(``train.comm_wait``: each rank has cores of its own), else native. The choice is made at the
first collective, from every member's answers gathered once, so all members agree; an explicit
``shm`` that cannot apply stops with the reason.

The ring is a sequence of blocking sends and receives; to overlap it with backward it runs on
one background thread, which also keeps every rank's collectives in the order they were
launched (point-to-point matching needs the same order on every rank); under NCCL it runs on
the calling thread instead (one order of calls per communicator: comm/ring.py). Either way the
caller gets a Work to ``wait()``; a blocking call (``async_op=False``) has already waited.
"""
from __future__ import annotations

import torch

from shardwise.comm import shm
from shardwise.comm.collectives import DONE, Comm, Group, Work
from shardwise.comm.ring import RingRunner

KINDS = ("auto", "native", "ring", "shm")


class Reducer:
    """all_reduce / reduce_scatter / all_gather for one group, native, ring or shared memory,
    metered by name."""

    def __init__(self, comm: Comm, group: Group, kind: str, device: torch.device | None = None):
        if kind not in KINDS:
            raise ValueError(f"Reducer: kind {kind!r} is not one of {KINDS}")
        self.comm, self.group, self.kind = comm, group, kind
        self.device = device if device is not None else torch.device("cpu")
        self.ring = RingRunner(comm) if kind == "ring" and group.size > 1 else None
        self._shm: shm.ShmCollectives | None | bool = None   # None: not decided yet; False: no

    def _shared_memory(self) -> shm.ShmCollectives | None:
        """The shared-memory collectives, decided (collectively) at the first call."""
        if self._shm is None:
            self._shm = False
            if self.kind in ("auto", "shm") and self.group.size > 1:
                why = shm.unusable(self.comm, self.group, self.device,
                                   need_polling=self.kind == "auto")
                if why is None:
                    self._shm = shm.ShmCollectives(self.comm, self.group)
                elif self.kind == "shm":
                    raise RuntimeError(f"parallel.allreduce = shm: {why}; fix: --allreduce auto "
                                       "(shared memory where it applies) or native")
        return self._shm or None

    def shared_buffer(self, nbytes: int) -> torch.Tensor | None:
        """Collective: ``nbytes`` (uint8, zeroed) in this member's part of a shared mapping whose
        tensors all-reduce in place, with nothing copied in or out (comm/shm.py ``share``), or
        None where the shared-memory all-reduce does not serve this group. Every member must
        carve it identically (same tensors at the same offsets)."""
        fast = self._shared_memory()
        return fast.share(nbytes) if fast is not None else None

    def shared_memory(self) -> bool:
        """Whether shared memory serves this group (decided collectively at the first call of
        this or of any collective here: every member must ask at the same point)."""
        return self._shared_memory() is not None

    @property
    def uses_shared_memory(self) -> bool:
        return bool(self._shm)

    def in_place(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in this member's part of the shared mapping (:meth:`shared_buffer`),
        so the shared-memory all-reduce sums it where it is, copying nothing in or out."""
        return bool(self._shm) and self._shm._offset(t) is not None

    def nbytes(self) -> int:
        """Bytes of the shared-memory region (0 when none is mapped)."""
        return self._shm.nbytes if self._shm else 0

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()

    @staticmethod
    def _finish(work: Work, async_op: bool) -> Work:
        if async_op:
            return work
        work.wait()
        return DONE

    def all_reduce(self, t: torch.Tensor, async_op: bool, name: str, op: str = "sum") -> Work:
        """t = the group's sum of t (``op="avg"``: divided by the group's size), in place."""
        fast = self._shared_memory()
        if fast is not None and t.is_contiguous() and t.dtype in shm.SUMMABLE:
            fast.all_reduce(t, name, op)    # synchronous: the returned Work is already done
            return DONE
        if self.ring is not None:
            return self._finish(self.ring.all_reduce(t, self.group, op=op, name=name), async_op)
        return self._finish(self.comm.all_reduce(t, self.group, op=op, async_op=async_op,
                                                 name=name), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       name: str) -> Work:
        """out = the group's average of slice ``rank`` of ``inp`` (the ring overwrites inp)."""
        fast = self._shared_memory()
        if fast is not None and fast.serves(out, inp, summing=True):
            fast.reduce_scatter(out, inp, name, op="avg")     # synchronous: already done
            return DONE
        if self.ring is not None:
            work = self.ring.reduce_scatter(out, inp, self.group, op="avg", name=name)
            return self._finish(work, async_op)
        return self._finish(self.comm.reduce_scatter(out, inp, self.group, op="avg",
                                                     async_op=async_op, name=name), async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                   name: str) -> Work:
        """out (N*k elements) = every member's inp (k elements), in rank order."""
        fast = self._shared_memory()
        if fast is not None and fast.serves(out, inp, summing=False):
            fast.all_gather(out, inp, name)                   # synchronous: already done
            return DONE
        if self.ring is not None:
            return self._finish(self.ring.all_gather(out, inp, self.group, name=name), async_op)
        return self._finish(self.comm.all_gather(out, inp, self.group, async_op=async_op,
                                                 name=name), async_op)
