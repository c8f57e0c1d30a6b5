"""The ring's thread under NCCL (issue 31): NCCL needs every rank to issue one communicator's
operations in one order, so a ring run on a background thread while the caller goes on issuing
the group's collectives can interleave differently on each rank and hang. Under NCCL (or with
CUDA data) the RingRunner therefore runs each call on the caller's thread; under gloo it keeps
its thread (gloo matches sends and receives apart from collectives).

No NCCL here: a gloo world is told its dp group is NCCL (``dist.get_backend`` answers "nccl"
inside the forked ranks), which is the only thing the runner's decision reads; the ring's
sends and receives still travel over gloo, launched as one batch per step as under NCCL.
"""
import threading

import pytest
import torch
import torch.distributed as dist

from harness import run_world
import shardwise.comm.ring as ring
from shardwise.comm.collectives import Comm
from shardwise.comm.ring import RingRunner, on_calling_thread
from shardwise.mesh import Mesh

pytestmark = pytest.mark.timeout(120)


def _threads_of_ring_calls(rank, n, backend_says):
    """Run the runner's three collectives; return the threads that posted the ring's p2p, the
    results, and the main thread's name."""
    if backend_says is not None:
        dist.get_backend = lambda group=None: backend_says   # this forked rank only
    mesh = Mesh.build(1, n, 1)
    group, comm = mesh.dp_group, Comm()
    seen = []
    real_post = ring.post

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_post(*args, **kwargs)

    ring.post = spy
    runner = RingRunner(comm)
    t = torch.arange(6.0) + 10 * rank
    w1 = runner.all_reduce(t, group, op="sum")
    # a collective of the caller on the same group, issued while the ring's Work is pending
    flag = torch.tensor([float(rank)])
    comm.all_reduce(flag, group, op="max")
    w1.wait()
    rs = torch.empty(2)
    w2 = runner.reduce_scatter(rs, torch.arange(2.0 * n) + rank, group)
    ag = torch.empty(2 * n)
    w3 = runner.all_gather(ag, torch.full((2,), float(rank)), group)
    w2.wait()
    w3.wait()
    # a failure inside the ring comes out of wait(), on either path
    bad = runner.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1), group)
    try:
        bad.wait()
        raise AssertionError("a mis-sized reduce-scatter did not fail")
    except ValueError as exc:
        assert "expected" in str(exc)
    runner.close()
    ring.post = real_post
    return set(seen), threading.current_thread().name, t, rs, ag, flag


def _check_results(results, n):
    for rank, (_, _, t, rs, ag, flag) in enumerate(results):
        torch.testing.assert_close(t, n * torch.arange(6.0) + 10 * sum(range(n)))
        base = torch.arange(2.0 * n)[2 * rank:2 * rank + 2]
        torch.testing.assert_close(rs, n * base + sum(range(n)))
        torch.testing.assert_close(ag, torch.arange(n, dtype=torch.float32).repeat_interleave(2))
        assert float(flag) == n - 1


@pytest.mark.parametrize("n", [2, 3])
def test_ring_runs_on_the_calling_thread_under_nccl(n):
    results = run_world(_threads_of_ring_calls, n, "nccl", timeout=60)
    for seen, main, *_ in results:
        assert seen == {main}, f"ring p2p posted from {seen}, not the caller's thread {main}"
    _check_results(results, n)


def test_ring_keeps_its_thread_under_gloo():
    results = run_world(_threads_of_ring_calls, 2, None, timeout=60)
    for seen, main, *_ in results:
        assert main not in seen and all(s.startswith("shardwise-ring") for s in seen)
    _check_results(results, 2)


def test_the_decision_reads_the_backend_and_the_data():
    from shardwise.comm.collectives import Group
    no_pg = Group(pg=None, ranks=(0, 1), rank=0)    # no process group to ask: not NCCL
    assert not on_calling_thread(no_pg, [torch.zeros(1)])
