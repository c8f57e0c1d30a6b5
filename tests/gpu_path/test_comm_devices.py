"""Comm on the GPU path, checked on CPU (issue 31): the debug device check, gloo's host staging
of tensors off the CPU, and how NCCL Works are waited (shardwise/comm/collectives.py).

What a CPU cannot show (gloo staging real CUDA tensors, NCCL's waits) is exercised by the GPU
suite (tests/gpu/); here the decisions are unit-tested, the staging path is forced onto CPU
tensors in a real gloo world (every op, blocking and not, exact results), and NCCL is stood in
for by a fake backend whose Work records how it was waited.
"""
import datetime

import pytest
import torch
import torch.distributed as dist

from harness import run_world
from reference import tiny_config
from shardwise.comm import collectives
from shardwise.comm.collectives import (Comm, DeviceMismatchError, Group, backend_for,
                                        stages_through_host)
from shardwise.run.runtime import init_runtime

pytestmark = pytest.mark.timeout(120)


# -- 1. the device check ------------------------------------------------------------------------
def _every_op(comm: Comm, group: Group, t: torch.Tensor) -> dict:
    """Each collective on ``t``: the error message it raised, or None."""
    out = torch.empty(t.numel() * group.size, dtype=t.dtype, device=t.device)
    calls = {"all_reduce": lambda: comm.all_reduce(t, group),
             "broadcast": lambda: comm.broadcast(t, 0, group),
             "all_gather": lambda: comm.all_gather(out, t, group),
             "reduce_scatter": lambda: comm.reduce_scatter(t, out, group)}
    got = {}
    for op, call in calls.items():
        try:
            call()
            got[op] = None
        except DeviceMismatchError as exc:
            got[op] = str(exc)
    return got


@pytest.mark.parametrize("declared", ["meta", "cuda"])
def test_a_flag_made_off_the_runs_device_fails_even_in_a_group_of_one(declared):
    # the common mistake: a flag made with torch.tensor(...) and no device=comm.device; on a
    # CUDA run under NCCL it would fail (or abort) first on a GPU, so the check catches it here
    comm = Comm(device=declared, check_devices=True)
    flag = torch.tensor([1.0])
    for op, msg in _every_op(comm, Group.solo(), flag).items():
        assert msg is not None, f"{op}: a CPU flag on a {declared} comm passed"
        assert msg.startswith(op) and "cpu" in msg and declared in msg and "fix:" in msg, msg
        assert "device=comm.device" in msg, msg


def test_tensors_on_the_runs_device_pass_and_the_check_is_off_by_default():
    good = torch.zeros(4, device="meta")
    assert set(_every_op(Comm(device="meta", check_devices=True), Group.solo(), good).values()) \
        == {None}
    # off (the default), nothing is checked: a group of one just short-circuits
    assert set(_every_op(Comm(device="meta"), Group.solo(), torch.zeros(4)).values()) == {None}
    # no device declared: a group of one has no backend to ask, so nothing to check against
    assert set(_every_op(Comm(check_devices=True), Group.solo(), torch.zeros(4)).values()) \
        == {None}


def test_an_nccl_group_needs_cuda_tensors(monkeypatch):
    comm = Comm(check_devices=True)        # the run declared nothing: NCCL alone decides
    monkeypatch.setattr(comm, "backend", lambda group, device=None: "nccl")
    group = Group(pg=object(), ranks=(0, 1), rank=0)
    with pytest.raises(DeviceMismatchError, match=r"zero_clip: .*cpu.*nccl group.*cuda.*NCCL "
                                                  r"moves CUDA tensors only.*fix:"):
        comm.all_reduce(torch.zeros(2), group, name="zero_clip")
    for op in ("send", "recv"):
        with pytest.raises(DeviceMismatchError, match=op):
            getattr(comm, op)(torch.zeros(2), 1, group)


