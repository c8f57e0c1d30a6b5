"""The data-parallel reducer every stage shares: all-reduce (DDP), reduce-scatter and all-gather
(ZeRO 1-3), over one group, with the backend's own collectives or shardwise's point-to-point ring
(shardwise/comm/ring.py, ``parallel.allreduce = ring``; on gloo the ring's reduce-scatter is
~3.5x faster than the backend's).

The ring is a sequence of blocking sends and receives; to overlap it with backward it runs on
one background thread, which also keeps every rank's collectives in the order they were
launched (point-to-point matching needs the same order on every rank). Either way the caller
gets a Work to ``wait()``; a blocking call (``async_op=False``) has already waited.
"""
from __future__ import annotations

import torch

from shardwise.comm.collectives import DONE, Comm, Group, Work
from shardwise.comm.ring import RingRunner


class Reducer:
    """all_reduce / reduce_scatter / all_gather for one group, native or ring, metered by name."""

    def __init__(self, comm: Comm, group: Group, ring: bool):
        self.comm, self.group = comm, group
        self.ring = RingRunner(comm) if ring and group.size > 1 else None

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()

    @staticmethod
    def _finish(work: Work, async_op: bool) -> Work:
        if async_op:
            return work
        work.wait()
        return DONE

    def all_reduce(self, t: torch.Tensor, async_op: bool, name: str) -> Work:
        """t = the group's sum of t, in place."""
        if self.ring is not None:
            return self._finish(self.ring.all_reduce(t, self.group, name=name), async_op)
        return self._finish(self.comm.all_reduce(t, self.group, async_op=async_op, name=name),
                            async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       name: str) -> Work:
        """out = the group's average of slice ``rank`` of ``inp`` (the ring overwrites inp)."""
        if self.ring is not None:
            work = self.ring.reduce_scatter(out, inp, self.group, op="avg", name=name)
            return self._finish(work, async_op)
        return self._finish(self.comm.reduce_scatter(out, inp, self.group, op="avg",
                                                     async_op=async_op, name=name), async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                   name: str) -> Work:
        """out (N*k elements) = every member's inp (k elements), in rank order."""
        if self.ring is not None:
            return self._finish(self.ring.all_gather(out, inp, self.group, name=name), async_op)
        return self._finish(self.comm.all_gather(out, inp, self.group, async_op=async_op,
                                                 name=name), async_op)
