"""Waiting by polling (``Comm(spin=True)``, ``train.comm_wait``): every collective gives the
same result as a blocking wait, blocking and async alike; a poll whose peer never comes fails
at the timeout; auto polls only where each local rank has cores of its own."""
import datetime
import time

import pytest
import torch

from harness import run_world
from shardwise.comm.collectives import CollectiveError, Comm, Work
from shardwise.mesh import Mesh
from shardwise.run.runtime import spins

pytestmark = pytest.mark.timeout(180)


def _collectives(rank, n):
    group = Mesh.build(1, n, 1).world
    out = {}
    for spin in (False, True):
        comm = Comm(spin=spin, timeout=datetime.timedelta(seconds=60))
        a = torch.arange(6.0) * (rank + 1)
        comm.all_reduce(a, group)                              # blocking
        b = torch.full((3,), float(rank))
        work = comm.all_reduce(b, group, op="avg", async_op=True)
        work.wait()                                            # async, then its "after"
        c = torch.tensor([float(rank)]) if rank == 0 else torch.zeros(1)
        comm.broadcast(c, 0, group)
        g = torch.empty(2 * n)
        comm.all_gather(g, torch.full((2,), float(rank)), group)
        rs = torch.empty(2)
        comm.reduce_scatter(rs, torch.arange(2.0 * n), group)
        comm.barrier(group)
        out[spin] = (a, b, c, g, rs, comm.meter.snapshot()["all_reduce"]["calls"])
    return out


class _NeverDone:
    """A Work whose peer never comes: it never completes; ``wait(timeout)`` fails as gloo's."""

    def __init__(self):
        self.polls, self.waited = 0, None

    def is_completed(self):
        self.polls += 1
        return False

    def wait(self, timeout=None):
        self.waited = timeout
        raise RuntimeError("Operation timed out!")


def test_polling_equals_blocking():
    ranks = run_world(_collectives, 2, timeout=120)
    for out in ranks:
        block, spin = out[False], out[True]
        for x, y in zip(block[:5], spin[:5]):
            assert torch.equal(x, y)
        assert torch.equal(block[0], torch.arange(6.0) * 3)        # 1x + 2x
        assert torch.equal(block[1], torch.full((3,), 0.5))        # mean of 0 and 1
        assert block[5] == spin[5] == 2                            # both metered


def test_a_poll_gives_up_at_the_timeout():
    work = _NeverDone()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="all_reduce"):
        Work(work, None, "all_reduce", timeout=datetime.timedelta(seconds=0.5), spin=True).wait()
    assert 0.45 < time.monotonic() - t0 < 3 and work.polls > 10
    assert work.waited == datetime.timedelta(milliseconds=1)   # fails at once, not after 2x


def test_auto_polls_only_where_each_rank_has_its_own_cores(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spins("auto", cpu, 2) and not spins("auto", cpu, 4)       # 4 ranks on 2 cores
    assert not spins("auto", cpu, 1) and not spins("auto", cuda, 2)  # one rank; NCCL
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert spins("auto", cpu, 8)                                     # 2 of 8 on this host
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not spins("auto", cpu, 8)
    assert spins("spin", cpu, 4) and not spins("block", cpu, 2)
