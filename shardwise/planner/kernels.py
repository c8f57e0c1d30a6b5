"""Kernel efficiency as a function of GEMM size: why small layers run below the device's rate.

A GEMM ``(M x K) @ (K x N)`` (``F = 2 M N K`` FLOPs, ``B = e (M K + K N + M N)`` bytes of
``e``-byte elements) takes, on a device of sustained rate ``R = peak x efficiency``, memory
bandwidth ``W`` and fixed cost ``t0`` per call (``Hardware.gemm_latency``: launch, tail wave,
the part of a kernel that does not shrink with its size)::

    t(F, B) = max(F / R, B / W) + t0            efficiency(F, B) = (F / R) / t(F, B)

so a large GEMM runs at ``R`` (the ``efficiency`` of the catalogue: the plateau), one of
half-efficiency has ``F / R = t0`` (compute-bound) and a thin one is held to ``W``'s roofline.

Default curve per GPU (catalogue.py): ``t0 = 5 us``, ``W`` the HBM bandwidth: cuBLAS bf16
GEMMs on an A100 run a 1024^3 one near 60% of the rate of an 8192^3 one (2.1 GFLOP at
~170 TFLOP/s = 12.6 us against 7.5 us at the plateau: 5 us more), and larger ones at the
plateau. This is a documented default, not a measurement; :func:`fit_curve` replaces it from
timed GEMMs on the machine at hand (``R`` and ``t0`` by least squares on the compute-bound
points), which is what a calibration should feed ``Hardware(peak_flops=R, efficiency=1,
gemm_latency=t0)``.

A transformer block of a micro-batch runs these GEMMs (``T = b s`` tokens, tp ``t``), each
once in the forward and twice in the backward (input and weight gradients, the same shape):
QKV ``T x h -> 3h/t``, projection ``T x h/t -> h``, MLP ``T x h -> f/t`` and ``T x f/t -> h``,
and per head (``b a / t`` of them, batched into one call) the scores ``s x d -> s`` and the
weighted values ``s x s -> d``, ``d = h / a``. The output head is ``T x h -> V/t``.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.errors import PlanError


@dataclass(frozen=True)
class Gemm:
    """One (batched) matrix multiply: ``batch`` products of ``(m x k) @ (k x n)``."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        """2 m n k per product."""
        return 2.0 * self.m * self.n * self.k * self.batch

    def bytes(self, element: int) -> float:
        """Operands read and the result written, ``element`` bytes each."""
        return float(element) * (self.m * self.k + self.k * self.n + self.m * self.n) * self.batch


def gemm_seconds(g: Gemm, rate: float, mem_bw: float, latency: float, element: int) -> float:
    """``max(F / R, B / W) + t0`` (module docstring)."""
    return max(g.flops / rate, g.bytes(element) / mem_bw) + latency


def efficiency(g: Gemm, rate: float, mem_bw: float, latency: float, element: int) -> float:
    """The fraction of ``rate`` the GEMM reaches: ``(F / R) / t``."""
    return (g.flops / rate) / gemm_seconds(g, rate, mem_bw, latency, element)


def block_gemms(hidden: int, heads: int, ffn: int, seq_len: int, micro_batch: int,
                tp: int) -> list[Gemm]:
    """The forward GEMMs of one transformer block for one micro-batch on one tp rank."""
    t, tokens, d = tp, micro_batch * seq_len, hidden // heads
    return [Gemm(tokens, 3 * hidden // t, hidden), Gemm(tokens, hidden, hidden // t),
            Gemm(tokens, ffn // t, hidden), Gemm(tokens, hidden, ffn // t),
            Gemm(seq_len, seq_len, d, micro_batch * heads // t),
            Gemm(seq_len, d, seq_len, micro_batch * heads // t)]


def slowdown(gemms: list[Gemm], rate: float, mem_bw: float, latency: float,
             element: int) -> float:
    """How much longer ``gemms`` take than their FLOPs at ``rate``: ``sum t / sum F / R`` (>= 1;
    1 when every GEMM is large). The cost model multiplies a block's FLOP time by it."""
    ideal = sum(g.flops for g in gemms) / rate
    if ideal <= 0:
        return 1.0
    return sum(gemm_seconds(g, rate, mem_bw, latency, element) for g in gemms) / ideal


def fit_curve(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """``(R, t0)`` from timed GEMMs ``[(flops, seconds), ...]``: the least-squares line
    ``seconds = flops / R + t0`` (compute-bound points: square GEMMs of 256 and up). Needs two
    distinct sizes; ``t0`` is floored at 0."""
    if len({f for f, _ in samples}) < 2:
        raise PlanError("gemm_samples", len(samples), "has fewer than two GEMM sizes",
                        "time GEMMs of at least two sizes, e.g. 512^3 and 2048^3")
    n = len(samples)
    mf = sum(f for f, _ in samples) / n
    ms = sum(s for _, s in samples) / n
    cov = sum((f - mf) * (s - ms) for f, s in samples)
    var = sum((f - mf) ** 2 for f, _ in samples)
    slope = cov / var
    if slope <= 0:
        raise PlanError("gemm_samples", n, "do not take longer as they grow",
                        "time larger GEMMs (or repeat the timing on an idle machine)")
    return 1.0 / slope, max(0.0, ms - slope * mf)
