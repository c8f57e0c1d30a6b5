"""A small GPT: decoder-only transformer, pre-norm (architecture only; nothing distributed).

Shaped for splitting: ``tok_emb`` and ``pos_emb`` (the embedding), ``blocks`` (a ModuleList),
``ln_f`` and ``head`` (untied from the embedding) are separate attributes, so a pipeline stage can
keep a slice of blocks and tensor parallelism can swap ``attn.qkv`` / ``attn.proj`` / ``mlp.fc`` /
``mlp.proj`` for parallel linears. ``forward`` returns logits; the loss is the caller's.

Decoding: ``forward(idx, cache=KVCache(...))`` feeds only the new tokens and keeps every block's
keys and values for the next call (positions continue from ``cache.length``); without a cache
(training, the default) nothing changes. The cache holds at most ``block_size`` positions (the
learned position table's length): a longer sequence is the caller's to cut (shardwise/models/
decode.py recomputes the window then, as the no-cache path does).
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


class KVCache:
    """Every block's keys and values for the first ``length`` positions of a batch, in buffers
    of ``capacity`` positions allocated on first use (the shape, dtype and device of the first
    keys written: a tp-local head count works unchanged). ``GPT.forward`` advances ``length``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0                          # positions stored, the same for every block
        self.keys: dict[int, torch.Tensor] = {}  # block index -> (B, h, capacity, hs)
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self, i)


class LayerKV:
    """One block's view of a KVCache: ``update`` stores its new keys / values after the
    ``start`` positions already held and returns all of them."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index, self.start = cache, index, cache.length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, end = self.cache, self.start + k.shape[2]            # k, v: (B, h, T, hs)
        if self.index not in c.keys:
            shape = (*k.shape[:2], c.capacity, k.shape[3])
            c.keys[self.index] = k.new_empty(shape)
            c.values[self.index] = v.new_empty(shape)
        K, V = c.keys[self.index], c.values[self.index]
        K[:, :, self.start:end] = k
        V[:, :, self.start:end] = v
        return K[:, :, :end], V[:, :, :end]                    # (B, h, start + T, hs)


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
        # attend(q, k, v) -> y, all (B, h, T, hs), causal: None = torch's kernel; context
        # parallelism sets its ring or Ulysses attention here (parallel/context.py)
        self.attend = None

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)             # each (B, T, C_local)
        # n_head may be a tp-local count: derive the head size from the local width.
        hs = q.shape[-1] // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
        p = self.dropout if self.training else 0.0
        if kv is None and self.attend is not None:
            y = self.attend(q, k, v)
        elif kv is None or kv.start == 0:        # no cache, or its first call: plain causal
            if kv is not None:
                kv.update(k, v)                  # attend to k, v themselves: the same kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:                                    # query t sits at position start + t
            K, V = kv.update(k, v)               # (B, h, start + T, hs)
            mask = None if T == 1 else torch.ones(T, K.shape[2], dtype=torch.bool,
                                                  device=x.device).tril(kv.start)
            y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, dropout_p=p)
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

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        """``kv``: this block's view of a KVCache when decoding (None: training)."""
        x = x + self.drop(self.attn(self.ln_1(x), kv))
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
        for name, m in self.named_modules():   # build_model re-runs this per unit, seeded
            init_module(m, name, cfg.n_layer)

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token + position embedding at positions start.. : (B, T) int -> (B, T, C)."""
        T = idx.shape[1]
        pos = torch.arange(start, start + T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) of ``idx``; with ``cache``, ``idx`` follows the ``cache.length``
        tokens it holds (their keys and values are read, the new ones stored)."""
        if cache is None:
            x = self.embed(idx)             # (B, T, C)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))  # (B, T, vocab)
        start, end = cache.length, cache.length + idx.shape[1]
        room = min(cache.capacity, self.cfg.block_size)
        if end > room:
            raise ValueError(f"the KV cache holds {room} positions, {end} asked: recompute "
                             "the last block_size tokens without the cache instead")
        x = self.embed(idx, start)          # (B, T, C), positions start..end-1
        for i, block in enumerate(self.blocks):
            x = block(x, cache.layer(i))
        cache.length = end
        return self.head(self.ln_f(x))      # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N (weights) + 12 L C T (attention scores), PaLM's count."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size


def init_module(m: nn.Module, name: str, n_layer: int) -> None:
    """Our GPT's initialiser for one module's own tensors (models/init.py runs it per module,
    each on a generator seeded from the run's seed and ``name``): linear and embedding weights
    N(0, 0.02), GPT-2's scaled N(0, 0.02 / sqrt(2 n_layer)) for the residual projections
    (``attn.proj``, ``mlp.proj``), biases 0, layer norms 1 / 0."""
    if isinstance(m, nn.Linear):
        scaled = name.endswith("proj")
        nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * n_layer) if scaled else 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.LayerNorm):
        m.reset_parameters()


def initialises(m: nn.Module) -> bool:
    """Whether :func:`init_module` sets ``m``'s own tensors."""
    return isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all (B, T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


lm_loss.cross_entropy = True     # plain cross-entropy: tp runs it vocab-parallel (tensor_loss.py)
