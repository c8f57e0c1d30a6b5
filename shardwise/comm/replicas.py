"""The link between replica groups (``--ft-replicas``): a gloo process group per quorum.

Rank r of every member group of a quorum (comm/quorum.py) joins one process group, the *lane*
of in-group rank r: ``ProcessGroupGloo(PrefixStore("ft/<link>/<r>", lighthouse), index, size)``
with index = the group's position among the members, built when a decision names a new link and
reused while the members stay. Its collectives are the backend's own, called on the object
(it is not registered with the world's c10d state, which belongs to the group's own world).
Nothing here raises on a lost peer: :meth:`ReplicaLink.all_reduce_sum` returns False, and the
quorum's vote decides what happens next. Every wait on the link polls (comm/collectives.Work,
sleeping 1 ms between polls; a send / recv, and the link's construction, which connects to
every member, through a waiting thread, as those cannot be polled) up to the link's timeout,
so a SIGTERM's Python handler runs at once: a blocking gloo wait held it, and with it
torchrun's shutdown of a group that lost a rank, until the timeout. When the members have
different rank counts (``--ft-rejoin-nproc``) only the lanes of each piece's *leaders* (its
rank 0 over dp x cp in each group) are built; what a leader received reaches its piece's other
ranks by :func:`broadcast_state` (or a plain broadcast of the flat) over its dp x cp peers.

Metering (on the rank's CommMeter, op ``ft_all_reduce`` / ``ft_state``): the ring figure for
the all-reduce (2(N-1)/N x K bytes sent and received), the exact bytes for the state copies
(the in-group broadcast of a state: the Comm's own figure, named ``ft_state``).
"""
from __future__ import annotations

import io
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, CommMeter, Group, Work

PAUSE_S = 0.001    # between two polls of a link's wait: a sleeping poll costs no core (the
                   # groups' ranks share the host's), and at most this much latency per wait


def _to_bytes(state: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu",
                      weights_only=False)


def broadcast_state(comm: Comm, group: Group, state: dict | None) -> dict:
    """``state`` (given on member 0 of ``group``, None elsewhere) on every member: its
    torch.save bytes, their count first (two broadcasts over ``group``, on the run's device:
    NCCL moves device tensors only, and gloo stages a CUDA tensor through the host itself)."""
    device = comm.device
    data = _to_bytes(state).to(device) if group.rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    comm.broadcast(size, 0, group, name="ft_state")
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast(data, 0, group, name="ft_state")
    return state if group.rank == 0 else _from_bytes(data.cpu())


class _OnThread:
    """A blocking gloo call made pollable: a send / recv Work's wait (gloo's p2p Works report
    completion only inside ``wait()``; ``is_completed()`` stays False: measured on torch 2.13,
    as comm/collectives.py says), or the link's construction (its connections to every peer).
    A daemon thread makes the call, bounded by the link's own timeout, and :class:`Work` polls
    the thread. A caller that leaves meanwhile (a stop) leaves the thread behind: a rank ends
    with os._exit (launch/ranks.py), which does not wait for it."""

    def __init__(self, call):
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True,
                                       name="shardwise-ft-link")
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.result = call()
        except BaseException as exc:      # re-raised on the caller's thread by wait()
            self.error = exc

    def is_completed(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, timeout: timedelta | None = None) -> None:
        self.thread.join(None if timeout is None else timeout.total_seconds())
        if self.thread.is_alive():
            raise TimeoutError("no peer within the link's timeout")
        if self.error is not None:
            raise self.error


class ReplicaLink:
    """Lane ``lane`` of the quorum's members, this group at ``index`` of ``size``."""

    def __init__(self, store: dist.Store, link: int, lane: int, index: int, size: int,
                 timeout: float, meter: CommMeter):
        self.index, self.size, self.meter = index, size, meter
        self.timeout = timedelta(seconds=timeout)
        # connecting to every member blocks until they all came (or the timeout): polled too
        build = _OnThread(lambda: dist.ProcessGroupGloo(
            dist.PrefixStore(f"ft/{link}/{lane}", store), index, size, self.timeout))
        self._wait(build, "ft_link")
        self.pg = build.result

    def _wait(self, work, op: str) -> None:
        """Poll ``work`` (comm/collectives.Work, sleeping PAUSE_S between polls) until it is
        done, so that a signal's Python handler runs meanwhile; CollectiveError when it failed
        or outlived the link's timeout."""
        Work(work, None, op, timeout=self.timeout, spin=True, pause=PAUSE_S).wait()

    def all_reduce_sum(self, flat: torch.Tensor) -> bool:
        """Sum ``flat`` over the members in place; False when a peer was lost or none came
        within the link's timeout (the contents are then undefined). A tensor off the CPU (a
        GPU run's flat) is summed in a host copy: the link is gloo, which aborts the process
        when handed GPU memory (docs/gpu.md)."""
        began = time.perf_counter()
        host = flat if flat.device.type == "cpu" else flat.to("cpu")
        try:
            self._wait(self.pg.allreduce([host]), "ft_all_reduce")
        except RuntimeError:              # CollectiveError
            return False
        if host is not flat:
            flat.copy_(host)
        k = flat.numel() * flat.element_size() * 2 * (self.size - 1) / self.size
        self.meter.record("ft_all_reduce", k, k, time.perf_counter() - began)
        return True

    def send_state(self, state: dict, receivers: list[int]) -> None:
        """Send a state dict (torch.save's bytes) to each member index in ``receivers``;
        CollectiveError when a receiver was lost or did not take it within the timeout."""
        data = _to_bytes(state)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for dst in receivers:
            self._wait(_OnThread(self.pg.send([size], dst, 0).wait), "ft_state")
            self._wait(_OnThread(self.pg.send([data], dst, 1).wait), "ft_state")
            self.meter.record("ft_state", data.numel() + 8, 0)

    def recv_state(self, src: int) -> dict:
        """The state dict member ``src`` sent (loaded on the CPU); CollectiveError when ``src``
        was lost or sent nothing within the timeout."""
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(_OnThread(self.pg.recv([size], src, 0).wait), "ft_state")
        data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(_OnThread(self.pg.recv([data], src, 1).wait), "ft_state")
        self.meter.record("ft_state", 0, data.numel() + 8)
        return _from_bytes(data)
