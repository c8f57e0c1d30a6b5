"""A small multi-process harness: run a function in a world of N gloo processes, and compare
runs within a stated tolerance (used by the tests, the benchmarks, and users' own tests).
``run_world(fn, n, *args)`` forks N processes (a forked world is ready in ~0.05 s after the
parent's torch import, a spawned one costs ~4 s), joins them into a gloo world through a
``file://`` rendezvous in a fresh temporary directory (no fixed ports), sets one compute thread
per process, calls ``fn(rank, n, *args)`` in each and returns the list of return values (rank
order). Results travel through files written with torch.save. A rank that raises makes the
whole call raise with that rank's traceback; a world that does not finish within ``timeout``
seconds is killed and the call raises, so a deadlock fails instead of hanging, with every hung
rank's Python stacks (all threads, through faulthandler on SIGUSR1) in the error, so the
collective each was waiting in is named; when one rank fails, the others are killed at once
(they would only wait for it), and so are all of them when the caller is interrupted.

Put several checks in one world: each world costs process start-up and rendezvous.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(fn, rank, n, init_file, out_dir, args, env, backend="gloo"):
    os.environ.update(env)
    torch.set_num_threads(1)
    stacks = open(os.path.join(out_dir, f"rank{rank}.stacks"), "w")   # kept open until exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        kwargs = {}
        if backend == "nccl":      # one GPU per rank (NCCL refuses two ranks on one device)
            kwargs["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(kwargs["device_id"])
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=n, **kwargs)
        result = fn(rank, n, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _wait_all(procs, deadline: float) -> None:
    """Until every process has exited, one has failed (the rest would wait on it forever), or
    the deadline (one for the whole world, not per process) has passed."""
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not alive or any(p.exitcode not in (None, 0) for p in procs):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        mp_connection.wait([p.sentinel for p in alive], timeout=left)


def _stacks(procs, hung: list[int], tmp: str, wait: float = 1.0) -> str:
    """Every hung rank's Python stacks: faulthandler dumps all threads from its C signal handler,
    so a rank blocked inside a collective answers too. Nothing (and no wait) when none hung."""
    if not hung:
        return ""
    for r in hung:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(wait)
    dumps = []
    for r in hung:
        path = os.path.join(tmp, f"rank{r}.stacks")
        text = open(path).read().strip() if os.path.exists(path) else ""
        dumps.append(f"--- rank {r} ---\n{text or '(no answer to SIGUSR1)'}")
    return "\n".join(dumps)


def run_world(fn, n: int, *args, timeout: float = 120.0, env: dict | None = None,
              backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) in each of ``n`` processes joined over ``backend`` (gloo, or
    nccl: one CUDA device per rank); their results in rank order. The children are forked: the
    caller must not have initialised CUDA (``torch.cuda.is_available()`` does not; any CUDA
    tensor or ``torch.cuda.set_device`` does), or CUDA refuses to start in them."""
    if backend == "nccl" and n > torch.cuda.device_count():
        raise ValueError(f"run_world: {n} NCCL ranks need {n} CUDA devices, "
                         f"{torch.cuda.device_count()} visible (NCCL refuses two ranks on one GPU)")
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        env = {"OMP_NUM_THREADS": "1", "SHARDWISE_CHECK_DEVICES": "1", **(env or {})}
        procs = [ctx.Process(target=_child, args=(fn, r, n, init_file, tmp, args, env, backend))
                 for r in range(n)]
        try:
            for p in procs:
                p.start()
            _wait_all(procs, time.monotonic() + timeout)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            stacks = _stacks(procs, hung, tmp)
        finally:        # also when the caller is interrupted (pytest-timeout, Ctrl-C): a rank
            for p in procs:   # left alive would make this process's exit wait for it forever
                if p.is_alive():
                    p.kill()
                    p.join()
        errors = []
        for r in range(n):
            err = os.path.join(tmp, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"--- rank {r} ---\n" + open(err).read())
        if errors:
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s (deadlock?); "
                               f"where each was:\n{stacks}")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(n)]


def assert_close_runs(losses_a, losses_b, params_a: dict, params_b: dict, rtol: float,
                      atol: float = 0.0, why: str = "", strays: bool = False) -> None:
    """Same loss at every step and the same parameters, within rtol (``why`` says why that rtol).

    ``strays=True`` admits, per tensor, at most one element in a thousand (at least one) beyond
    the tolerance, none of them beyond 1e-3: Adam divides each element's gradient by its own RMS,
    so an element whose true gradient is near zero turns summation-order noise (which differs
    between CPUs: AVX2 and AVX-512 kernels add in another order) into a step of up to lr. A real
    error (a wrong shard, a missing average) moves most of a tensor's elements."""
    assert len(losses_a) == len(losses_b), f"{len(losses_a)} vs {len(losses_b)} steps"
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        assert abs(a - b) <= atol + rtol * abs(b), f"step {step}: loss {a} vs {b} ({why})"
    assert params_a.keys() == params_b.keys(), f"parameter names differ: {set(params_a) ^ set(params_b)}"
    for name in params_a:
        if strays:
            assert_close_but_for_strays(params_a[name], params_b[name], rtol, atol, f"{name} ({why})")
        else:
            torch.testing.assert_close(params_a[name], params_b[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name}: {m} ({why})")


def assert_close_but_for_strays(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float,
                                what: str = "", bound: float = 1e-3) -> None:
    """``got`` equals ``want`` within rtol/atol but for at most max(1, numel // 1000) elements,
    each within ``bound`` (see assert_close_runs' ``strays``)."""
    diff = (got - want).abs()
    off = diff > atol + rtol * want.abs()
    allowed = max(1, want.numel() // 1000)
    n = int(off.sum())
    assert n <= allowed, f"{what}: {n} of {want.numel()} elements beyond rtol {rtol} / atol " \
                         f"{atol} (at most {allowed} may stray); largest difference {float(diff.max()):.3g}"
    assert float(diff.max()) <= bound, f"{what}: an element off by {float(diff.max()):.3g} > {bound}"
