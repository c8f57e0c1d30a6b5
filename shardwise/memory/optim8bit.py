"""8-bit AdamW: Adam's two moments stored block-wise quantised, one byte per value.

Reference: T. Dettmers, M. Lewis, S. Shleifer, L. Zettlemoyer, "8-bit Optimizers via Block-wise
Quantization", ICLR 2022. Written here in plain torch, so it runs on CPU and GPU alike.

Math. The update is torch's Adam, term for term (``torch.optim.adam._single_tensor_adam``)::

    g  <- g + wd p                 (decoupled=False: Adam's L2 term, as torch.optim.Adam)
    p  <- p (1 - lr wd)            (decoupled=True:  AdamW, as torch.optim.AdamW)
    m  <- lerp(m, g, 1 - b1)       v <- b2 v + (1 - b2) g^2
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Only the storage of m and v differs. A tensor's two states are flattened to rows of one (2, N)
state, ``codes`` (uint8: row 0 m, row 1 v), and cut into blocks of ``block_size`` values (the
last one partial); ``absmax`` (2, nb) fp32 holds each block's scale s, and a value reads
s * MAP[code]. m uses the signed dynamic map, v the unsigned one (``dynamic_map``): a code picks
a decade by its leading zeros and a linear fraction with the bits left, so small values keep
their relative precision over 7 decades. Block-wise scales keep one outlier from coarsening a
whole tensor's codes, and the block's absmax itself is exact (1 is a code).

Step, per chunk of ``CHUNK_ELEMENTS`` (a whole number of blocks): dequantise m and v to fp32,
update them with this step's gradient, update the parameter from these fresh fp32 moments (as
bitsandbytes does; so step 1 equals torch's bit for bit), then requantise: a new absmax per block,
the nearest code (what ``bucketize`` over the midpoints between neighbouring codes gives, found
by a table on the float's top 16 bits: ``_cell_tables``).

Memory per parameter value: 2 bytes of codes + 8 / block_size of scales (fp32 AdamW: 8), plus a
4-byte step per tensor: 2.004 bytes at block 2048, 25% of fp32. The transient is bounded by the
chunk, whatever the model size: ~40 bytes per chunk value (fp32 m and v, int64 gather indices,
gathered thresholds; 42 MB measured at 2^20 values). A 1-D flat buffer (a ZeRO shard) is just
another tensor: its states live in 8 bits too. Parameters must be contiguous (their flat view is
updated in place).

Error. With nearest codes, |x - s MAP[code]| <= s * gap / 2, where gap is the widest step between
neighbouring codes: 0.9 / 64 in the signed map, 0.9 / 128 in the unsigned (their top decades).

``make_adamw8bit`` (``--optimizer adamw8bit``) always returns this class, on every device, so the
state keys (``codes``, ``absmax``, ``step``) are the same everywhere: the memory report, ZeRO's
offload (which rebuilds the optimizer over CPU master views) and layout-free checkpoints read
them. bitsandbytes is never substituted (its states are ``state1`` / ``state2`` / ``qmap1``...,
fp32 below 4096 values, and its kernels need the parameters on CUDA): a user who wants it
passes ``bitsandbytes.optim.AdamW8bit`` as their own optimizer factory.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import torch

CHUNK_ELEMENTS = 1 << 20      # values updated at a time (rounded down to whole blocks, >= 1 block)
DECADES = 7                   # decades of magnitude spanned by the tree codes of both maps
CELLS = 1 << 16               # cells of floats: the values of a float32's top 16 bits
HIGH_HALF = 1 if sys.byteorder == "little" else 0   # which int16 of a float32 holds those bits
TINY = torch.finfo(torch.float32).tiny
MOMENTS = (True, False)       # state rows: m (exp_avg) in the signed map, v (exp_avg_sq) unsigned


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic tree map, sorted, unique: signed in [-1, 1], unsigned [0, 1].

    A code's bits after its sign bit read: e zeros (the exponent: scale 10^-e), one 1 (the
    indicator), then f fraction bits picking one of 2^f evenly spaced values in (0.1, 1]:
    0.1 + 0.9 k / 2^f, k = 1..2^f. Signed: 7 bits after the sign, e = 0..6, f = 6 - e, so 127
    magnitudes per sign from 1e-6 to 1. Unsigned (paper, section 2.2): the sign bit becomes one
    more fixed fraction bit, f = 7 - e, 254 magnitudes. All-zero bits give 0; the one pattern that
    would repeat it (-0 signed, zeros with the fixed bit set unsigned) is given 10^-7, one decade
    below the smallest tree value. Right-closed fractions put exactly 1 (and -1) in the map.
    """
    extra_bit = 0 if signed else 1
    decades = []
    for e in range(DECADES):
        f = DECADES - 1 - e + extra_bit
        k = torch.arange(1, 2**f + 1, dtype=torch.float64)
        decades.append(10.0**-e * (0.1 + 0.9 * k / 2**f))        # (2^f,) in (10^-(e+1), 10^-e]
    tree = torch.cat(decades)                                    # (127,) or (254,)
    parts = [-tree, tree] if signed else [tree]
    parts.append(torch.tensor([0.0, 10.0**-DECADES], dtype=torch.float64))
    return torch.sort(torch.cat(parts)).values.float()           # (256,)


