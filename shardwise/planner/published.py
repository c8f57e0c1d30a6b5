"""The published training runs the planner is checked against: every number typed once, here,
with the table and row it comes from (replay.py runs them through the cost model).

Sources (the numbers as the papers print them, typed from their tables: no copy of either
paper was reachable from this project's search tools to re-check them against, so each row is
checked for internal consistency instead, tests/planner/test_planner_published.py: TFLOP/s per
GPU x GPUs = the aggregate column, and 8 T P / (n X) = the days column):

- **N21**: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC21). Section 5: GPT models with vocabulary 51,200 and
  sequence 2,048 on Selene, DGX A100 80 GB nodes (8 GPUs on NVLink / NVSwitch, 8 x 200 Gb/s
  HDR InfiniBand each). Table 1 (weak scaling: t, p, GPUs, batch, TFLOP/s per GPU) and Table 2
  (ZeRO-3 without model parallelism against PTD-P, 175B and 530B at a fixed batch). Their
  TFLOP/s are eq. 3's FLOPs, ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per iteration, over
  time and GPUs; eq. 3 counts activation recomputation, so replay.py estimates the paper's
  layouts with full recomputation.
- **K22**: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models". Table 3 (22B, 175B, 530B, 1T: t, p, GPUs, batch, micro-batch) and Table 5 (the
  iteration time with full recomputation, and with selective recomputation + sequence
  parallelism, "present work"); same vocabulary and sequence, same machine. Assumed here:
  1F1B without interleaving (the paper's Table 3 names no interleaving).

The *published top 3* of a Table 1 row (what the planner's first choice is compared with) is
read off N21's own rules for choosing (t, p), which its sweeps support: takeaway 1 (Figure 13,
t x p at a fixed model-parallel size: tensor parallelism up to the GPUs of a node, then
pipeline parallelism across nodes) and takeaway 2 (Figures 14 and 15: the smallest
model-parallel size that fits, then data parallelism). Those two rules order the (t, p) a
model can run as a chain: t = 1, 2, 4, 8 with p = 1, then t = 8 with p over the divisors of
the layer count (Megatron's stages hold equal layers) such that t p divides the GPUs. The
published top 3 are the published (t, p) and its two chain neighbours: one step less model
parallelism and one step more (two on the inner side at an end of the chain). A planner
choice counts when its (t, p) is among them and it uses no ZeRO (N21's runs used none).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.names import Strategy

VOCAB, SEQ_LEN = 51200, 2048
"""N21 section 5.1 (and K22's setup): every model's vocabulary and sequence length."""
GPUS_PER_NODE, NETWORK, GPU = 8, "8x200gbps", "a100-80gb"
"""Selene (N21 section 5): DGX A100 80 GB nodes of 8 GPUs, 8 x 200 Gb/s HDR per node."""
BAND = 0.20
"""How far a planner figure may be from the published one (issue 35 item 6)."""
TOP3_GOAL = 8
"""Table 1 rows whose planner choice must be in the published top 3 (of 10)."""


@dataclass(frozen=True)
class Shape:
    """A GPT as the tables give it."""

    name: str
    """The label the paper uses."""
    heads: int
    hidden: int
    layers: int


@dataclass(frozen=True)
class Table1Row:
    """N21 Table 1: one weak-scaling run."""

    shape: Shape
    tp: int
    pp: int
    gpus: int
    batch: int
    """Global batch, sequences."""
    tflops: float
    """Achieved TFLOP/s per GPU (eq. 3)."""
    aggregate_pflops: float
    """Achieved aggregate PFLOP/s (checks the row: tflops x gpus)."""


@dataclass(frozen=True)
class Table2Row:
    """N21 Table 2: ZeRO-3 without model parallelism, or PTD-P, at a fixed global batch."""

    scheme: str
    """``zero3`` or ``ptd-p``."""
    shape: Shape
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    tflops: float
    days: float
    """Training time for 300B tokens (checks the row: 8 T P / (n X), T = 300e9)."""


@dataclass(frozen=True)
class RecomputeRow:
    """K22 Table 3 (configuration) and Table 5 (iteration time, seconds)."""

    shape: Shape
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    full_s: float
    """Iteration time with full activation recomputation."""
    selective_s: float
    """With selective recomputation and sequence parallelism ("present work")."""


G1_7 = Shape("1.7B", 24, 2304, 24)
G3_6 = Shape("3.6B", 32, 3072, 30)
G7_5 = Shape("7.5B", 32, 4096, 36)
G18 = Shape("18.4B", 48, 6144, 40)
G39 = Shape("39.1B", 64, 8192, 48)
G76 = Shape("76.1B", 80, 10240, 60)
G146 = Shape("145.6B", 96, 12288, 80)
G310 = Shape("310.1B", 128, 16384, 96)
G530 = Shape("529.6B", 128, 20480, 105)
G1T = Shape("1008.0B", 160, 25600, 128)
GPT3 = Shape("174.6B", 96, 12288, 96)        # GPT-3 175B (N21 Table 2; K22 Table 3)
G22 = Shape("22B", 64, 6144, 48)             # K22 Table 3

TABLE1 = (
    # N21 Table 1, rows 1-10 (heads, hidden, layers in the shape): t, p, GPUs, batch, TFLOP/s
    # per GPU, aggregate PFLOP/s
    Table1Row(G1_7, 1, 1, 32, 512, 137, 4.4),
    Table1Row(G3_6, 2, 1, 64, 512, 138, 8.8),
    Table1Row(G7_5, 4, 1, 128, 512, 142, 18.2),
    Table1Row(G18, 8, 1, 256, 1024, 135, 34.6),
    Table1Row(G39, 8, 2, 512, 1536, 138, 70.8),
    Table1Row(G76, 8, 4, 1024, 1792, 140, 143.8),
    Table1Row(G146, 8, 8, 1536, 2304, 148, 227.1),
    Table1Row(G310, 8, 16, 1920, 2160, 155, 297.4),
    Table1Row(G530, 8, 35, 2520, 2520, 163, 410.2),
    Table1Row(G1T, 8, 64, 3072, 3072, 163, 502.0),
)

TABLE2 = (
    # N21 Table 2, "ZeRO-3 without model parallelism" rows 1-6: model-parallel size 1; batch,
    # GPUs, micro-batch, TFLOP/s per GPU, days for 300B tokens. The 640-GPU row ran a batch of
    # 2560 (the table's asterisk: 530B did not fit 560 GPUs at micro-batch 4).
    Table2Row(Strategy.ZERO3, GPT3, 1, 1, 384, 1536, 4, 144, 90),
    Table2Row(Strategy.ZERO3, GPT3, 1, 1, 768, 1536, 2, 88, 74),
    Table2Row(Strategy.ZERO3, GPT3, 1, 1, 1536, 1536, 1, 44, 74),
    Table2Row(Strategy.ZERO3, G530, 1, 1, 640, 2560, 4, 138, 169),
    Table2Row(Strategy.ZERO3, G530, 1, 1, 1120, 2240, 2, 98, 137),
    Table2Row(Strategy.ZERO3, G530, 1, 1, 2240, 2240, 1, 48, 140),
    # N21 Table 2, "PTD parallelism" rows 7-12: model-parallel size 96 (t = 8, p = 12) and
    # 280 (t = 8, p = 35), micro-batch 1
    Table2Row("ptd-p", GPT3, 8, 12, 384, 1536, 1, 153, 84),
    Table2Row("ptd-p", GPT3, 8, 12, 768, 1536, 1, 149, 43),
    Table2Row("ptd-p", GPT3, 8, 12, 1536, 1536, 1, 141, 23),
    Table2Row("ptd-p", G530, 8, 35, 560, 2240, 1, 171, 156),
    Table2Row("ptd-p", G530, 8, 35, 1120, 2240, 1, 167, 80),
    Table2Row("ptd-p", G530, 8, 35, 2240, 2240, 1, 159, 42),
)

RECOMPUTE = (
    # K22 Table 3 (t, p, GPUs, global batch, micro-batch) and Table 5 (seconds per iteration:
    # full recompute, present work), rows 1-4
    RecomputeRow(G22, 8, 1, 8, 4, 4, 1.42, 1.10),
    RecomputeRow(GPT3, 8, 8, 64, 64, 1, 18.13, 13.75),
    RecomputeRow(Shape("530B", 128, 20480, 105), 8, 35, 280, 280, 1, 49.05, 37.83),
    RecomputeRow(Shape("1T", 160, 25600, 128), 8, 64, 512, 512, 1, 94.42, 71.49),
)


def megatron_flops(shape: Shape, batch: int) -> float:
    """N21 eq. 3: FLOPs of one iteration with activation recomputation,
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``."""
    s, l, h = SEQ_LEN, shape.layers, shape.hidden
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def chain(shape: Shape, gpus: int) -> list[tuple[int, int]]:
    """N21's order of (t, p) for a model on ``gpus`` GPUs (module docstring): t = 1, 2, 4, 8
    at p = 1, then p over the divisors of the layers at t = 8; t divides the heads, t p the
    GPUs."""
    out = [(t, 1) for t in (1, 2, 4, 8) if shape.heads % t == 0 and gpus % t == 0]
    top = out[-1][0]
    out += [(top, p) for p in range(2, shape.layers + 1)
            if shape.layers % p == 0 and gpus % (top * p) == 0]
    return out


def top3(shape: Shape, gpus: int, published: tuple[int, int]) -> list[tuple[int, int]]:
    """The published (t, p) and its two neighbours on :func:`chain` (module docstring)."""
    order = chain(shape, gpus)
    i = order.index(published)
    lo = max(0, min(i - 1, len(order) - 3))
    return order[lo:lo + 3]
