"""A small GPT: decoder-only transformer, pre-norm (architecture only; nothing distributed).

Shaped for splitting: ``tok_emb`` and ``pos_emb`` (the embedding), ``blocks`` (a ModuleList),
``ln_f`` and ``head`` (untied from the embedding) are separate attributes, so a pipeline stage can
keep a slice of blocks and tensor parallelism can swap ``attn.qkv`` / ``attn.proj`` / ``mlp.fc`` /
``mlp.proj`` for parallel linears. ``forward`` returns logits; the loss is the caller's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # q, k, v stacked on dim 0 of the weight. No bias: the key bias gets an exactly-zero
        # gradient (it adds the same q.b to every score of a row; softmax ignores that), and Adam
        # would turn its rounding noise into full-size updates that no two runs share.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)             # each (B, T, C_local)
        # n_head may be a tp-local count: derive the head size from the local width.
        hs = q.shape[-1] // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hs)   # (B, T, C_local)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections: std 0.02 / sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embedding: (B, T) int -> (B, T, C)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)                 # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))      # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N (weights) + 12 L C T (attention scores), PaLM's count."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all (B, T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


lm_loss.cross_entropy = True     # plain cross-entropy: tp runs it vocab-parallel (tensor_loss.py)