@functools.lru_cache(maxsize=None)
def _cell_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell of floats: (the code just below its values (CELLS,) uint8, the midpoint above).

    Cell k holds the floats whose top 16 bits, read as a uint16, are k: an interval of one sign,
    one exponent and 7 mantissa bits. If no cell holds two midpoints (checked here: a cell spans
    at most 1/128 of its binade, finer than either map's step there), the nearest code of any x
    in a cell is below + (threshold < x): ``torch.bucketize(x, midpoints)`` by two gathers.
    """
    qmap = dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) / 2                                     # (255,)
    halves = torch.zeros(CELLS, 2, dtype=torch.int64)                     # (cell, int16 halves)
    halves[:, HIGH_HALF] = torch.arange(CELLS)
    first = halves.to(torch.uint16).view(torch.float32)[:, 0]             # low half 0
    halves[:, 1 - HIGH_HALF] = CELLS - 1
    last = halves.to(torch.uint16).view(torch.float32)[:, 0]              # low half all ones
    lower, upper = torch.minimum(first, last), torch.maximum(first, last)   # the cells' intervals
    below = torch.bucketize(lower, mids)                                  # (CELLS,) int64
    if ((torch.bucketize(upper, mids) - below)[~(lower.isnan() | upper.isnan())] > 1).any():
        raise AssertionError("a cell of floats holds two midpoints: the cells are too coarse")
    return below.to(torch.uint8), torch.cat([mids, torch.tensor([math.inf])])[below]


class _Codebook(NamedTuple):
    """The maps of R rows (row r uses signed[r]) on one device, one row of each table per row."""
    qmap: torch.Tensor          # (R, 256) fp32
    below: torch.Tensor         # (R, CELLS) uint8: the code just below each cell
    threshold: torch.Tensor     # (R, CELLS) fp32: the midpoint above ``below``, +inf at code 255
    zero_codes: torch.Tensor    # (R, 1) uint8: the code of 0


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device, signed: tuple[bool, ...]) -> _Codebook:
    """The maps and cell tables of rows using maps ``signed``, built once per device."""
    maps, tables = [dynamic_map(s) for s in signed], [_cell_tables(s) for s in signed]
    return _Codebook(torch.stack(maps).to(device),
                     torch.stack([t[0] for t in tables]).to(device),
                     torch.stack([t[1] for t in tables]).to(device),
                     torch.stack([(m == 0).nonzero()[0] for m in maps]).to(torch.uint8).to(device))


def nearest_codes(unit: torch.Tensor, signed: tuple[bool, ...], out: torch.Tensor | None = None):
    """Nearest codes (R, N) uint8 of ``unit`` (R, N) fp32 in [-1, 1], row r in map signed[r]."""
    book = _codebook(unit.device, tuple(signed))
    # each float's cell: its high uint16 (a view; a shift is a slow scalar loop on CPU)
    cell = unit.view(torch.uint16)[..., HIGH_HALF::2].long()              # (R, N)
    above = torch.gather(book.threshold, 1, cell) < unit                  # (R, N) bool
    return torch.add(torch.gather(book.below, 1, cell), above, out=out)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x (R, N) as blocks (R, nb, B), zeros after its end: a view if N <= B (one block of N) or
    N % B == 0, else a padded copy."""
    rows, n = x.shape
    if n <= block_size:
        return x.reshape(rows, 1, n)
    pad = -n % block_size
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(rows, -1, block_size)


def _unblocked(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """Blocks (R, nb, B) back to values (R, n): a view, without the padding."""
    return blocks.view(blocks.shape[0], -1).narrow(1, 0, n)


def quantize_blockwise(x: torch.Tensor, signed: tuple[bool, ...], block_size: int,
                       codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """x (R, N) fp32 into ``codes`` (R, N) uint8 and block scales ``absmax`` (R, nb) fp32."""
    blocks = _blocks(x, block_size)                                       # (R, nb, B)
    # an all-zero block gets the scale TINY, not 0: its values divide to 0 and code as 0
    torch.clamp_min(blocks.abs().amax(dim=2), TINY, out=absmax)           # (R, nb)
    unit = _unblocked(blocks / absmax.unsqueeze(2), x.shape[1])           # (R, N) in [-1, 1]
    nearest_codes(unit, signed, out=codes)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: tuple[bool, ...],
                         block_size: int) -> torch.Tensor:
    """fp32 values (R, N) of ``codes`` (R, N) uint8 under block scales ``absmax`` (R, nb)."""
    unit = torch.gather(_codebook(codes.device, tuple(signed)).qmap, 1, codes.long())  # (R, N)
    blocks = _blocks(unit, block_size).mul_(absmax.unsqueeze(2))          # (R, nb, B)
    return _unblocked(blocks, codes.shape[1])


def _span(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """t[..., start:end], a view: t itself when that is all of it (the common, one-chunk case)."""
    return t if start == 0 and end == t.shape[-1] else t.narrow(-1, start, end - start)


def _adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
          group: dict, step: float) -> None:
    """One Adam(W) step on fp32 chunks (n,), in place on p, m, v: torch's formula, term for term."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    if wd != 0:
        if group["decoupled"]:
            p.mul_(1 - lr * wd)
        else:
            g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias_correction1)


class AdamW8bit(torch.optim.Optimizer):
    """Adam(W) with block-wise 8-bit moments (see the module docstring for math and memory).

    decoupled=True is AdamW (torch.optim.AdamW's decay), False is Adam (torch.optim.Adam's L2
    term). lr, betas, eps, weight_decay, decoupled and block_size may differ per parameter group.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, block_size: int = 2048,
                 decoupled: bool = True):
        for name, ok in (("lr", lr >= 0), ("eps", eps >= 0), ("weight_decay", weight_decay >= 0),
                         ("betas", all(0 <= b < 1 for b in betas)),
                         ("block_size", isinstance(block_size, int) and block_size > 0)):
            if not ok:
                raise ValueError(f"AdamW8bit: {name}={locals()[name]!r} is out of range")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        block_size=block_size, decoupled=decoupled)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.is_complex() or not p.is_contiguous():
                    raise RuntimeError("AdamW8bit: parameters must be dense, real, contiguous")
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group["block_size"])
                # a new tensor, not +=: a loaded state dict's step is never written through
                state["step"] = state["step"] + 1
                self._update(p, state, group)
        return loss

    @staticmethod
    def _init_state(p: torch.Tensor, state: dict, block_size: int) -> None:
        """Zero moments: codes (2, N) at each map's 0, scales (2, nb) zero; a float32 step."""
        n, nb = p.numel(), math.ceil(p.numel() / block_size)
        state["step"] = torch.tensor(0.0)                        # as torch keeps it
        state["codes"] = _codebook(p.device, MOMENTS).zero_codes.expand(2, n).clone()
        state["absmax"] = torch.zeros(2, nb, dtype=torch.float32, device=p.device)

    @staticmethod
    def _update(p: torch.Tensor, state: dict, group: dict) -> None:
        """Dequantise, update in fp32 and requantise, a chunk of whole blocks at a time."""
        bs, step = group["block_size"], state["step"].item()
        flat_p, flat_g = p.view(-1), p.grad.reshape(-1)               # (N,) each
        chunk = max(1, CHUNK_ELEMENTS // bs) * bs
        for start in range(0, flat_p.numel(), chunk):
            end = min(start + chunk, flat_p.numel())
            codes = _span(state["codes"], start, end)                 # (2, n) uint8
            absmax = _span(state["absmax"], start // bs, math.ceil(end / bs))   # (2, nb) fp32
            moments = dequantize_blockwise(codes, absmax, MOMENTS, bs)   # (2, n) fp32: m, v
            p_chunk = _span(flat_p, start, end)                       # (n,) a view of p
            p32 = p_chunk if p.dtype == torch.float32 else p_chunk.float()
            _adam(p32, _span(flat_g, start, end).float(), *moments.unbind(), group, step)
            p_chunk.copy_(p32)                        # back in p's dtype (a no-op if p32 is it)
            quantize_blockwise(moments, MOMENTS, bs, codes, absmax)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the codes and scales put back as saved (uint8, fp32): the base casts
        every state tensor but the step to its parameter's dtype (codes 4x their size in fp32,
        scales rounded for bf16 parameters)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for key in ("codes", "absmax"):
                if key in saved.get(pid, {}):
                    self.state[p][key] = saved[pid][key].to(p.device, copy=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors in ``optimizer.state``: any torch optimizer, for comparisons."""
    return sum(t.numel() * t.element_size()
               for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


def _listed(group):
    """A parameter group with its ``params`` as a list (a bare tensor passes through)."""
    if not isinstance(group, dict):
        return group
    ps = group["params"]
    return dict(group, params=[ps] if torch.is_tensor(ps) else list(ps))


def make_adamw8bit(params, **kw) -> torch.optim.Optimizer:
    """``--optimizer adamw8bit``: shardwise's :class:`AdamW8bit` on every device (the module
    docstring says why bitsandbytes is never substituted)."""
    return AdamW8bit([_listed(g) for g in params], **kw)
