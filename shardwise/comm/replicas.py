"""The link between replica groups (``--ft-replicas``): a gloo process group per quorum.

Rank r of every member group of a quorum (comm/quorum.py) joins one process group, the *lane*
of in-group rank r: ``ProcessGroupGloo(PrefixStore("ft/<link>/<r>", lighthouse), index, size)``
with index = the group's position among the members, built when a decision names a new link and
reused while the members stay. Its collectives are the backend's own, called on the object
(it is not registered with the world's c10d state, which belongs to the group's own world).
Nothing here raises on a lost peer: :meth:`ReplicaLink.all_reduce_sum` returns False, and the
quorum's vote decides what happens next. When the members have different rank counts
(``--ft-rejoin-nproc``: DDP or ZeRO) only the lane of in-group rank 0, the groups' *leaders*, is
built; what its leader received reaches a group's other ranks by :func:`broadcast_state` (or a
plain broadcast of the flat) over the group's own world.

Metering (on the rank's CommMeter, op ``ft_all_reduce`` / ``ft_state``): the ring figure for
the all-reduce (2(N-1)/N x K bytes sent and received), the exact bytes for the state copies
(the in-group broadcast of a state: the Comm's own figure, named ``ft_state``).
"""
from __future__ import annotations

import io
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, CommMeter, Group


def _to_bytes(state: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu",
                      weights_only=False)


def broadcast_state(comm: Comm, group: Group, state: dict | None) -> dict:
    """``state`` (given on member 0 of ``group``, None elsewhere) on every member: its
    torch.save bytes, their count first (two broadcasts over ``group``, host tensors)."""
    data = _to_bytes(state) if group.rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    comm.broadcast(size, 0, group, name="ft_state")
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    comm.broadcast(data, 0, group, name="ft_state")
    return state if group.rank == 0 else _from_bytes(data)


class ReplicaLink:
    """Lane ``lane`` of the quorum's members, this group at ``index`` of ``size``."""

    def __init__(self, store: dist.Store, link: int, lane: int, index: int, size: int,
                 timeout: float, meter: CommMeter):
        self.index, self.size, self.meter = index, size, meter
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"ft/{link}/{lane}", store), index,
                                        size, timedelta(seconds=timeout))

    def all_reduce_sum(self, flat: torch.Tensor) -> bool:
        """Sum ``flat`` over the members in place; False when a peer was lost (the contents are
        then undefined)."""
        began = time.perf_counter()
        try:
            self.pg.allreduce([flat]).wait()
        except RuntimeError:
            return False
        k = flat.numel() * flat.element_size() * 2 * (self.size - 1) / self.size
        self.meter.record("ft_all_reduce", k, k, time.perf_counter() - began)
        return True

    def send_state(self, state: dict, receivers: list[int]) -> None:
        """Send a state dict (torch.save's bytes) to each member index in ``receivers``."""
        data = _to_bytes(state)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for dst in receivers:
            self.pg.send([size], dst, 0).wait()
            self.pg.send([data], dst, 1).wait()
            self.meter.record("ft_state", data.numel() + 8, 0)

    def recv_state(self, src: int) -> dict:
        """The state dict member ``src`` sent (loaded on the CPU)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([size], src, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        self.meter.record("ft_state", 0, data.numel() + 8)
        return _from_bytes(data)
