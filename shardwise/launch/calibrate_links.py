"""The links half of the calibration (shardwise/launch/calibrate.py): what a collective costs here.

A forked gloo world of the local process count (``shardwise.launch.world.run_world``) times:

- ``Comm.all_reduce`` of 1 KiB and 32 MiB (SMALL, XLARGE), fitted to the ring's alpha-beta
  model ``2 (N-1) alpha + 2 (N-1)/N K / bw`` through both points: ``bw`` is the bus bandwidth
  (``intra_bw``, what reduce-scatter, all-gather, tensor parallelism's allreduces and the
  parameter server get), ``alpha`` the latency per ring step (1 KiB over its ring steps). Not
  1 KiB and 4 MiB, as until 2026-12-07: where ranks block and share cores (4 ranks on 2 cores
  here) 1 KiB already takes 5-7 ms of wake-ups, as long as 4 MiB, and that line's bandwidth
  came out twice what tens of MiB get, or unbounded (ZeRO's and DDP's buckets are tens of MiB:
  3d's were priced at half their time). Nor the slope between 4 and 32 MiB (used for one day):
  a 4 MiB median above the 32 MiB one, which this machine's noise makes happen, left it
  unbounded too. 32 MiB takes 7-10x the 1 KiB time even there, so the line through
  them is always defined (``python -m shardwise.bench.allreduce_sizes`` grades the fit on
  1 KiB to 64 MiB);
- the all-reduce data parallelism runs (``comm.reducer.Reducer`` with ``parallel.allreduce``):
  where that takes the same-host shared-memory path (comm/shm.py, the default on one x86 CPU
  host with polling ranks), the same two sizes through it give its own bus bandwidth
  (``Hardware.allreduce_bw``, about twice gloo's here); 0 where it does not apply;
- then each rank computes for a few milliseconds and allreduces 1 MiB (MID), twenty times: what
  that costs beyond the compute alone and the alpha-beta time of 1 MiB is
  ``collective_overhead`` (the ranks' arrival skew and waking gloo's threads, which every
  collective in training pays after the compute before it: about 3 ms here, 15x the idle figure,
  when ranks block; much less when they poll, ``train.comm_wait``). The probe waits as training
  will (``runtime.spins``);
- with a config, each rank's compute (``calibrate.measure_compute``, passed in), all ranks in
  step.

That world is CPU ranks over gloo, and describes CPU ranks only. GPUs are not measured this way
(a gloo world's bandwidth says nothing about NVLink or PCIe, and forking after the parent has
used CUDA is unsafe): ``gpu_links`` takes their links from the planner's GPU catalogue
(shardwise/planner/catalogue.py) and says so; one GPU has no link at all.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

SMALL, MID, LARGE, XLARGE = 256, 1 << 18, 1 << 20, 1 << 23
"""Allreduce probe sizes in fp32 elements: 1 KiB (latency), 1 MiB (after compute: a layer's
activations, as tensor parallelism reduces them) and 32 MiB (bandwidth). 4 MiB (LARGE) is the
old fit's second point, which bench/allreduce_sizes.py still grades."""


@dataclass(frozen=True)
class Links:
    """What the collectives of a ``world``-rank group cost on this machine."""

    bw: float = 0.0
    """Bus bandwidth of the backend's ring allreduce, bytes/s (0: one process)."""
    alpha: float = 0.0
    """Seconds per ring step (the 1 KiB allreduce over its ring steps)."""
    overhead: float = 0.0
    """Seconds a collective costs beyond alpha-beta when it follows compute."""
    shared_bw: float = 0.0
    """Bus bandwidth of data parallelism's allreduce over shared memory (0: not taken)."""
    compute: object = None
    """The slowest rank's ``calibrate.Compute`` (None without a config)."""
    source: str = "gloo, measured"
    """Where the figures come from, for the printed plan."""
    interconnect: str = ""
    """The planner's name of the link: ``nvlink`` or ``pcie`` (GPUs), empty for CPU ranks."""


REPS = {SMALL: 30, XLARGE: 5}
"""fp32 elements -> timings of each probe size (the median is kept)."""


def _timed_sizes(reduce, reps: dict[int, int], barrier) -> dict:
    """{numel: median seconds of ``reduce(t)`` over ``reps[numel]`` calls} for each size of
    ``reps`` (fp32 elements), after a warm-up; bench/allreduce_sizes.py times its sizes so
    too."""
    out = {}
    for numel, n in reps.items():
        t = torch.ones(numel)
        reduce(t)                            # warm-up (connections, buffers, shared pages)
        times = []
        for _ in range(n):
            barrier()
            t0 = time.perf_counter()
            reduce(t)
            times.append(time.perf_counter() - t0)
        out[numel] = statistics.median(times)
    return out


