"""Calibration for ``--strategy auto``: measure this machine's compute and allreduce.

- compute: a square fp32 matmul (the device's achievable peak, ``peak_flops``) and the
  configured GPT's forward + backward at two micro-batch sizes, fitted as
  ``t(b) = L * block_overhead + b * s * flops_per_token / model_flops``; the planner gets the
  GEMMs at the matmul rate and the rest of the slope as ``activation_passes`` over the
  activation bytes (:func:`activation_passes`; ``efficiency = model_flops / peak_flops`` when
  the GPT was as fast as the matmul), and ``block_overhead`` (dispatch, small kernels).
  Measured with the threads each rank will have (``OMP_NUM_THREADS``, 1 by default under the
  relaunch) in every rank of a forked world at once (on CPU the ranks share cores and the
  memory bus, so a rank timed alone is faster than one of a busy world); and once more in one
  process with all threads, for the one-process alternative;
- memory bandwidth (a large copy), and the configured optimizer's step on the model (PyTorch's
  CPU AdamW reaches about half the copy's rate here), for the planner's optimizer step;
- the links (shardwise/launch/calibrate_links.py): on CPU, gloo's allreduce, the shared-memory
  allreduce data parallelism takes where it applies, and what a collective costs after compute
  (``collective_overhead``), in a forked world of the local process count, which also times
  each rank's compute with every rank computing. On CUDA nothing is forked: one GPU has no link,
  and several GPUs' links come from the planner's GPU catalogue (``gpu_links``), which the
  printed calibration says;
- the disk that ``--offload disk`` writes to (``memory.offload_dir``, else the temp dir): a
  file of at most 64 MiB written (fsynced) and read back with the page cache dropped
  (``measure_disk``, bounded in size and time), and the free space there, for the planner's
  disk offload (its I/O per step and whether the state fits).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch

from shardwise.launch.calibrate_links import gpu_links, measure_links
from shardwise.config import Config, ConfigError
from shardwise.config.names import Strategy
from shardwise.planner import Batch, Hardware, ModelSpec
from shardwise.planner.catalogue import GPU_HEADROOM
from shardwise.planner.units import fmt_bytes


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
    optimizer_bw: float = 0.0
    """Bytes/s the configured optimizer's step reaches on the model (planner.cost.optimizer_bytes
    per parameter over its median time); 0: not measured."""
    activation_passes: float = 0.0
    """The part of a sequence's time the matmul rate does not explain, as passes over the
    block's activation bytes at ``mem_bw`` (the planner's non-GEMM kernels:
    planner/compute.py); 0 when the GPT ran as fast as the matmul (then the whole-block rate
    is used, as ``efficiency``)."""


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
    shared_allreduce_bw: float = 0.0
    """Bus bandwidth of data parallelism's allreduce over shared memory, bytes/s (0 where it
    takes gloo's: another host, ranks that block, ``--allreduce native`` or ``ring``)."""
    links_source: str = "gloo, measured"
    """Where ``allreduce_bw`` and ``allreduce_latency`` come from (GPUs: the catalogue)."""
    interconnect: str = ""
    """The GPUs' link for the planner (``nvlink`` or ``pcie``); empty for CPU ranks."""
    disk: "Disk | None" = None
    """The offload directory's disk (``measure_disk``); None: not measured (the planner's
    catalogue figures stand)."""

    def hardware(self, processes: int) -> Hardware:
        """``Hardware.custom`` for ``processes`` ranks on this machine (1: the whole process)."""
        c = self.whole if processes == 1 else self.per_rank
        peak = max(c.matmul_flops, c.model_flops)
        # with the GPT's time split into GEMMs at the matmul rate and the rest in proportion to
        # the activation bytes, a wider model's GEMMs (more FLOPs per activation byte) are not
        # charged the benchmark GPT's narrow blocks' rate (measure_compute)
        split = {"efficiency": 1.0, "activation_passes": c.activation_passes} \
            if c.activation_passes > 0 else {"efficiency": c.model_flops / peak}
        cpu = self.device == "cpu"
        share = self.memory_bytes * 0.8 / processes if cpu else self.memory_bytes
        return Hardware.custom(
            nodes=1, devices_per_node=processes, memory_bytes=int(share), peak_flops=peak,
            intra_bw=self.allreduce_bw or 1e12, intra_latency=self.allreduce_latency,
            **split, block_overhead=c.block_overhead, mem_bw=c.mem_bw,
            host_bw=c.mem_bw / 2,
            # on a CPU the host is the device: an offloaded step runs the same optimizer
            host_mem_bw=(c.optimizer_bw or c.mem_bw) if cpu else c.mem_bw,
            host_memory_bytes=_ram_bytes(),
            reserved_bytes=0 if cpu else 2**30, name=f"{self.device} (calibrated)",
            headroom=0.0 if cpu else GPU_HEADROOM,   # allocator fragmentation (catalogue.py)
            comm_overlap=0.0 if cpu else 1.0,   # CPU ranks reduce on the cores they compute on
            collective_overhead=self.collective_overhead, optimizer_bw=c.optimizer_bw,
            allreduce_bw=self.shared_allreduce_bw if cpu and processes > 1 else 0.0,
            collective_copies=1.0 if cpu else 0.0,   # gloo's reduce-scatter / all-gather copies
            compute_lanes=max(1, (os.cpu_count() or 1) // max(1, c.threads)) if cpu else 0,
            interconnect="shm" if cpu else self.interconnect or "none",
            **(self.disk.hardware_fields() if self.disk else {}))

    def describe(self) -> str:
        """Two or three lines: the measured figures, and the links (measured on CPU; on GPUs,
        where their figures come from)."""
        r, w = self.per_rank, self.whole
        lines = [f"calibrated in {self.seconds:.1f} s on {self.device}: matmul "
                 f"{r.matmul_flops / 1e9:.1f} GFLOP/s per rank ({r.threads} thread(s), "
                 f"{self.processes} ranks), GPT forward+backward {r.model_flops / 1e9:.1f} GFLOP/s"
                 f" + {r.block_overhead * 1e3:.2f} ms per block and micro-batch"
                 f"{_split(r)}, memory {r.mem_bw / 1e9:.1f} GB/s, optimizer step "
                 f"{r.optimizer_bw / 1e9:.1f} GB/s",
                 f"one process with {w.threads} thread(s): matmul {w.matmul_flops / 1e9:.1f} "
                 f"GFLOP/s, GPT {w.model_flops / 1e9:.1f} GFLOP/s + {w.block_overhead * 1e3:.2f} ms"
                 f" per block and micro-batch"]
        if self.disk is not None:
            lines.append(self.disk.describe())
        if self.device != "cpu":
            lines.append(self._gpu_links())
        elif self.processes > 1:
            lines.append(f"allreduce over {self.processes} processes (gloo): bus bandwidth "
                         f"{self.allreduce_bw / 1e9:.2f} GB/s, latency "
                         f"{self.allreduce_latency * 1e6:.0f} us per ring step, "
                         f"{self.collective_overhead * 1e3:.2f} ms per call after compute; "
                         + (f"data parallelism's allreduce over shared memory "
                            f"{self.shared_allreduce_bw / 1e9:.2f} GB/s; "
                            if self.shared_allreduce_bw else "")
                         + f"memory per process "
                         f"{fmt_bytes(self.hardware(self.processes).memory_bytes)}")
        return "\n".join(lines)

    def _gpu_links(self) -> str:
        """The line on the GPUs' links: where they come from (never a gloo world's figure)."""
        if self.processes < 2:
            return f"links: {self.links_source}; memory per GPU {fmt_bytes(self.memory_bytes)}"
        return (f"links between the {self.processes} GPUs from {self.links_source}: bus "
                f"bandwidth {self.allreduce_bw / 1e9:.1f} GB/s, latency "
                f"{self.allreduce_latency * 1e6:.0f} us per ring step; memory per GPU "
                f"{fmt_bytes(self.memory_bytes)}")


@dataclass(frozen=True)
class Disk:
    """The offload directory's disk, measured by :func:`measure_disk`."""

    path: str
    """The directory measured (where ``--offload disk`` keeps its files)."""
    read_bw: float
    """Bytes/s of reading the test file back with the page cache dropped."""
    write_bw: float
    """Bytes/s of writing the test file, fsync included."""
    free_bytes: int
    """Free space in ``path``."""
    size: int
    """Bytes written and read."""

    @property
    def bandwidth(self) -> float:
        """The rate of moving equal bytes each way (the planner's one ``disk_bw``): their
        harmonic mean."""
        return 2 / (1 / self.read_bw + 1 / self.write_bw)

    def hardware_fields(self) -> dict:
        """The planner's ``Hardware`` fields this measurement sets."""
        return {"disk_bw": self.bandwidth, "disk_bytes": float(self.free_bytes)}

    def describe(self) -> str:
        return (f"disk ({self.path}): read {self.read_bw / 1e9:.2f} GB/s, write "
                f"{self.write_bw / 1e9:.2f} GB/s ({fmt_bytes(self.size)} file, fsynced, page "
                f"cache dropped), {fmt_bytes(self.free_bytes)} free")


def _split(c: Compute) -> str:
    """How the planner splits the GPT's rate (measure_compute), for the calibration's line."""
    if c.activation_passes <= 0:
        return " (as fast as the matmul: its whole-block rate is used)"
    return (f" (GEMMs at the matmul rate, the rest {c.activation_passes:.1f} passes over its "
            "activations)")


def measure_disk(directory: str = "", size: int = 64 << 20, budget: float = 2.0) -> Disk | None:
    """Write ``size`` bytes (at most; at most a tenth of the free space) in 4 MiB chunks to a
    temporary file in ``directory`` (the temp dir when empty), fsync, drop its pages from the
    cache and read it back; stop writing once ``budget`` seconds have passed and time what was
    written. None when the directory cannot be written (the planner keeps its defaults)."""
    directory = directory or tempfile.gettempdir()
    chunk = os.urandom(4 << 20)
    try:
        free = shutil.disk_usage(directory).free
        size = max(len(chunk), min(size, free // 10))
        with tempfile.NamedTemporaryFile(dir=directory, prefix="shardwise-disk-") as f:
            t0, written = time.perf_counter(), 0
            while written < size and time.perf_counter() - t0 < budget:
                written += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            write_s = time.perf_counter() - t0
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            with open(f.name, "rb", buffering=0) as r:
                while r.read(len(chunk)):
                    pass
            read_s = time.perf_counter() - t0
    except OSError:
        return None
    return Disk(directory, written / max(read_s, 1e-6), written / max(write_s, 1e-6), free,
                written)


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _timed(fn, device: torch.device, reps: int, budget: float = 0.6, warm: bool = True) -> float:
    """Median seconds of ``fn()`` after one untimed call (``warm``; synchronising a GPU, never
    in comm); fewer repetitions when they would take more than ``budget`` seconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = budget / reps
    if warm:
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


def measure_compute(cfg: Config, device: torch.device, threads: int, agree=None,
                    budget: float = 1.5) -> Compute:
    """Matmul FLOP/s, the GPT's fitted rate and per-block overhead, and copy bandwidth.

    The GPT is timed at one row and at ``rows`` rows, alternately (so that a slow spell of the
    machine falls on both points alike, not on one end of the fit), as many pairs as fit in
    ``budget`` seconds (3 to 9), and the median of each point is fitted. ``agree(x)`` (in a
    forked world: the largest ``x`` over the ranks, which is also a barrier) makes every rank
    take the same number of pairs and start each timing together, as training computes: all
    ranks at once."""
    from shardwise.models import build_model, lm_loss
    agree = agree or (lambda x: x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024 if device.type == "cuda" else 512
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        agree(0.0)
        matmul = 2 * n**3 / _timed(lambda: a @ b, device, 9)
        src = torch.randn(8 << 20, device=device)          # 32 MiB
        dst = torch.empty_like(src)
        agree(0.0)
        mem_bw = 2 * src.nelement() * 4 / _timed(lambda: dst.copy_(src), device, 7)
        model = build_model(replace(cfg.model, dropout=0.0), cfg.train.seed).to(device)
        spec = model_spec(cfg)

        def step(rows: int):
            x = torch.randint(0, spec.vocab, (rows, spec.seq_len), device=device)
            lm_loss(model(x), x).backward()

        t1 = agree(_timed(lambda: step(1), device, 1))
        # the second point: a batch large enough to weigh against the fixed costs of small
        # models, small enough to keep the calibration to seconds
        rows = max(2, min(cfg.train.batch_size, 16)) if t1 < 0.05 else 4 if t1 < 0.3 else 2
        pair = agree(_timed(lambda: step(rows), device, 1)) + t1
        ones, manys = [], []
        for _ in range(max(3, min(9, int(budget / max(pair, 1e-9))))):
            agree(0.0)
            ones.append(_timed(lambda: step(1), device, 1, warm=False))
            agree(0.0)
            manys.append(_timed(lambda: step(rows), device, 1, warm=False))
        t1, t2 = statistics.median(ones), statistics.median(manys)
        # t(b) = c0 + b * per_row; on a busy machine the two points can disagree, so the
        # intercept is kept within [0, 3/4 of either point], and the model no faster than the
        # matmul, the slope refitted through t2
        flops_row = spec.flops_per_token() * spec.seq_len
        c0 = min(max(0.0, t1 - (t2 - t1) / (rows - 1)), 0.75 * min(t1, t2))
        per_row = max((t2 - c0) / rows, flops_row / matmul)
        c0 = max(0.0, t2 - rows * per_row)
        model_flops = flops_row / per_row
        overhead = c0 / spec.layers
        optimizer_bw = _optimizer_rate(cfg, model, device, agree)
    finally:
        torch.set_num_threads(before)
    passes = activation_passes(spec, batch_of(cfg), per_row, matmul, mem_bw)
    return Compute(threads, matmul, model_flops, overhead, mem_bw, optimizer_bw, passes)


def activation_passes(spec: ModelSpec, batch: Batch, per_row: float, matmul: float,
                      mem_bw: float) -> float:
    """Split one sequence's fitted time ``per_row`` into the GEMMs at the ``matmul`` rate (as the
    planner charges them: planner/compute.py, their FLOPs slowed where they are small) and the
    rest, expressed as passes over the sequence's activation bytes at ``mem_bw`` (the planner's
    ``Hardware.activation_passes``), so the planner reproduces ``per_row`` on this model and
    charges a wider one's GEMMs at the matmul rate. 0 when the GEMMs alone take the whole
    time (the planner then keeps the GPT's whole-block rate)."""
    from shardwise.planner import kernels
    from shardwise.planner.layout import Layout
    from shardwise.planner.memory import activation_per_layer
    gemms = kernels.block_gemms(spec.hidden, spec.heads, spec.ffn, spec.seq_len, 1, 1)
    slow = kernels.slowdown(gemms, matmul, mem_bw, 0.0, 2 if batch.mixed else 4)
    flops = spec.flops_per_token() * spec.seq_len
    rest = per_row - flops / matmul * slow
    touched = spec.layers * activation_per_layer(spec, Layout(), batch, full=True)
    return rest * mem_bw / touched if rest > 0 and touched > 0 else 0.0


def _optimizer_rate(cfg: Config, model: torch.nn.Module, device: torch.device, agree) -> float:
    """Bytes/s of the configured optimizer's step on ``model`` (its gradients are those of the
    timed backwards): the planner's bytes per parameter over the median of 5 steps after the
    one that creates the states."""
    from shardwise.run.api import optimizer_factory
    from shardwise.planner.cost import optimizer_bytes
    params = [p for p in model.parameters() if p.grad is not None]
    opt = optimizer_factory(cfg)(params)
    agree(0.0)
    seconds = _timed(opt.step, device, 5, budget=1.0)
    return optimizer_bytes(batch_of(cfg)) * sum(p.numel() for p in params) / seconds


def processes(cfg: Config) -> int:
    """The process count a multi-process strategy gets here (``launch.local_world_size``)."""
    from shardwise.launch import torchrun as launch
    p = replace(cfg.parallel, strategy=Strategy.DDP, dp=0, tp=1, pp=1)
    return launch.local_world_size(replace(cfg, parallel=p))


def calibrate(cfg: Config) -> Calibration:
    """Measure this machine for ``cfg``'s GPT (the allreduce first: it forks, and a process
    should fork before its compute threads have run)."""
    from shardwise.run.runtime import pick_device
    t0 = time.perf_counter()
    n = processes(cfg)
    device = pick_device(cfg.train.device, 0)
    if device.type == "cuda":
        # no forked gloo world: its bandwidth is not the GPUs'; one GPU needs no link, several
        # take the catalogue's (NCCL launches are microseconds, inside the latency)
        links = gpu_links(n, torch.cuda.get_device_name(device))
        whole = measure_compute(cfg, device, torch.get_num_threads())
        per_rank, memory = whole, torch.cuda.get_device_properties(device).total_memory
    else:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1")) if n > 1 else torch.get_num_threads()
        # on CPU the ranks share the cores and the memory bus: time each rank's compute while
        # all ranks run at once, in the same forked world that measures the allreduce
        links = measure_links(n, cfg, threads, measure_compute)
        whole = measure_compute(cfg, device, torch.get_num_threads())
        per_rank = links.compute or whole
        memory = _ram_bytes()
    disk = measure_disk(cfg.memory.offload_dir)
    return Calibration(device.type, n, per_rank, whole, links.bw, links.alpha, memory,
                       time.perf_counter() - t0, links.overhead, links.shared_bw, links.source,
                       links.interconnect, disk)



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


def batch_of(cfg: Config) -> Batch:
    """The global batch, precision and optimizer of ``cfg`` in the planner's terms."""
    precision = "fp32" if cfg.memory.mixed_precision == "no" else cfg.memory.mixed_precision
    optimizer = "sgd" if cfg.train.optimizer == "sgd" else "adam"
    return Batch(cfg.train.batch_size, precision=precision, optimizer=optimizer,
                 init=cfg.model.init)