def _check_in_world(rank, n):
    cfg = tiny_config("ddp")
    rt = init_runtime(cfg)                  # the harness sets SHARDWISE_CHECK_DEVICES=1
    world = rt.mesh.world
    t = torch.tensor([float(rank + 1)])
    rt.comm.all_reduce(t, world)            # CPU run, CPU tensor: passes
    # a CUDA-declared comm on this gloo world: the flag made without device= is refused on
    # every rank before any backend call, so no rank is left waiting for another
    cuda_comm = Comm(device="cuda", check_devices=True)
    try:
        cuda_comm.all_reduce(torch.tensor([1.0]), world, name="flag")
        refused = None
    except DeviceMismatchError as exc:
        refused = str(exc)
    return rt.comm.check_devices, t.item(), refused


def test_the_harness_turns_the_check_on_and_a_real_world_refuses_before_any_backend_call():
    for on, total, refused in run_world(_check_in_world, 2):
        assert on and total == 3.0
        assert refused is not None and refused.startswith("flag: a tensor on cpu") \
            and "gloo group" in refused and "cuda" in refused, refused


def test_init_runtime_reads_the_environment(monkeypatch):
    cfg = tiny_config("single")
    monkeypatch.delenv("SHARDWISE_CHECK_DEVICES", raising=False)
    assert init_runtime(cfg).comm.check_devices is False
    monkeypatch.setenv("SHARDWISE_CHECK_DEVICES", "1")
    rt = init_runtime(cfg)
    assert rt.comm.check_devices is True and rt.comm.device == torch.device("cpu")


# -- 2. gloo staging ------------------------------------------------------------------------------
def test_staging_decision():
    assert stages_through_host("gloo", "cuda")
    assert stages_through_host("gloo", torch.device("cuda", 1))
    assert not stages_through_host("gloo", "cpu")
    assert not stages_through_host("nccl", "cuda") and not stages_through_host(None, "cuda")
    assert backend_for("gloo", "cuda") == "gloo" and backend_for("nccl", "cuda") == "nccl"
    # a group with a backend per device type: CUDA tensors go to NCCL (no staging), CPU to gloo
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert not stages_through_host(backend_for("cpu:gloo,cuda:nccl", "cuda"), "cuda")


