"""The shared-memory collectives (comm/shm.py, ``parallel.allreduce = shm | auto``): the
all-reduce gives the group's sum on every rank, bit-identical across ranks, over several chunks
and uneven slices; the reduce-scatter and all-gather (ZeRO's) give gloo's results over several
rounds, also in place (``out`` = ``inp``'s piece ``rank``) and through the Reducer; tensors
carved from the shared mapping (``share``) sum in place to the same bits as through the slots,
and the others' copies are left as they were; no file left behind; a member that never comes fails at the timeout naming it; ``auto`` takes it only on
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
    fast = shm.ShmCollectives(comm, group, chunk_bytes=4096)      # 1,024 fp32 per chunk
    out = {}
    for dtype, numel in ((torch.float32, 2_501), (torch.bfloat16, 3_000), (torch.float64, 7)):
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(numel, generator=gen).to(dtype)
        ref = x.clone()
        comm.all_reduce(ref, group)                             # gloo's own sum
        fast.all_reduce(x, "test_shm")
        out[str(dtype)] = (x, ref)
    out["meter"] = comm.meter.snapshot()["test_shm"]
    out["rs"], out["ag"] = _scatters_and_gathers(rank, n, comm, group, fast)
    return out


def _scatters_and_gathers(rank, n, comm, group, fast):
    """Reduce-scatters (averaged, as ZeRO's gradients) and all-gathers of 1,023 elements per
    member (a 4096-byte slot takes 1,024 // n of each slice a round, so 2-3 rounds, the last
    short), fp32 and bf16, against gloo's; one of each in place; the Reducer's ``shm`` path."""
    rs, ag = {}, {}
    gen = torch.Generator().manual_seed(300 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        inp = torch.randn(n * 1_023, generator=gen).to(dtype)
        ref = torch.empty(1_023, dtype=dtype)
        comm.reduce_scatter(ref, inp.clone(), group, op="avg")
        got = torch.empty(1_023, dtype=dtype)
        fast.reduce_scatter(got, inp, "rs")
        alias = inp.clone()                      # out = inp's own slice
        fast.reduce_scatter(alias[rank * 1_023:(rank + 1) * 1_023], alias, "rs")
        rs[str(dtype)] = (got, ref, alias[rank * 1_023:(rank + 1) * 1_023].clone())
        piece = torch.randn(1_023, generator=gen).to(dtype)
        ref = torch.empty(n * 1_023, dtype=dtype)
        comm.all_gather(ref, piece, group)
        got = torch.empty(n * 1_023, dtype=dtype)
        fast.all_gather(got, piece, "ag")
        whole = torch.zeros(n * 1_023, dtype=dtype)
        whole[rank * 1_023:(rank + 1) * 1_023] = piece
        fast.all_gather(whole, whole[rank * 1_023:(rank + 1) * 1_023], "ag")
        ag[str(dtype)] = (got, ref, whole)
    reducer = Reducer(comm, group, "shm")
    inp = torch.randn(n * 10, generator=gen)
    shard, whole = torch.empty(10), torch.empty(n * 10)
    reducer.reduce_scatter(shard, inp.clone(), False, "zero_grad_rs")
    reducer.all_gather(whole, shard, False, "zero_param_ag")
    ref = torch.empty(10)
    comm.reduce_scatter(ref, inp, group, op="avg")
    rs["reducer"] = (shard, ref, shard)
    ag["reducer"] = (whole, None, whole)
    meter = comm.meter.snapshot()
    return ({**rs, "meter": meter["rs"], "sm": reducer.uses_shared_memory},
            {**ag, "meter": meter["ag"]})


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_equal_gloo_and_agree_on_every_rank(world):
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
    for rank, out in enumerate(ranks):
        for key in ("torch.float32", "torch.bfloat16"):
            got, ref, alias = out["rs"][key]
            assert torch.equal(got, alias)        # in place: the same bits
            tol = 1e-2 if "bfloat16" in key else 1e-6      # summation order: member 0..N-1
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
            got, ref, whole = out["ag"][key]
            assert torch.equal(got, ref) and torch.equal(whole, ref)   # copies: exact
        shard, ref, _ = out["rs"]["reducer"]
        torch.testing.assert_close(shard, ref, rtol=1e-6, atol=1e-6)
        whole = out["ag"]["reducer"][0]
        assert torch.equal(whole, ranks[0]["ag"]["reducer"][0])
        assert torch.equal(whole[10 * rank:10 * (rank + 1)], shard)
        assert out["rs"]["sm"]                    # the Reducer's calls went through it
    assert ranks[0]["rs"]["meter"]["calls"] == 4 and ranks[0]["ag"]["meter"]["calls"] == 4


def _in_place(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=60))
    fast = shm.ShmCollectives(comm, group, chunk_bytes=4096)
    part = fast.share(16_136 + 999 * 4)
    a = part[:2_501 * 4].view(torch.float32)                  # two tensors carved from it
    b = part[2_501 * 4 + 64:2_501 * 4 + 64 + 3_001 * 2].view(torch.bfloat16)
    gen = torch.Generator().manual_seed(7 + rank)
    a.copy_(torch.randn(2_501, generator=gen))
    b.copy_(torch.randn(3_001, generator=gen).bfloat16())
    c = part[16_136:16_136 + 999 * 4].view(torch.float32)     # averaged (DDP's mean gradient)
    c.copy_(torch.randn(999, generator=gen))
    summed = c.clone()
    fast.all_reduce(summed, "slots")
    slots_c = c.clone()
    fast.all_reduce(slots_c, "slots", op="avg")
    fast.all_reduce(c, "in_place", op="avg")
    slots_a, slots_b = a.clone(), b.clone()                   # the same sums through the slots
    fast.all_reduce(slots_a, "slots")
    fast.all_reduce(slots_b, "slots")
    fast.all_reduce(a, "in_place")
    fast.all_reduce(b, "in_place")
    others = [p[:2_501 * 4].view(torch.float32).clone() for p in fast.parts]
    return {"a": a.clone(), "b": b.clone(), "slots_a": slots_a, "slots_b": slots_b,
            "others": others, "c": c.clone(), "slots_c": slots_c, "mean": summed / n,
            "meter": comm.meter.snapshot()["in_place"]}


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_in_the_shared_part_sum_in_place_to_the_slots_bits(world):
    before = set(glob.glob("/dev/shm/shardwise-*"))
    ranks = run_world(_in_place, world, timeout=120)
    for out in ranks:
        assert torch.equal(out["a"], out["slots_a"]) and torch.equal(out["b"], out["slots_b"])
        assert torch.equal(out["a"], ranks[0]["a"]) and torch.equal(out["b"], ranks[0]["b"])
        for other in out["others"]:           # every member's copy ends as the sum too
            assert torch.equal(other, ranks[0]["a"])
        assert torch.equal(out["c"], out["mean"]) and torch.equal(out["slots_c"], out["mean"])
    assert ranks[0]["meter"]["calls"] == 3
    assert set(glob.glob("/dev/shm/shardwise-*")) == before


def _shared_twice(rank, n):
    fast = shm.ShmCollectives(Comm(), Mesh.build(1, n, 1).world)
    fast.share(64)
    with pytest.raises(RuntimeError, match="already shared once"):
        fast.share(64)
    return fast._offset(torch.ones(3)) is None and fast._offset(fast.parts[rank][:8]) == 0


def test_a_tensor_outside_the_part_goes_through_the_slots_and_share_is_once():
    assert run_world(_shared_twice, 2, timeout=60) == [True, True]


def _one_never_comes(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=2))
    fast = shm.ShmCollectives(comm, group)
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
