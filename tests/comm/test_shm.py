"""The shared-memory allreduce (comm/shm.py, ``parallel.allreduce = shm | auto``): the group's
sum on every rank, bit-identical across ranks, over several chunks and uneven slices; no file
left behind; a member that never comes fails at the timeout naming it; ``auto`` takes it only on
one host with polling ranks, and an explicit ``shm`` that cannot apply says why."""
import datetime
import glob

import pytest
import torch

from harness import run_world
from shardwise.comm import shm
from shardwise.comm.collectives import CollectiveError, Comm
from shardwise.comm.reducer import Reducer
from shardwise.mesh import Mesh

pytestmark = pytest.mark.timeout(180)


def _sums(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=60))
    fast = shm.ShmAllReduce(comm, group, chunk_bytes=4096)      # 1,024 fp32 per chunk
    out = {}
    for dtype, numel in ((torch.float32, 2_501), (torch.bfloat16, 3_000), (torch.float64, 7)):
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(numel, generator=gen).to(dtype)
        ref = x.clone()
        comm.all_reduce(ref, group)                             # gloo's own sum
        fast.all_reduce(x, "test_shm")
        out[str(dtype)] = (x, ref)
    out["meter"] = comm.meter.snapshot()["test_shm"]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_sum_equals_gloo_and_is_the_same_on_every_rank(world):
    before = set(glob.glob("/dev/shm/shardwise-allreduce-*"))
    ranks = run_world(_sums, world, timeout=120)
    for key in ("torch.float32", "torch.bfloat16", "torch.float64"):
        first = ranks[0][key][0]
        for out in ranks:
            x, ref = out[key]
            assert torch.equal(x, first)                         # every rank: the same bits
            tol = 2e-2 if "bfloat16" in key else 1e-6
            torch.testing.assert_close(x.double(), ref.double(), rtol=tol, atol=tol)
    k = 2_501 * 4 + 3_000 * 2 + 7 * 8
    assert ranks[0]["meter"]["calls"] == 3
    assert ranks[0]["meter"]["bytes_sent"] == pytest.approx(2 * (world - 1) / world * k, abs=3)
    assert set(glob.glob("/dev/shm/shardwise-allreduce-*")) == before   # unlinked at once


def _one_never_comes(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=2))
    fast = shm.ShmAllReduce(comm, group)
    if rank == 1:
        return "stayed away"
    try:
        fast.all_reduce(torch.ones(10), "grads")
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_a_member_that_never_comes_fails_at_the_timeout_naming_it():
    msg = run_world(_one_never_comes, 2, timeout=60)[0]
    assert msg.startswith("grads:") and "member(s) [1]" in msg and "2 s" in msg


def _choices(rank, n, split_hosts):
    group = Mesh.build(1, n, 1).world
    if split_hosts:
        shm._host = lambda: f"host{rank}"
    out = {}
    for kind, spin in (("auto", True), ("auto", False), ("native", True), ("shm", False)):
        reducer = Reducer(Comm(spin=spin), group, kind)
        t = torch.full((5,), float(rank + 1))
        try:
            reducer.all_reduce(t, async_op=False, name="g")
            out[(kind, spin)] = (reducer.uses_shared_memory, t[0].item(), reducer.nbytes())
        except RuntimeError as exc:
            out[(kind, spin)] = str(exc)
    return out


def test_auto_takes_shared_memory_only_on_one_host_with_polling_ranks():
    out = run_world(_choices, 2, False, timeout=120)[0]
    assert out[("auto", True)] == (True, 3.0, 3 * shm.CHUNK_BYTES + 2 * 64)
    assert out[("auto", False)] == (False, 3.0, 0)       # blocking waits: ranks share cores
    assert out[("native", True)] == (False, 3.0, 0)
    assert out[("shm", False)][0] is True                 # asked for: taken even when blocking


def test_explicit_shm_across_hosts_stops_with_the_reason_and_auto_falls_back():
    out = run_world(_choices, 2, True, timeout=120)[0]
    assert out[("auto", True)] == (False, 3.0, 0)
    msg = out[("shm", False)]
    assert "parallel.allreduce = shm: the members run on 2 hosts" in msg and "fix:" in msg


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind 'fast'"):
        Reducer(Comm(), Mesh.build(1, 1, 1).world, "fast")
