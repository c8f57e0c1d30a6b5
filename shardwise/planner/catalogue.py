"""A small catalogue of accelerators and networks, with the sources of every number.

Every rate here is an *effective* rate, what a collective or a copy achieves in practice, derived
from the nominal figure by one of the factors below (so the derivation is visible and each entry
can be checked against a data sheet). Everything can be overridden on ``Hardware``.

Factors (stated once, applied by hand in the table):
- NVLink: 0.8 of the nominal per-direction bandwidth; nccl-tests' allreduce bus bandwidth on a
  DGX A100 is about 230 GB/s of the nominal 300 GB/s.
- PCIe between GPUs (collectives, no NVLink): 0.4 of the nominal x16 per-direction bandwidth; in
  an 8-GPU PCIe server two GPUs share each switch uplink and rings cross the CPU sockets.
- PCIe to the host (offload copies, pinned memory): 0.7 of nominal (ZeRO-Offload measured about
  11 GB/s per GPU on PCIe gen3 x16).
- Networks: 0.9 of the line rate per direction.

``efficiency`` is the fraction of the 16-bit dense peak that a large transformer layer's forward
and backward kernels reach on the device, communication and pipeline idling excluded (the cost
model adds those itself). On A100 it is the GEMMs' rate alone, and ``activation_passes`` prices
the memory-bound kernels between them (compute.py), so that a layer's rate grows with its width
as the published runs show (about 43% of peak for Megatron-LM's 1.7B model, 52% for 22B, 65-74%
from 175B up): both fitted to Korthikanti et al. 2022's iteration times (``A100_GEMM``). A single
efficiency (0.55, before) put the wide models 30% slow and the narrow ones 24% fast. On V100,
Megatron-LM (Shoeybi et al. 2019) reports 39 TFLOP/s on one GPU, 30% of 125: 0.30. H100 / H200:
NVIDIA's published GPT-3 175B runs sit near 50%: 0.50. L4: no published training figure; 0.40
is a guess, stated as such. ``cpu``: one CPU process, from the measurements in DESIGN.md; a
calibration should replace it.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
MIB = 2**20

GPU_HEADROOM = 0.05
"""Fraction of a GPU's memory for tensors that a plan leaves free: a layout fits when its
estimate is at most 95% of ``memory - reserved``. Why: the caching allocator fragments (the
ZeRO paper, Rajbhandari et al. 2020, sec. 3.2, saw runs fail with over 30% of memory free in
extreme cases), so a plan at 97% of memory would run out on the machine. Why not more: N21
Table 2's ZeRO-3 run of 529.6B on 1,120 GPUs ran, and it is 90.3% of its A100 in the planner's
count, so a headroom of 10% would refuse a run that was made. A guess inside those bounds, not
a measurement of ours; docs/planner.md ("Published runs") shows Table 1's choices at 0, 5, 10
and 15%. ``cpu``: 0 (glibc returns freed memory, and the CPU rows are checked against
measured peaks directly)."""


@dataclass(frozen=True)
class Accelerator:
    """One kind of device, as sold, with effective rates."""

    name: str
    """Catalogue name, e.g. ``a100-80gb``."""
    memory_bytes: int
    """Device memory in bytes, as the driver reports it."""
    peak_flops: float
    """Dense 16-bit (bf16 / fp16) tensor FLOP/s, from the data sheet (no sparsity)."""
    peak_flops_fp32: float
    """Dense fp32 FLOP/s without TF32 (PyTorch's default for matmuls)."""
    efficiency: float
    """Fraction of the peak a transformer layer's kernels reach (see the module docstring)."""
    mem_bw: float
    """Device memory bandwidth, bytes/s (bounds the optimizer step)."""
    nvlink_bw: float | None
    """Effective per-GPU NVLink bandwidth per direction, bytes/s; None when there is none."""
    pcie_bw: float
    """Effective per-GPU bandwidth for collectives over PCIe, bytes/s."""
    host_bw: float
    """Effective device <-> host copy bandwidth per device, bytes/s (offload)."""
    reserved_bytes: int
    """Device memory not available to tensors: CUDA context, library workspaces."""
    intra_latency: float | None = None
    """Seconds per ring step inside a node; None: ``INTERCONNECT_LATENCY`` of the link."""
    block_overhead: float = 60e-6
    """Fixed seconds per block per micro-batch, forward + backward, that FLOPs do not explain,
    outside the GEMMs: about 12 non-GEMM kernel launches of ~5 us on a GPU (a guess, not a
    measurement; CUDA graphs or compilation lower it). With the 18 GEMM calls' ``gemm_latency``
    a block's fixed cost is 150 us. Negligible for large models, dominant for tiny ones."""
    gemm_latency: float = 5e-6
    """Fixed seconds per GEMM call (kernels.py: the default curve ``max(F/R, B/W) + t0``)."""
    activation_passes: float = 0.0
    """Times a block's non-GEMM kernels move its activation bytes through HBM (compute.py); 0
    where ``efficiency`` is a whole-layer rate (see the module docstring)."""
    headroom: float = 0.0
    """Fraction of the memory left for tensors that a plan keeps free (see ``GPU_HEADROOM``)."""


def _gpu(name, mem, bf16, fp32, eff, hbm, nvlink, pcie_gen_bw, passes=0.0):
    """A GPU entry from nominal figures: NVLink and PCIe scaled by the module's factors."""
    return Accelerator(name=name, memory_bytes=int(mem), peak_flops=bf16 * 1e12,
                       peak_flops_fp32=fp32 * 1e12, efficiency=eff, mem_bw=hbm * 1e9,
                       nvlink_bw=None if nvlink is None else 0.8 * nvlink * 1e9,
                       pcie_bw=0.4 * pcie_gen_bw * 1e9, host_bw=0.7 * pcie_gen_bw * 1e9,
                       reserved_bytes=1 * GIB, activation_passes=passes, headroom=GPU_HEADROOM)


A100_GEMM, A100_PASSES = 0.82, 9.5
"""The A100's GEMM plateau (fraction of the 312 TFLOP/s peak) and its non-GEMM kernels' passes
over a block's activation bytes (compute.py), fitted together by least squares (a grid of 0.01
and 0.5) to the four full-recomputation iteration times of Korthikanti et al. 2022, Table 5
(22B, 175B, 530B, 1T on 8-512 A100s: published.py), through the whole cost model (bubble,
tensor-parallel allreduces and optimizer included); checked on the rows it was not fitted to
(shardwise/bench/planner_published.py, docs/planner.md). 0.82 x 312 = 256 TFLOP/s, about what
cuBLAS's large bf16 GEMMs reach on an A100."""

ACCELERATORS: tuple[Accelerator, ...] = (
    #    name          memory        bf16  fp32  eff   HBM GB/s NVLink/dir PCIe x16/dir passes
    _gpu("a100-40gb", 40 * GIB, 312, 19.5, A100_GEMM, 1555, 300, 32, A100_PASSES),
    _gpu("a100-80gb", 80 * GIB, 312, 19.5, A100_GEMM, 2039, 300, 32, A100_PASSES),
    _gpu("h100-80gb", 80 * GIB, 989, 67, 0.50, 3350, 450, 64),
    _gpu("h200", 143771 * MIB, 989, 67, 0.50, 4800, 450, 64),
    _gpu("v100", 32 * GIB, 125, 15.7, 0.30, 900, 150, 16),
    _gpu("v100-16gb", 16 * GIB, 125, 15.7, 0.30, 900, 150, 16),
    _gpu("l4", 23034 * MIB, 121, 30.3, 0.40, 300, None, 32),
    # One single-threaded CPU process as a device, from DESIGN.md's measurements on the
    # development machine: a 3.3M-parameter GPT (20.9 MFLOP per token) trained at 8,500
    # tokens/s on 2 threads, i.e. ~89 GFLOP/s per thread *achieved* (so efficiency 1.0); gloo
    # allreduce bus bandwidth 1.4 GB/s; 50 us per message. 16 GiB and the 300 us of eager
    # dispatch per block (~30 ops at ~10 us, GEMMs included: gemm_latency 0) are placeholders.
    Accelerator(name="cpu", memory_bytes=16 * GIB, peak_flops=89e9, peak_flops_fp32=89e9,
                efficiency=1.0, mem_bw=20e9, nvlink_bw=None, pcie_bw=1.4e9, host_bw=5e9,
                reserved_bytes=0, intra_latency=50e-6, block_overhead=300e-6, gemm_latency=0.0),
)


@dataclass(frozen=True)
class Network:
    """The links between nodes, per node."""

    name: str
    """Catalogue name, e.g. ``100gbps`` or ``8x200gbps``."""
    bandwidth: float
    """Effective bytes/s per node per direction, all the node's adapters together."""
    latency: float
    """Seconds per message (one step of a ring)."""
    description: str
    """What it is, for the report."""


def _net(name, gbit_per_node, latency_us, description):
    """A network entry from its line rate in Gbit/s per node (0.9 of it is effective)."""
    return Network(name, 0.9 * gbit_per_node * 1e9 / 8, latency_us * 1e-6, description)


NETWORKS: tuple[Network, ...] = (
    _net("10gbps", 10, 30, "10 Gb Ethernet, TCP (the guide's 'poor man's' network)"),
    _net("25gbps", 25, 20, "25 Gb Ethernet"),
    _net("100gbps", 100, 5, "one 100 Gb/s InfiniBand EDR / RoCE adapter per node"),
    _net("200gbps", 200, 5, "one 200 Gb/s InfiniBand HDR adapter per node"),
    _net("400gbps", 400, 5, "one 400 Gb/s InfiniBand NDR adapter per node"),
    _net("8x200gbps", 1600, 5, "8 x 200 Gb/s InfiniBand HDR per node (DGX A100 SuperPOD)"),
    _net("8x400gbps", 3200, 5, "8 x 400 Gb/s InfiniBand NDR per node (DGX H100 SuperPOD)"),
)

INTERCONNECT_LATENCY = {"nvlink": 1e-6, "pcie": 2e-6, "shm": 50e-6}
"""Seconds per ring step inside a node (nccl's small-message allreduce on 8 GPUs: ~10-15 us)."""

HOST_DEFAULTS = {"host_memory_bytes": 1024 * GIB, "host_mem_bw": 150e9,
                 "disk_bw": 10e9, "disk_bytes": 15e12}
"""Per node: a DGX-class host (1 TiB DRAM, 150 GB/s usable by CPU Adam, NVMe 10 GB/s, 15 TB)."""


def accelerator(name: str) -> Accelerator | None:
    """The catalogue entry called ``name`` (case-insensitive), or None."""
    return next((a for a in ACCELERATORS if a.name == name.lower()), None)


def network(name: str) -> Network | None:
    """The network called ``name`` (case-insensitive, ``Gbps`` accepted), or None."""
    return next((n for n in NETWORKS if n.name == name.lower()), None)