def _ops_in_world(rank, n, force):
    """Every op on CPU tensors, blocking and async; the results, and whether the backend was
    handed the caller's own tensor each time. ``force``: stage even CPU tensors (the path
    CUDA tensors take on gloo, which a CPU cannot otherwise reach)."""
    if force:
        collectives.stages_through_host = lambda backend, device: backend == "gloo"
    seen = []                                # (op, the backend got the caller's tensor)
    base = torch.arange(4, dtype=torch.float32) + 10 * rank    # rank r: [10r, 10r+1, ...]
    res, ptrs, keep = {}, {"base": base.data_ptr()}, []   # ptrs: the callers' tensors, kept
    # alive (keep), so no staging buffer can share an address with one while it is compared
    for op in ("all_reduce", "broadcast", collectives.ALL_GATHER, collectives.REDUCE_SCATTER,
               "send", "recv", "isend", "irecv"):
        real = getattr(dist, op)

        def spy(*args, _real=real, _op=op, **kw):
            seen.append((_op, args[0].data_ptr() in ptrs.values()))
            return _real(*args, **kw)
        setattr(dist, op, spy)
    comm = Comm(device="cpu", check_devices=True)
    group = Group(pg=dist.group.WORLD, ranks=tuple(range(n)), rank=rank)

    def run(key, t, call, async_op):
        ptrs[key] = t.data_ptr()
        keep.append(t)
        work = call(async_op)
        if async_op:
            res[key + "/before_wait"] = t.clone()
            work.wait()
        res[key] = t.clone()

    for a in (False, True):
        s = "async" if a else "sync"
        t = base.clone()
        run(f"sum/{s}", t, lambda a, t=t: comm.all_reduce(t, group, async_op=a), a)
        t = base.clone()
        run(f"avg/{s}", t, lambda a, t=t: comm.all_reduce(t, group, op="avg", async_op=a), a)
        t = base.clone()
        run(f"bcast/{s}", t, lambda a, t=t: comm.broadcast(t, 1, group, async_op=a), a)
        out = torch.full((4 * n,), -1.0)
        run(f"gather/{s}", out, lambda a, o=out: comm.all_gather(o, base, group, async_op=a), a)
        out = torch.full((4 // n,), -1.0)
        run(f"rs/{s}", out, lambda a, o=out: comm.reduce_scatter(o, base.clone(), group, op="avg",
                                                                 async_op=a), a)
    peer = 1 - rank
    got = torch.full((4,), -1.0)
    ptrs["p2p/sync"] = got.data_ptr()
    if rank == 0:
        comm.send(base, peer, group)
        comm.recv(got, peer, group)
    else:
        comm.recv(got, peer, group)
        comm.send(base, peer, group)
    res["p2p/sync"] = got.clone()
    got2 = torch.full((4,), -1.0)
    ptrs["p2p/async"] = got2.data_ptr()
    works = [comm.isend(base, peer, group), comm.irecv(got2, peer, group)]
    for w in works:
        w.wait()
    res["p2p/async"] = got2
    direct = all(own for _, own in seen)
    staged = not any(own for _, own in seen)
    return res, direct, staged, sorted({op for op, _ in seen})


@pytest.fixture(scope="module")
def staged_and_direct():
    return run_world(_ops_in_world, 2, False), run_world(_ops_in_world, 2, True)


def _expected(rank, n=2):
    base = [torch.arange(4, dtype=torch.float32) + 10 * r for r in range(n)]
    total = sum(base)
    return {"sum": total, "avg": total / n, "bcast": base[1], "gather": torch.cat(base),
            "rs": (total / n)[rank * 4 // n:(rank + 1) * 4 // n], "p2p": base[1 - rank]}


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_every_op_exact_in_a_world_of_two(staged_and_direct, path):
    results = staged_and_direct[path == "staged"]
    for rank, (res, direct, staged, ops) in enumerate(results):
        assert len(ops) == 8, ops                           # every backend entry point was used
        assert (direct, staged) == ((True, False) if path == "direct" else (False, True))
        want = _expected(rank)
        for key, got in res.items():
            if key.endswith("before_wait"):
                continue
            assert torch.equal(got, want[key.split("/")[0]]), (path, rank, key, got)


def test_staged_async_results_land_in_the_callers_tensor_only_at_wait(staged_and_direct):
    for rank, (res, *_) in enumerate(staged_and_direct[1]):
        base = torch.arange(4, dtype=torch.float32) + 10 * rank
        for key in ("sum/async", "avg/async", "bcast/async"):
            assert torch.equal(res[key + "/before_wait"], base), (rank, key)
        for key in ("gather/async", "rs/async"):
            assert (res[key + "/before_wait"] == -1).all(), (rank, key)


# -- 3. waits on NCCL -----------------------------------------------------------------------------
class _FakeWork:
    """A backend Work that records how it was waited (and polled)."""

    def __init__(self):
        self.waits, self.polls = [], 0

    def wait(self, *args):
        self.waits.append(args)
        return True

    def is_completed(self):
        self.polls += 1
        return True


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_works_are_never_waited_with_a_timeout_nor_polled(monkeypatch, backend):
    # torch's WorkNCCL.wait(timeout) busy-spins the host until the GPU is done: it must get
    # wait() (which only orders the stream); gloo keeps its timeout and its polling
    timeout = datetime.timedelta(seconds=7)
    comm = Comm(timeout=timeout, spin=True)
    monkeypatch.setattr(comm, "backend", lambda group, device=None: backend)
    works = []

    def fake(*args, async_op=False, **kw):
        works.append(_FakeWork())
        return works[-1] if async_op else None
    monkeypatch.setattr(dist, "all_reduce", fake)
    group = Group(pg=object(), ranks=(0, 1), rank=0)
    comm.all_reduce(torch.zeros(2), group, async_op=True).wait()
    comm.all_reduce(torch.zeros(2), group)           # blocking: polled on gloo only
    if backend == "nccl":
        assert works[0].waits == [()] and works[0].polls == 0
        assert len(works) == 2 and works[1].waits == []  # a blocking NCCL call is not waited
        assert comm.wait_timeout(group) is None
    else:
        assert works[0].waits == [(timeout,)] and works[0].polls >= 1
        assert works[1].waits == [(timeout,)] and works[1].polls >= 1
        assert comm.wait_timeout(group) == timeout
