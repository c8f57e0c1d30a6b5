"""The ring allreduce / reduce-scatter / all-gather agree with a plain sum, for any size and dtype."""
import pytest
import torch

from harness import run_world
from shardwise.comm.collectives import Comm, Group
from shardwise.comm.ring import RingRunner, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from shardwise.mesh import Mesh

pytestmark = pytest.mark.timeout(180)
SIZES = [1, 3, 7, 64, 1001]   # smaller than, not divisible by, and divisible by the world
DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16]


def _data(rank, size, dtype):
    g = torch.Generator().manual_seed(rank * 100 + size)
    return (torch.randn(size, generator=g) * 10).to(dtype)


def _ring_checks(rank, n):
    mesh = Mesh.build(1, n, 1)
    comm = Comm()
    out = {}
    for size in SIZES:
        for dtype in DTYPES:
            t = _data(rank, size, dtype)
            ring_all_reduce(comm, t, mesh.dp_group)
            out[(size, str(dtype))] = t
    # reduce-scatter / all-gather on equal shards
    inp = torch.arange(4.0 * n) + rank
    rs = torch.empty(4)
    ring_reduce_scatter(comm, rs, inp.clone(), mesh.dp_group)
    ag = torch.empty(4 * n)
    ring_all_gather(comm, ag, torch.full((4,), float(rank)), mesh.dp_group)
    runner = RingRunner(comm)
    t = torch.ones(10) * (rank + 1)
    work = runner.all_reduce(t, mesh.dp_group, op="avg")
    work.wait()
    runner.close()
    return out, rs, ag, t


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_matches_sum(n):
    results = run_world(_ring_checks, n)
    for rank, (out, rs, ag, avg) in enumerate(results):
        for size in SIZES:
            for dtype in DTYPES:
                expected = sum(_data(r, size, dtype).double() for r in range(n))
                got = out[(size, str(dtype))]
                # fp16 sums of values ~10-40 round to steps of 2^-6..2^-5 (rtol ~1e-3 per add,
                # a few adds); fp32/fp64/int64: only the summation order differs
                tol = 1e-2 if dtype == torch.float16 else 1e-5
                torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * 10)
                # every rank ends with bit-identical results
                assert torch.equal(got, results[0][0][(size, str(dtype))])
        base = torch.arange(4.0 * n)[rank * 4:(rank + 1) * 4]
        torch.testing.assert_close(rs, n * base + sum(range(n)))
        torch.testing.assert_close(ag, torch.arange(n, dtype=torch.float32).repeat_interleave(4))
        torch.testing.assert_close(avg, torch.full((10,), (n + 1) / 2))


def test_world_of_one_is_a_no_op():
    t = torch.tensor([1.0, 2.0])
    comm = Comm()
    ring_all_reduce(comm, t, Group.solo())
    assert t.tolist() == [1.0, 2.0] and comm.meter.snapshot() == {}
