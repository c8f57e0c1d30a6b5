"""Calibration for ``--strategy auto``: measure this machine's compute and allreduce.

- compute: a square fp32 matmul (the device's achievable peak, ``peak_flops``) and the
  configured GPT's forward + backward at two micro-batch sizes, fitted as
  ``t(b) = L * block_overhead + b * s * flops_per_token / model_flops``; the planner gets
  ``efficiency = model_flops / peak_flops`` and ``block_overhead`` (dispatch, small kernels).
  Measured with the threads each rank will have (``OMP_NUM_THREADS``, 1 by default under the
  relaunch) in every rank of a forked world at once (on CPU the ranks share cores and the
  memory bus, so a rank timed alone is faster than one of a busy world); and once more in one
  process with all threads, for the one-process alternative;
- memory bandwidth (a large copy), which bounds the planner's optimizer step;
- allreduce: a forked gloo world of the local process count (``shardwise.testing.run_world``),
  ``Comm.all_reduce`` of 1 KiB and 4 MiB, fitted to the ring's alpha-beta model
  ``2 (N-1) alpha + 2 (N-1)/N K / bw``: ``bw`` is the bus bandwidth (``intra_bw``), ``alpha``
  the latency per ring step; then each rank computes for a few milliseconds and allreduces
  1 MiB, twenty times: what that costs beyond the compute alone and the alpha-beta time of
  1 MiB is ``collective_overhead`` (the ranks' arrival skew and waking gloo's threads, which every
  collective in training pays after the compute before it: about 3 ms here, 15x the idle
  figure, when ranks block; much less when they poll, ``train.comm_wait``). The probe waits as
  training will (``runtime.spins``).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

from shardwise.config import Config, ConfigError
from shardwise.planner import Hardware, ModelSpec
from shardwise.planner.units import fmt_bytes

SMALL, MID, LARGE = 256, 1 << 18, 1 << 20
"""Allreduce probe sizes in fp32 elements: 1 KiB (latency), 1 MiB (after compute: a layer's
activations, as tensor parallelism reduces them) and 4 MiB (bandwidth)."""


@dataclass(frozen=True)
class Compute:
    """What one rank computes per second, measured with ``threads`` threads."""

    threads: int
    matmul_flops: float
    """FLOP/s of a 512 x 512 fp32 matmul (1024 on a GPU): the peak the planner divides by."""
    model_flops: float
    """FLOP/s of the GPT's forward + backward per extra sequence (the fit's slope)."""
    block_overhead: float
    """Seconds per block per micro-batch that do not grow with the batch (the fit's intercept / L)."""
    mem_bw: float
    """Bytes/s of a large tensor copy (read + write)."""


@dataclass(frozen=True)
class Calibration:
    """This machine as the planner sees it."""

    device: str
    processes: int
    """Processes ``shardwise train`` starts here for a multi-process strategy."""
    per_rank: Compute
    """One rank of a ``processes``-rank world."""
    whole: Compute
    """One process alone, with all the threads."""
    allreduce_bw: float
    """Bus bandwidth of a 4 MiB ring allreduce, bytes/s (0 for one process)."""
    allreduce_latency: float
    """Seconds per ring step (from the 1 KiB allreduce)."""
    memory_bytes: int
    """RAM (CPU) or device memory (GPU), all of it."""
    seconds: float
    """How long the calibration took."""
    collective_overhead: float = 0.0
    """Seconds a collective costs beyond the alpha-beta model when it follows compute."""

    def hardware(self, processes: int) -> Hardware:
        """``Hardware.custom`` for ``processes`` ranks on this machine (1: the whole process)."""
        c = self.whole if processes == 1 else self.per_rank
        peak = max(c.matmul_flops, c.model_flops)
        cpu = self.device == "cpu"
        share = self.memory_bytes * 0.8 / processes if cpu else self.memory_bytes
        return Hardware.custom(
            nodes=1, devices_per_node=processes, memory_bytes=int(share), peak_flops=peak,
            intra_bw=self.allreduce_bw or 1e12, intra_latency=self.allreduce_latency,
            efficiency=c.model_flops / peak, block_overhead=c.block_overhead, mem_bw=c.mem_bw,
            host_bw=c.mem_bw / 2, host_mem_bw=c.mem_bw, host_memory_bytes=_ram_bytes(),
            reserved_bytes=0 if cpu else 2**30, name=f"{self.device} (calibrated)",
            comm_overlap=0.0 if cpu else 1.0,   # CPU ranks reduce on the cores they compute on
            collective_overhead=self.collective_overhead,
            collective_copies=1.0 if cpu else 0.0,   # gloo's reduce-scatter / all-gather copies
            compute_lanes=max(1, (os.cpu_count() or 1) // max(1, c.threads)) if cpu else 0,
            interconnect="shm" if cpu else "gloo")

    def describe(self) -> str:
        """Two or three lines of measured figures."""
        r, w = self.per_rank, self.whole
        lines = [f"calibrated in {self.seconds:.1f} s on {self.device}: matmul "
                 f"{r.matmul_flops / 1e9:.1f} GFLOP/s per rank ({r.threads} thread(s), "
                 f"{self.processes} ranks), GPT forward+backward {r.model_flops / 1e9:.1f} GFLOP/s"
                 f" + {r.block_overhead * 1e3:.2f} ms per block and micro-batch, memory "
                 f"{r.mem_bw / 1e9:.1f} GB/s",
                 f"one process with {w.threads} thread(s): matmul {w.matmul_flops / 1e9:.1f} "
                 f"GFLOP/s, GPT {w.model_flops / 1e9:.1f} GFLOP/s + {w.block_overhead * 1e3:.2f} ms"
                 f" per block and micro-batch"]
        if self.processes > 1:
            lines.append(f"allreduce over {self.processes} processes (gloo): bus bandwidth "
                         f"{self.allreduce_bw / 1e9:.2f} GB/s, latency "
                         f"{self.allreduce_latency * 1e6:.0f} us per ring step, "
                         f"{self.collective_overhead * 1e3:.2f} ms per call after compute; memory per "
                         f"process {fmt_bytes(self.hardware(self.processes).memory_bytes)}")
        return "\n".join(lines)


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _timed(fn, device: torch.device, reps: int, budget: float = 0.6) -> float:
    """Median seconds of ``fn()`` after one untimed call (synchronising a GPU, never in comm);
    fewer repetitions when they would take more than ``budget`` seconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(max(1, min(reps, int(budget / max(first, 1e-9))))):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_compute(cfg: Config, device: torch.device, threads: int) -> Compute:
    """Matmul FLOP/s, the GPT's fitted rate and per-block overhead, and copy bandwidth."""
    from shardwise.models import build_model, lm_loss
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024 if device.type == "cuda" else 512
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        matmul = 2 * n**3 / _timed(lambda: a @ b, device, 5)
        src = torch.randn(8 << 20, device=device)          # 32 MiB
        dst = torch.empty_like(src)
        mem_bw = 2 * src.nelement() * 4 / _timed(lambda: dst.copy_(src), device, 5)
        model = build_model(replace(cfg.model, dropout=0.0), cfg.train.seed).to(device)
        spec = model_spec(cfg)

        def step(rows: int):
            x = torch.randint(0, spec.vocab, (rows, spec.seq_len), device=device)
            lm_loss(model(x), x).backward()

        t1 = _timed(lambda: step(1), device, 3)
        # the second point: a batch large enough to weigh against the fixed costs of small
        # models, small enough to keep the calibration to seconds
        rows = max(2, min(cfg.train.batch_size, 16)) if t1 < 0.05 else 4 if t1 < 0.3 else 2
        t2 = _timed(lambda: step(rows), device, 3)
        # t(b) = c0 + b * per_row; on a busy machine the two points can disagree, so the
        # intercept is kept within [0, 3/4 of either point], and the model no faster than the
        # matmul, the slope refitted through t2
        flops_row = spec.flops_per_token() * spec.seq_len
        c0 = min(max(0.0, t1 - (t2 - t1) / (rows - 1)), 0.75 * min(t1, t2))
        per_row = max((t2 - c0) / rows, flops_row / matmul)
        c0 = max(0.0, t2 - rows * per_row)
        model_flops = flops_row / per_row
        overhead = c0 / spec.layers
    finally:
        torch.set_num_threads(before)
    return Compute(threads, matmul, model_flops, overhead, mem_bw)


def _allreduce_probe(rank: int, world: int, reps: tuple[int, int], cfg: Config | None = None,
                     threads: int = 1) -> dict:
    """Median seconds of an allreduce of SMALL and LARGE fp32 elements (one forked rank); with
    ``cfg``, then this rank's compute, measured while every other rank measures too (so the
    figure includes the ranks' contention for cores and memory bandwidth)."""
    from shardwise.comm.collectives import Comm
    from shardwise.mesh import Mesh
    from shardwise.runtime import spins
    torch.set_num_threads(threads)      # what each rank will have, so it waits as training will
    wait = cfg.train.comm_wait if cfg is not None else "auto"
    comm = Comm(spin=spins(wait, torch.device("cpu"), world))
    group = Mesh.build(1, world, 1).world
    out = {}
    for numel, n in zip((SMALL, LARGE), reps):
        t = torch.ones(numel)
        comm.all_reduce(t, group)                           # warm-up (connections, buffers)
        times = []
        for _ in range(n):
            comm.barrier(group)
            t0 = time.perf_counter()
            comm.all_reduce(t, group)
            times.append(time.perf_counter() - t0)
        out[numel] = statistics.median(times)
    out["after_compute"] = _after_compute(comm, group)
    if cfg is not None:
        comm.barrier(group)
        out["compute"] = measure_compute(cfg, torch.device("cpu"), threads)
    return out


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


def measure_allreduce(world: int, cfg: Config | None = None, threads: int = 1):
    """(bus bandwidth bytes/s, seconds per ring step, slowest rank's Compute or None, seconds a
    collective costs after compute) of ``Comm.all_reduce`` over ``world`` forked CPU ranks
    (with ``cfg``: compute measured in all ranks at once)."""
    from shardwise.testing import run_world
    if world < 2:
        return 0.0, 0.0, None, 0.0
    per_rank = run_world(_allreduce_probe, world, (30, 10), cfg, threads, timeout=120)
    small = max(r[SMALL] for r in per_rank)
    large = max(r[LARGE] for r in per_rank)
    steps = 2 * (world - 1)
    bw = steps / world * (LARGE - SMALL) * 4 / max(large - small, 1e-9)
    computes = [r["compute"] for r in per_rank if "compute" in r]
    slowest = min(computes, key=lambda c: c.model_flops) if computes else None
    alpha = small / steps
    model = steps * alpha + steps / world * MID * 4 / bw      # the alpha-beta time of MID
    overhead = max(0.0, max(r["after_compute"] for r in per_rank) - model)
    return bw, alpha, slowest, overhead


def processes(cfg: Config) -> int:
    """The process count a multi-process strategy gets here (``launch.local_world_size``)."""
    from shardwise import launch
    p = replace(cfg.parallel, strategy="ddp", dp=0, tp=1, pp=1)
    return launch.local_world_size(replace(cfg, parallel=p))


def calibrate(cfg: Config) -> Calibration:
    """Measure this machine for ``cfg``'s GPT (the allreduce first: it forks, and a process
    should fork before its compute threads have run)."""
    from shardwise.runtime import pick_device
    t0 = time.perf_counter()
    n = processes(cfg)
    device = pick_device(cfg.train.device, 0)
    if device.type == "cuda":
        bw, latency, _, overhead = measure_allreduce(n)
        overhead = 0.0      # NCCL on GPUs: launches are microseconds, inside the latency
        whole = measure_compute(cfg, device, torch.get_num_threads())
        per_rank, memory = whole, torch.cuda.get_device_properties(device).total_memory
    else:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1")) if n > 1 else torch.get_num_threads()
        # on CPU the ranks share the cores and the memory bus: time each rank's compute while
        # all ranks run at once, in the same forked world that measures the allreduce
        bw, latency, per_rank, overhead = measure_allreduce(n, cfg, threads)
        whole = measure_compute(cfg, device, torch.get_num_threads())
        per_rank = per_rank or whole
        memory = _ram_bytes()
    return Calibration(device.type, n, per_rank, whole, bw, latency, memory,
                       time.perf_counter() - t0, overhead)



# ----------------------------------------------------------------------------- the choice


def model_spec(cfg: Config) -> ModelSpec:
    """The planner's view of the configured GPT (untied head, and fused attention: models/gpt.py
    uses scaled_dot_product_attention, which keeps no s x s matrix)."""
    m = cfg.model
    if m.name != "gpt":
        raise ConfigError("parallel.strategy", "auto", f"the planner models transformers, not "
                          f"{m.name}", "pick a strategy for this model (e.g. --strategy ddp)")
    return ModelSpec(m.n_layer, m.n_embd, m.n_head, m.block_size, m.vocab_size,
                     tied_embeddings=False, fused_attention=True,
                     name=f"gpt L={m.n_layer} h={m.n_embd}")
