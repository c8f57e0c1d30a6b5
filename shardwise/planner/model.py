"""The model being planned: a decoder described by five numbers and a few architecture flags.

Parameter count (biases and layer norms included, as in ``shardwise.models.gpt``):
per layer ``4h^2 + 2hf + 9h + f`` (qkv 3h^2+3h, projection h^2+h, MLP h*f+f and f*h+h, two layer
norms 4h), which is ``12h^2 + 13h`` for the usual ``f = 4h``; plus the token embedding ``V h``,
the position embedding ``S h``, the final layer norm ``2h``, and an output head ``V h`` unless
it is tied to the token embedding.

Llama-style decoders (Touvron et al. 2023; Hugging Face's ``LlamaForCausalLM``) set three flags:
``kv_heads`` (grouped-query attention: keys and values of ``kv_heads`` heads, ``2 h kv`` weights
with ``kv = kv_heads * h / a``), ``gated_mlp`` (SwiGLU: gate, up and down matrices of width f,
``3 h f``) and ``biases=False`` (no linear biases, RMSNorm with a weight only), and drop the
position table (``learned_positions=False``: rotary). Per layer that is
``2h^2 + 2h kv + 3hf + 2h``; HF Llama 8 x 512 (f = 1376, V = 256) holds 25,567,744.

``block_tensors`` lists one block's parameter tensors in registration order (the order the
data-parallel bucket planner and ZeRO-3's units see them: planner/buffers.py): GPT-2's fused
qkv with the norms first, or, with a gated MLP, Llama's separate q, k, v and its norms last.
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
    kv_heads: int = 0
    """Key/value heads (grouped-query attention; must divide ``heads``); 0 means ``heads``."""
    gated_mlp: bool = False
    """SwiGLU MLP (Llama): gate, up and down matrices of width ``ffn_hidden`` (then the real
    width, not the 1.5x-equivalent of the 70B preset)."""
    biases: bool = True
    """Linear layers carry biases and norms a bias (LayerNorm); False: none, RMSNorm (Llama)."""
    learned_positions: bool = True
    """A learned position table (S h parameters); False: rotary embeddings (no parameters)."""
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
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise PlanError("model", f"heads={self.heads}, kv_heads={self.kv_heads}",
                            "has key/value heads that do not divide the heads",
                            "pick kv_heads dividing heads (0: as many as heads)")

    @property
    def ffn(self) -> int:
        """The MLP's inner width f (4h unless set)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): ``kv_heads * h / a`` (h without GQA)."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def norm_params(self) -> int:
        """One norm: weight and bias (LayerNorm, 2h) or weight only (RMSNorm, h)."""
        return 2 * self.hidden if self.biases else self.hidden

    def block_tensors(self) -> list[int]:
        """Element counts of one block's parameter tensors in registration order (module
        docstring); they sum to ``layer_params``."""
        h, f, kv, b = self.hidden, self.ffn, self.kv_width, self.biases
        norm = [h, h] if b else [h]
        if self.gated_mlp:       # Llama: q, k, v, o, gate, up, down, then the two norms
            attn = [h * h, h * kv, h * kv, h * h] + ([h, kv, kv, h] if b else [])
            mlp = [h * f, h * f, f * h] + ([f, f, h] if b else [])
            return attn + mlp + norm + norm
        attn = [h * (h + 2 * kv)] + ([h + 2 * kv] if b else []) + [h * h] + ([h] if b else [])
        mlp = [h * f] + ([f] if b else []) + [f * h] + ([h] if b else [])
        return norm + attn + norm + mlp

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block: 4h^2 + 2hf + 9h + f (module docstring for
        grouped-query attention, a gated MLP and no biases)."""
        return sum(self.block_tensors())

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings: V h + S h (no S h with rotary positions)."""
        return (self.vocab + (self.seq_len if self.learned_positions else 0)) * self.hidden

    @property
    def head_params(self) -> int:
        """Final layer norm, plus the output head when untied: 2h (+ V h)."""
        return self.norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

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
