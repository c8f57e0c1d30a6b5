"""A checkpoint written a piece at a time: the layout-free tensors from each rank's own shards.

Disk offload keeps a ZeRO rank's masters and optimizer states in files, so the state may be
larger than RAM; gathering it whole for a save (canonical.py's forms) cannot work there. Such a
layout (``strategy.checkpoint_parts()``, parallel/data/zero_state.py) hands over, per
parameter, the flat range [lo, hi) of its elements this rank holds; a range of a row-major
tensor is a few rectangular boxes (:func:`boxes`), and each box is one chunk of the
layout-free key (``model/<name>``, ``optim/<name>/<state>``) in the DCP checkpoint, written by
the rank that holds it (dcp_io.save with ``pieces``). Readers see the usual whole tensors: DCP
assembles a key from its chunks (export, inspect, a reshard), so the format is canonical.py's;
an exact resume reads each rank's own boxes back into its files (dcp_io.load_pieces). Memory
while saving or loading: one box (at most one parameter) at a time; the files' pages are
dropped again after each box.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwise.checkpoint import canonical


@dataclass(frozen=True, eq=False)
class Piece:
    """One box of one layout-free tensor: DCP key, the whole tensor's shape, where the box
    starts in it, its values (a view shaped like the box) and the store tensor they live in."""
    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor
    owner: torch.Tensor | None = None


def boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat elements [lo, hi) of a row-major tensor of ``shape`` as rectangular boxes:
    (offsets, sizes, flat start) each, in order, covering the range exactly."""
    shape = tuple(int(s) for s in shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo)]
    row = math.prod(shape[1:])
    if row == 0:
        return []
    first, last = lo // row, (hi - 1) // row
    if first == last:       # inside one row: a box of that row's sub-tensor
        return [((first, *o), (1, *s), first * row + f)
                for o, s, f in boxes(shape[1:], lo - first * row, hi - first * row)]
    out = []
    if lo % row:            # the partial first row
        out += boxes(shape, lo, (first + 1) * row)
        first += 1
    end = last + 1 if hi % row == 0 else last
    if end > first:         # whole rows
        out.append(((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:]), first * row))
    if hi % row:            # the partial last row
        out += boxes(shape, last * row, hi)
    return out


def _split(key: str, shape, lo: int, hi: int, values: torch.Tensor, owner) -> list[Piece]:
    return [Piece(key, tuple(int(s) for s in shape), offsets,
                  values[start - lo:start - lo + math.prod(sizes)].view(sizes), owner)
            for offsets, sizes, start in boxes(shape, lo, hi)]


def of_parts(parts: dict) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    """(the pieces, the whole tensors) of a strategy's ``checkpoint_parts()`` under the
    layout-free keys (canonical.MODEL, canonical.OPTIM)."""
    pieces = []
    for name, shape, lo, hi, values, owner in parts["model"]:
        pieces += _split(canonical.MODEL + name, shape, lo, hi, values, owner)
    for name, key, shape, lo, hi, values, owner in parts["optim"]:
        pieces += _split(f"{canonical.OPTIM}{name}/{key}", shape, lo, hi, values, owner)
    whole = {canonical.MODEL + n: t for n, t in parts["model_whole"].items()}
    whole.update(canonical.flat_optimizer(parts["optim_whole"]))
    return pieces, whole

