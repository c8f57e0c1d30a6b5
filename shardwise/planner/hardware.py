"""The machine a plan is made for: nodes of identical devices, the links inside and between them.

Build one from the catalogue (``Hardware.from_catalogue("a100-80gb", nodes=128, ...)``) or from
plain numbers (``Hardware.custom(...)``, what a calibration produces). Every rate is an effective
rate (see ``catalogue.py``); every field can be overridden with ``dataclasses.replace``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from shardwise.planner import catalogue
from shardwise.planner.errors import PlanError
from shardwise.planner.units import fmt_bytes


@dataclass(frozen=True)
class Hardware:
    """A cluster: ``nodes`` x ``devices_per_node`` identical devices."""

    nodes: int
    """Number of machines."""
    devices_per_node: int
    """Accelerators per machine (GPUs, or processes for ``cpu``)."""
    memory_bytes: int
    """Memory per device, bytes."""
    peak_flops: float
    """Dense 16-bit FLOP/s per device (the MFU denominator)."""
    intra_bw: float
    """Effective per-device bandwidth inside a node (NVLink or PCIe), bytes/s per direction."""
    inter_bw: float
    """Effective bandwidth between nodes, bytes/s per direction per *node* (all adapters)."""
    peak_flops_fp32: float = 0.0
    """Dense fp32 FLOP/s per device; 0 means the same as ``peak_flops``."""
    efficiency: float = 1.0
    """Fraction of the peak a transformer layer reaches (1.0 when the peak was measured)."""
    mem_bw: float = 1e12
    """Device memory bandwidth, bytes/s (bounds the optimizer step)."""
    intra_latency: float = 1e-6
    """Seconds per ring step inside a node."""
    inter_latency: float = 5e-6
    """Seconds per ring step between nodes."""
    reserved_bytes: int = 0
    """Device memory tensors cannot use (CUDA context, workspaces)."""
    headroom: float = 0.0
    """Fraction of ``memory_bytes - reserved_bytes`` a plan leaves free (catalogue.GPU_HEADROOM:
    the caching allocator's fragmentation); ``usable_memory`` is the rest."""
    block_overhead: float = 0.0
    """Fixed seconds per transformer block per micro-batch (launches, dispatch), fwd + bwd."""
    gemm_latency: float = 0.0
    """Fixed seconds per GEMM call beyond its FLOPs and bytes (kernels.py's curve; 0 when the
    rate was measured on whole blocks, as a calibration does)."""
    activation_passes: float = 0.0
    """Times the non-GEMM kernels of a block (norms, softmax, dropout, GeLU, bias and residual
    adds) move its activation bytes through device memory in a forward and backward
    (compute.py); 0 when ``efficiency`` is a whole-block rate that includes them (a
    calibration's, a custom machine's)."""
    comm_overlap: float = 1.0
    """Fraction of compute time that data-parallel traffic can hide behind: 1 where NICs and
    copy engines move the bytes (GPUs), 0 where collectives and compute share the same cores
    (CPU training: the reduction needs the cores that backward is using)."""
    collective_overhead: float = 0.0
    """Seconds each collective or point-to-point transfer costs beyond its alpha-beta time when
    it follows compute, as in training (the ranks' arrival skew, waking the backend's threads
    and the peer's receive). A CPU calibration measures it (about 3 ms per call with gloo on a
    loaded 2-core machine, against 0.2 ms per ring step idle); 0 for the catalogue's GPUs, where
    NCCL's few microseconds per launch are inside ``intra_latency``."""
    collective_copies: float = 0.0
    """Whole-size temporaries the backend allocates per reduce-scatter or all-gather in flight,
    as a multiple of the collective's tensor: 1 for gloo (it copies the input of a
    reduce-scatter and gathers into a temporary of the output's size; a CPU calibration sets
    it), 0 for NCCL (in place). Counted in the ``buffers`` of ZeRO layouts (memory.py). Such a
    backend also takes an allreduce's time for them (comm.dp_collective)."""
    optimizer_bw: float = 0.0
    """Bytes/s the device's optimizer step reaches over the bytes it touches (cost.optimizer_bytes);
    0: ``mem_bw``. A CPU calibration times the configured optimizer on the model: PyTorch's CPU
    AdamW reaches about half the copy bandwidth here (11 ms for 3.3M parameters, 93 MB)."""
    allreduce_bw: float = 0.0
    """Bus bandwidth of a data-parallel allreduce whose group lies inside one node, where it
    takes a faster path than the ring over the links, bytes/s: CPU ranks on one host sum
    through shared memory (shardwise/comm/shm.py; a CPU calibration measures it). 0: the
    link's rate. Reduce-scatter, all-gather, tensor-parallel allreduces and pipeline sends keep
    the link's rate (they do not take that path)."""
    compute_lanes: int = 0
    """Ranks of a node that compute at full speed at once: 0 when every rank has a device of
    its own; a CPU calibration sets cores / threads per rank. When a node runs more ranks than
    lanes, ``efficiency`` (calibrated with all of them computing) is the contended rate, and
    ranks computing while others idle in a pipeline bubble run up to ranks / lanes faster."""
    host_bw: float = 20e9
    """Device <-> host copy bandwidth per device, bytes/s (offload)."""
    host_memory_bytes: int = catalogue.HOST_DEFAULTS["host_memory_bytes"]
    """Host memory per node, bytes (must hold what ``offload=cpu`` moves there)."""
    host_mem_bw: float = catalogue.HOST_DEFAULTS["host_mem_bw"]
    """Host memory bandwidth per node usable by the CPU optimizer step, bytes/s."""
    disk_bw: float = catalogue.HOST_DEFAULTS["disk_bw"]
    """NVMe bandwidth per node, bytes/s (``offload=disk``)."""
    disk_bytes: float = catalogue.HOST_DEFAULTS["disk_bytes"]
    """NVMe capacity per node, bytes."""
    name: str = "custom"
    """Accelerator name, for the report."""
    interconnect: str = "custom"
    """Intra-node link name (nvlink, pcie), for the report and the guide's rules."""
    network: str = "custom"
    """Inter-node network name, for the report and the guide's rules."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                floor = 1 if f.name in ("nodes", "devices_per_node") else 0
                if value < floor or (value == 0 and f.name in _POSITIVE):
                    flag = _FLAGS.get(f.name, f.name)
                    raise PlanError(flag, value, "is not positive",
                                    f"give --{flag.replace('_', '-')} a number above zero")
        if self.memory_bytes <= self.reserved_bytes:
            raise PlanError("memory", fmt_bytes(self.memory_bytes),
                            f"leaves nothing for tensors: the device reserves "
                            f"{fmt_bytes(self.reserved_bytes)} (CUDA context, workspaces)",
                            "give the device's whole memory, e.g. --memory 80GiB")
        if self.headroom >= 1:
            raise PlanError("headroom", self.headroom, "is not below 1",
                            "give the fraction of device memory a plan leaves free, e.g. 0.1")
        if self.comm_overlap > 1:
            raise PlanError("comm_overlap", self.comm_overlap, "is above 1",
                            "give the fraction of compute that can hide communication, 0 to 1")
        if self.efficiency > 1:
            raise PlanError("efficiency", self.efficiency, "is above 1",
                            "give the fraction of peak reached, e.g. 0.5")

    @property
    def world_size(self) -> int:
        """All devices of all nodes."""
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> int:
        """Device memory a plan may fill: less the reserved part, less the headroom."""
        return int((self.memory_bytes - self.reserved_bytes) * (1 - self.headroom))

    def peak(self, precision: str) -> float:
        """Data-sheet FLOP/s of one device for ``precision`` (the MFU denominator)."""
        return (self.peak_flops_fp32 or self.peak_flops) if precision == "fp32" else self.peak_flops

    def flops(self, precision: str) -> float:
        """Sustained FLOP/s of one device for ``precision``: peak x efficiency."""
        return self.peak(precision) * self.efficiency

    def link(self, size: int, stride: int) -> tuple[float, float]:
        """(bytes/s, seconds per step) of a ring over ``size`` ranks ``stride`` apart.

        Ranks are numbered node by node. A group inside one node runs at ``intra_bw``. A group
        that crosses nodes with ``k`` members per node can drive ``k`` of the node's
        ``devices_per_node`` adapters' share: ``inter_bw * k / devices_per_node`` (the node's
        other devices run their own groups at the same time), and never more than ``intra_bw``.
        """
        if size <= 1:
            return float("inf"), 0.0
        g = self.devices_per_node
        if stride * size <= g:
            return self.intra_bw, self.intra_latency
        per_node = max(1, min(size, g // stride)) if stride < g else 1
        return min(self.intra_bw, self.inter_bw * per_node / g), self.inter_latency

    def describe(self) -> str:
        """One line: ``128 x 8 a100-80gb (nvlink), network 8x200gbps``."""
        net = f", network {self.network}" if self.nodes > 1 else ""
        return f"{self.nodes} x {self.devices_per_node} {self.name} ({self.interconnect}){net}"

    def to_dict(self) -> dict:
        """All fields, for ``--format json``."""
        return asdict(self)

    @classmethod
    def custom(cls, *, nodes: int, devices_per_node: int, memory_bytes: int, peak_flops: float,
               intra_bw: float, inter_bw: float | None = None, intra_latency: float = 1e-6,
               inter_latency: float = 5e-6, **more: float) -> "Hardware":
        """A machine from plain numbers (a calibration's output); ``more`` sets other fields.

        ``inter_bw`` defaults to ``intra_bw`` (irrelevant when ``nodes == 1``).
        """
        return cls(nodes=nodes, devices_per_node=devices_per_node, memory_bytes=int(memory_bytes),
                   peak_flops=peak_flops, intra_bw=intra_bw,
                   inter_bw=intra_bw if inter_bw is None else inter_bw,
                   intra_latency=intra_latency, inter_latency=inter_latency, **more)

    @classmethod
    def from_catalogue(cls, gpu: str, nodes: int = 1, devices_per_node: int = 8,
                       interconnect: str | None = None, network: str | None = None,
                       **overrides: float) -> "Hardware":
        """A cluster of catalogue devices; ``overrides`` replace any field afterwards.

        ``interconnect`` defaults to nvlink where the device has it, else pcie; ``network``
        defaults to ``100gbps``.
        """
        acc = catalogue.accelerator(gpu)
        if acc is None:
            names = ", ".join(a.name for a in catalogue.ACCELERATORS)
            raise PlanError("gpu", gpu, "is not in the catalogue",
                            f"use one of {names} (then override --memory / --peak-tflops)")
        link = _interconnect(acc, interconnect)
        net = catalogue.network(network or "100gbps")
        if net is None:
            names = ", ".join(n.name for n in catalogue.NETWORKS)
            raise PlanError("network", network, "is not in the catalogue",
                            f"use one of {names}, or give --inter-bw")
        hw = cls(nodes=nodes, devices_per_node=devices_per_node, memory_bytes=acc.memory_bytes,
                 peak_flops=acc.peak_flops, peak_flops_fp32=acc.peak_flops_fp32,
                 efficiency=acc.efficiency, mem_bw=acc.mem_bw,
                 intra_bw=acc.nvlink_bw if link == "nvlink" else acc.pcie_bw,  # pcie or shm
                 intra_latency=acc.intra_latency or catalogue.INTERCONNECT_LATENCY[link],
                 inter_bw=net.bandwidth,
                 inter_latency=net.latency, reserved_bytes=acc.reserved_bytes,
                 host_bw=acc.host_bw, block_overhead=acc.block_overhead,
                 gemm_latency=acc.gemm_latency, activation_passes=acc.activation_passes,
                 headroom=acc.headroom, name=acc.name,
                 interconnect=link, network=net.name)
        return replace(hw, **overrides) if overrides else hw


_FLAGS = {"memory_bytes": "memory", "peak_flops": "peak-tflops", "devices_per_node":
          "gpus-per-node", "host_memory_bytes": "host-memory", "disk_bytes": "disk-size",
          "disk_bw": "disk-bw"}
"""The ``shardwise plan`` option that sets a field, where the names differ."""

_POSITIVE = ("memory_bytes", "peak_flops", "intra_bw", "inter_bw", "efficiency", "mem_bw",
             "host_bw", "host_mem_bw", "disk_bw")
"""Fields that may not be zero."""


def _interconnect(acc: catalogue.Accelerator, name: str | None) -> str:
    """The intra-node link for ``acc``: ``nvlink`` or ``pcie``, checked against the device."""
    if name is None:
        # CPU processes talk through shared memory; the rate is the catalogue's pcie_bw entry.
        return "nvlink" if acc.nvlink_bw is not None else "shm" if acc.name == "cpu" else "pcie"
    name = name.lower()
    if name not in ("nvlink", "pcie"):
        raise PlanError("interconnect", name, "is not a known link", "use nvlink or pcie")
    if name == "nvlink" and acc.nvlink_bw is None:
        raise PlanError("interconnect", name, f"is not available on {acc.name}",
                        "use --interconnect pcie")
    return name