def _probe(rank: int, world: int, reps: dict[int, int], cfg=None, threads: int = 1,
           compute=None) -> dict:
    """One forked rank: the backend's and data parallelism's allreduce at both sizes, the cost
    after compute, and (with ``cfg``) this rank's ``compute(cfg, device, threads, agree)``
    while every other rank measures too (so the figure includes the ranks' contention for cores
    and memory bandwidth)."""
    from shardwise.comm.collectives import Comm
    from shardwise.comm.reducer import Reducer
    from shardwise.mesh import Mesh
    from shardwise.run.runtime import spins
    torch.set_num_threads(threads)      # what each rank will have, so it waits as training will
    wait = cfg.train.comm_wait if cfg is not None else "auto"
    device = torch.device("cpu")
    comm = Comm(spin=spins(wait, device, world))
    group = Mesh.build(1, world, 1).world
    barrier = lambda: comm.barrier(group)   # noqa: E731
    out = {"native": _timed_sizes(lambda t: comm.all_reduce(t, group), reps, barrier)}
    kind = cfg.parallel.allreduce if cfg is not None else "auto"
    if kind in ("auto", "shm"):
        reducer = Reducer(comm, group, kind, device)       # decides collectively at first use
        try:
            dp = _timed_sizes(lambda t: reducer.all_reduce(t, False, "calibration"), reps,
                              barrier)
        except RuntimeError:       # an explicit shm that cannot apply: every rank says so
            dp = None
        if dp is not None and reducer.uses_shared_memory:
            out["shared"] = dp
        reducer.close()
    out["after_compute"] = _after_compute(comm, group)
    if cfg is not None and compute is not None:
        out["compute"] = compute(cfg, device, threads, lambda x: _world_max(comm, group, x))
    return out


def _world_max(comm, group, x: float) -> float:
    """The largest ``x`` over ``group`` (every member waits for all: also a barrier)."""
    t = torch.tensor([float(x)], dtype=torch.float64)
    comm.all_reduce(t, group, op="max", name="calibration")
    return float(t.item())


def _after_compute(comm, group, reps: int = 20) -> float:
    """Seconds a MID-element allreduce adds right after a few milliseconds of compute, beyond
    the compute itself (module docstring)."""
    a = torch.randn(384, 384)

    def work():
        for _ in range(3):
            a @ a
    work()
    comm.barrier(group)
    alone = []
    for _ in range(reps // 2):
        t0 = time.perf_counter()
        work()
        alone.append(time.perf_counter() - t0)
    t = torch.ones(MID)
    comm.barrier(group)
    both = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        comm.all_reduce(t, group)
        both.append(time.perf_counter() - t0)
    return statistics.median(both) - statistics.median(alone)


def _bus_bw(times: list[dict], world: int) -> tuple[float, float]:
    """(bus bandwidth, seconds per ring step) of the line through the slowest rank's SMALL and
    XLARGE times (module docstring)."""
    small = max(r[SMALL] for r in times)
    xlarge = max(r[XLARGE] for r in times)
    steps = 2 * (world - 1)
    return steps / world * (XLARGE - SMALL) * 4 / max(xlarge - small, 1e-9), small / steps


def measure_links(world: int, cfg=None, threads: int = 1, compute=None) -> Links:
    """The collectives of ``world`` forked CPU ranks (with ``cfg`` and ``compute``, the
    calibration's ``measure_compute``: compute measured in all ranks at once); empty Links for
    one process."""
    from shardwise.launch.world import run_world
    if world < 2:
        return Links()
    per_rank = run_world(_probe, world, REPS, cfg, threads, compute, timeout=180)
    bw, alpha = _bus_bw([r["native"] for r in per_rank], world)
    shared = [r["shared"] for r in per_rank if "shared" in r]
    shared_bw = _bus_bw(shared, world)[0] if len(shared) == world else 0.0
    computes = [r["compute"] for r in per_rank if "compute" in r]
    slowest = min(computes, key=lambda c: c.model_flops) if computes else None
    steps = 2 * (world - 1)
    model = steps * alpha + steps / world * MID * 4 / bw      # the alpha-beta time of MID
    overhead = max(0.0, max(r["after_compute"] for r in per_rank) - model)
    return Links(bw, alpha, overhead, shared_bw, slowest)


_CATALOGUE_GPUS = ((r"\bh200\b", "h200"), (r"\bh100\b", "h100-80gb"),
                   (r"\ba100\b.*\b80\s*gb\b", "a100-80gb"), (r"\ba100\b", "a100-40gb"),
                   (r"\bv100\b.*\b16\s*gb\b", "v100-16gb"), (r"\bv100\b", "v100"),
                   (r"\bl4\b", "l4"))
"""A CUDA device name (``torch.cuda.get_device_name``: "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
-> its catalogue entry; the first pattern that matches wins."""

UNKNOWN_GPU_PCIE_BW = 0.4 * 32e9
"""Bus bandwidth assumed between GPUs the catalogue does not list: PCIe gen4 x16 (32 GB/s per
direction) with the catalogue's factor of 0.4 for collectives over PCIe."""


def gpu_links(world: int, device_name: str) -> Links:
    """The links between ``world`` GPUs of this node called ``device_name``, from the planner's
    catalogue, not measured (module docstring); empty Links (no link) for one GPU. NVLink where
    the catalogue's entry has it and the name does not say PCIe, else PCIe."""
    import re
    from shardwise.planner import catalogue
    if world < 2:
        return Links(source="one GPU: no link to calibrate")
    name = device_name.lower().replace("-", " ")
    entry = next((catalogue.accelerator(key) for pattern, key in _CATALOGUE_GPUS
                  if re.search(pattern, name)), None)
    pcie = "pcie" in name or entry is None or entry.nvlink_bw is None
    link = "pcie" if pcie else "nvlink"
    latency = (entry.intra_latency if entry is not None else None) or \
        catalogue.INTERCONNECT_LATENCY[link]
    if entry is None:
        return Links(UNKNOWN_GPU_PCIE_BW, latency, source=f"{device_name!r} is not in the "
                     "planner's catalogue: taken as PCIe gen4 x16, not measured",
                     interconnect=link)
    bw = entry.pcie_bw if pcie else entry.nvlink_bw
    return Links(bw, latency, source=f"the planner's catalogue ({entry.name} over {link}), "
                 "not measured", interconnect=link)
