"""The model being planned: a GPT-style decoder described by five numbers.

Parameter count (biases and layer norms included, as in ``shardwise.models.gpt``):
per layer ``4h^2 + 2hf + 9h + f`` (qkv 3h^2+3h, projection h^2+h, MLP h*f+f and f*h+h, two layer
norms 4h), which is ``12h^2 + 13h`` for the usual ``f = 4h``; plus the token embedding ``V h``,
the position embedding ``S h``, the final layer norm ``2h``, and an output head ``V h`` unless
it is tied to the token embedding.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from shardwise.planner.errors import PlanError


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer."""

    layers: int
    """Transformer blocks, L."""
    hidden: int
    """Model width, h."""
    heads: int
    """Attention heads, a (must divide ``hidden``)."""
    seq_len: int
    """Sequence length in tokens, s."""
    vocab: int
    """Vocabulary size, V."""
    ffn_hidden: int = 0
    """Width of the MLP's inner layer, f; 0 means 4h. (A SwiGLU MLP of width w counts as 1.5w.)"""
    tied_embeddings: bool = True
    """Whether the output head shares the token embedding's weights (GPT-2/3 do)."""
    fused_attention: bool = False
    """Whether attention runs as one fused kernel that does not keep the ``s x s`` score and
    softmax matrices for backward (FlashAttention, ``F.scaled_dot_product_attention``, as
    shardwise's own GPT does); the activation count then drops Korthikanti et al.'s
    ``5 a s^2 b`` term (planner/memory.py). False: the paper's unfused attention."""
    name: str = "custom"
    """Preset name, for the report."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if getattr(self, field) < 1:
                raise PlanError("model", getattr(self, field), f"has {field} below 1",
                                "give L,H,A,S,V as five positive integers")
        if self.hidden % self.heads:
            raise PlanError("model", f"hidden={self.hidden}, heads={self.heads}",
                            "has heads that do not divide hidden", "pick heads dividing hidden")

    @property
    def ffn(self) -> int:
        """The MLP's inner width f (4h unless set)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block: 4h^2 + 2hf + 9h + f."""
        h, f = self.hidden, self.ffn
        return 4 * h * h + 2 * h * f + 9 * h + f

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings: V h + S h."""
        return (self.vocab + self.seq_len) * self.hidden

    @property
    def head_params(self) -> int:
        """Final layer norm, plus the output head when untied: 2h (+ V h)."""
        return 2 * self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def params(self) -> int:
        """All parameters, P."""
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    def flops_per_token(self, recompute: bool = False) -> float:
        """Training FLOPs per token: 6 per weight that multiplies, plus attention scores.

        Per block ``6 * layer_params + 12 s h`` (forward 2, backward 4 per weight; ``12 s h``
        for Q K^T and the attention-weighted V, PaLM's count), plus ``6 V h`` for the output
        head; embedding lookups cost nothing. This is ``6 P + 12 L s h`` less the embedding
        tables (0.3% of GPT-3 175B). With full recomputation every block runs its forward twice:
        block terms x 4/3, i.e. ``8 P`` (Narayanan et al. 2021, eq. 3).
        """
        return self.layers * self.block_flops(recompute) + self.head_flops

    def block_flops(self, recompute: bool | str = False) -> float:
        """Training FLOPs of one block per token: 6 layer_params + 12 s h; x 4/3 with full
        recomputation (``True`` or ``"full"``); + 4 s h with ``"selective"`` (the attention
        core's forward, Q K^T and the weighted V, runs again: Korthikanti et al. 2022, sec. 5)."""
        block = 6 * self.layer_params + 12 * self.seq_len * self.hidden
        if recompute == "selective":
            return block + 4 * self.seq_len * self.hidden
        return block * (4 / 3 if recompute in (True, "full") else 1)

    @property
    def head_flops(self) -> float:
        """Training FLOPs of the output head per token: 6 V h (never recomputed)."""
        return 6 * self.vocab * self.hidden

    def describe(self) -> str:
        """One line: ``175B: L=96 h=12288 a=96 s=2048 V=50257, 174.6e9 parameters``."""
        return (f"{self.name}: L={self.layers} h={self.hidden} a={self.heads} s={self.seq_len} "
                f"V={self.vocab}, {_count(self.params)} parameters")

    def to_dict(self) -> dict:
        """All fields and the parameter count, for ``--format json``."""
        return {**asdict(self), "params": self.params}


PRESETS: dict[str, ModelSpec] = {
    # shardwise's own reference GPT at its defaults (untied head, as in models/gpt.py).
    "gpt-tiny": ModelSpec(4, 128, 4, 128, 256, tied_embeddings=False, name="gpt-tiny"),
    # GPT-3 6.7B and 13B shapes (Brown et al. 2020, Table 2.1; 13B with 40 heads of 128).
    "7B": ModelSpec(32, 4096, 32, 2048, 50257, name="7B"),
    "13B": ModelSpec(40, 5120, 40, 2048, 50257, name="13B"),
    # Llama-2-70B: grouped-query attention (2.25 h^2 per layer) and a SwiGLU MLP of 28672
    # (10.5 h^2) hold as many parameters as 4 h^2 + 2 h f with f = 35840; untied head.
    "70B": ModelSpec(80, 8192, 64, 4096, 32000, ffn_hidden=35840, tied_embeddings=False,
                     name="70B"),
    # GPT-3 175B (Brown et al. 2020): 96 layers, width 12288, 96 heads, 2048 tokens.
    "175B": ModelSpec(96, 12288, 96, 2048, 50257, name="175B"),
}
"""Named models; the keys are matched case-insensitively."""

PUBLISHED: dict[str, tuple[str, str]] = {
    "175B": ("full", "Megatron-LM, Narayanan et al. 2021: t=8, p=16, d=8, full activation "
             "recomputation on 1024 A100s, 34 days for 300B tokens"),
}
"""Preset -> (recompute, the run) of a published training run, to flag where a plan differs."""


HEAD_DIM = 128
"""Head width of a shape derived from a bare parameter count (GPT-3 175B, Megatron 1T)."""
ASPECT = 128
"""Width per layer of a derived shape: GPT-3 175B has h / L = 12288 / 96 = 128."""


def shape_for(params: float, seq_len: int = 2048, vocab: int = 50257) -> ModelSpec:
    """A GPT-3-like shape holding about ``params`` parameters: width ``h`` a multiple of
    ``HEAD_DIM`` near ``(128 P / 12)^(1/3)`` (so that ``h / L`` is about ``ASPECT``, with
    ``P ~ 12 L h^2``; a multiple of 8 heads from 1024 on, so tp = 8 divides them), heads of
    ``HEAD_DIM``, then the layer count that comes closest to P."""
    if params < 1e6:
        raise PlanError("model", f"{params:.4g}", "is too small to derive a transformer shape",
                        "give at least 1M parameters, or the shape as L,H,A,S,V")
    ideal = (ASPECT * params / 12) ** (1 / 3)
    step = 8 * HEAD_DIM if ideal >= 8 * HEAD_DIM else HEAD_DIM   # heads divisible by tp = 8
    width = max(1, round(ideal / step)) * step
    probe = ModelSpec(1, width, width // HEAD_DIM, seq_len, vocab)
    layers = max(1, round((params - probe.embedding_params) / probe.layer_params))
    spec = ModelSpec(layers, width, width // HEAD_DIM, seq_len, vocab,
                     name=f"{_count(params)} (shape derived from the count)")
    if abs(spec.params / params - 1) > 0.2:
        raise PlanError("model", _count(params), f"is too few parameters for a GPT shape (its "
                        f"embeddings alone hold {_count(probe.embedding_params)})",
                        "give the shape as L,H,A,S,V")
    return spec


def parse_model(text: str) -> ModelSpec:
    """A preset name (``175B``, ``gpt-tiny``, ...), five integers ``L,H,A,S,V``, or a bare
    parameter count (``10T``, ``1.5e12``; shape from :func:`shape_for`)."""
    for key, spec in PRESETS.items():
        if key.lower() == text.strip().lower():
            return spec
    parts = text.split(",")
    if len(parts) == 5 and all(p.strip().isdigit() for p in parts):
        layers, hidden, heads, seq_len, vocab = (int(p) for p in parts)
        return ModelSpec(layers, hidden, heads, seq_len, vocab, name=text.replace(" ", ""))
    if len(parts) == 1 and re.fullmatch(r"\s*[0-9.]+(?:[eE][+-]?[0-9]+)?\s*[kKmMbBgGtT]?\s*",
                                        text):
        from shardwise.planner.units import parse_count

        return shape_for(parse_count(text, "model"))
    raise PlanError("model", text, "is neither a preset, L,H,A,S,V nor a parameter count",
                    f"use one of {', '.join(PRESETS)}, e.g. 24,2048,16,2048,50257, or a count "
                    "such as 10T or 1.5e12")


def _count(n: float) -> str:
    """174.6e9 / 6.74e9 / 875.3e3: the parameter count with a readable exponent."""
    for exp in (12, 9, 6, 3):
        if n >= 10 ** exp:
            return f"{n / 10 ** exp:.4g}e{exp}"
    return f"{n:.0f}"
