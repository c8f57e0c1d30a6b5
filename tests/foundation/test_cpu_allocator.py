"""train.cpu_allocator (shardwise/run/allocator.py): which setting ``auto`` picks and why, that
``cache`` really stops a step's large tensors from faulting their pages in again every step
(measured in fresh processes: the setting is the process's), that a run reports what it got,
and that ``cache`` where glibc is absent is refused before launch."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from shardwise.config import ConfigError
from shardwise.run import allocator

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*allocator._VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_auto_caches_a_cpu_run_on_glibc_and_stands_down_for_every_reason(clean_env):
    assert allocator.unusable() is None, "this test machine runs glibc"
    assert allocator.decide("auto", CPU) == ("cache", "a CPU run on glibc")
    assert allocator.decide("auto", torch.device("cuda", 0))[0] == "system"
    mode, why = allocator.decide("auto", CPU, offload="disk")
    assert mode == "system" and "offload" in why
    for name in allocator._VARIABLES:                     # whoever set one chose
        clean_env.setenv(name, "131072")
        assert allocator.decide("auto", CPU) == ("system", f"{name} is set")
        clean_env.delenv(name)
    clean_env.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert allocator.decide("auto", CPU)[0] == "system"
    clean_env.setenv("GLIBC_TUNABLES", "glibc.rtld.nns=2")  # not a malloc tunable
    assert allocator.decide("auto", CPU)[0] == "cache"
    # asked for: as asked, whatever the rest says
    clean_env.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert allocator.decide("cache", CPU, offload="cpu") == ("cache", "asked for")
    assert allocator.decide("system", CPU) == ("system", "asked for")
    with pytest.raises(ValueError, match="one of auto, cache, system"):
        allocator.decide("jemalloc", CPU)


PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    from shardwise.run.allocator import configure, track_live_bytes
    if sys.argv[1] == "live":
        track_live_bytes(); heap = "live"
    else:
        heap = configure(sys.argv[1], torch.device("cpu"))
    faults = []
    for _ in range(8):       # a step's tensors of 3-60 MiB, alive together, then freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step = [torch.ones(mib << 20, dtype=torch.uint8) for mib in (40, 8, 60, 3)]
        del step
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"heap": heap, "faults": faults}))
""")


def _fresh(code: str, choice: str) -> dict:
    """``code`` run with ``choice`` in a fresh process (the heap setting is the process's); the
    JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", code, choice], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cache_stops_the_steps_from_faulting_their_tensors_in(clean_env):
    page = 4096
    whole = (40 + 8 + 60 + 3) << 20
    cached, system = _fresh(PROBE, "auto"), _fresh(PROBE, "system")
    live = _fresh(PROBE, "live")
    assert cached["heap"] == "cache" and system["heap"] == "system (asked for)"
    # the first steps map and touch their pages (the heap grows until every tensor of a step
    # has a free block that fits); with the cache the later steps reuse them
    assert cached["faults"][0] > whole // page // 2
    assert max(cached["faults"][-3:]) < 0.02 * whole / page, cached
    # glibc as it is maps the largest (above its 32 MiB ceiling) afresh every step, and with
    # the memory measurements' setting every one of them faults in again
    assert min(system["faults"][1:]) > (60 << 20) // page, system
    assert min(live["faults"][1:]) > 0.9 * whole / page, live


HOLES = textwrap.dedent("""
    import json, sys, torch
    from shardwise.run.allocator import configure
    configure(sys.argv[1], torch.device("cpu"))
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmRSS"))
    out = {}
    for mib in (144, 300):
        start = rss()
        for _ in range(12):          # one large tensor alone, freed and made again
            t = torch.zeros((mib << 20) // 4)
            del t
        out[mib] = rss() - start
    print(json.dumps(out))
""")


def test_the_price_one_tensor_alone_in_a_loop_and_the_ceiling_that_bounds_it(clean_env):
    """The module docstring's price: PyTorch's 64-byte aligned requests leave each freed block a
    little too small for the next of its size, so a loop of one 144 MiB tensor grows the heap by
    several copies; at 300 MiB, above the 256 MiB ceiling, it is mapped afresh and costs nothing
    held. (A step's tensors of many sizes fill the holes: malloc_cost measures that peak.)"""
    held = {choice: _fresh(HOLES, choice) for choice in ("cache", "system")}
    mib = 1 << 20
    assert held["cache"]["144"] > 3 * 144 * mib, held
    assert held["system"]["144"] < 144 * mib, held
    assert held["cache"]["300"] < 300 * mib and held["system"]["300"] < 300 * mib, held


def test_a_run_reports_its_heap_and_cache_is_refused_where_glibc_is_absent(clean_env,
                                                                           monkeypatch):
    from reference import tiny_config
    from dataclasses import replace
    from shardwise.run.runtime import init_runtime
    from shardwise.run.validate import validate

    cfg = tiny_config("single", steps=2)
    rt = init_runtime(replace(cfg, train=replace(cfg.train, cpu_allocator="system")))
    assert rt.allocator == "system (asked for)"
    monkeypatch.setattr(allocator, "_glibc", lambda: None)       # as on musl or macOS
    assert init_runtime(cfg).allocator.startswith("system (the C library here is not glibc")
    bad = replace(cfg, train=replace(cfg.train, cpu_allocator="cache"))
    with pytest.raises(ConfigError) as err:
        validate(bad, 1)
    assert err.value.field_name == "train.cpu_allocator" and "--cpu-allocator system" in str(err.value)
    with pytest.raises(RuntimeError, match="not glibc"):
        allocator.configure("cache", CPU)
