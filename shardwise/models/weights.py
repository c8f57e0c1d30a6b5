"""Reading a model's tensors from a safetensors checkpoint piece by piece (``--hf-weights DIR``).

The meta-device build (models/init.py) makes each rank's tensors from a *source*; this one reads
them from ``DIR/model.safetensors`` or the shards ``model.safetensors.index.json`` lists, with
``safe_open(path, "pt").get_slice(key)[rows]``, so a rank reads only what it keeps:

  * a tensor kept whole: the tensor (every rank of a replicated layout reads all of them);
  * a tp slice (a :class:`~shardwise.models.init.Piece`): only its row / column ranges;
  * a ZeRO-3 shard's element range of a tensor: only the rows holding those elements (a shard
    crossing a tensor's boundary reads the boundary rows whole, never the rest of the tensor);
  * a piece of any other shape (a slice of a slice): the tensor, then the piece cut from it.

No rank holds the whole model or even a whole unit of it: memory is the pieces kept plus one
tensor's read at a time. Names: the checkpoint's keys map onto the model's as ``load_weights``
maps them (models/hf.py ``_plan``: as saved, or without the model's prefix; a weight tied to a
loaded one, GPT-2's ``lm_head.weight``, may be absent and stays tied; a missing or wrongly
shaped weight is one line, before anything is read); keys the model lacks are ignored, as
``from_pretrained`` ignores them. Values take the model's dtype (a bf16 file into an fp32 model).

Bytes read by this process are counted (:func:`bytes_read`): the tests check that each rank of
a world reads about its share of the checkpoint.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from shardwise.models.hf import _plan, weight_files
from shardwise.models.init import Piece

_READ = {"bytes": 0}    # this process's bytes read from safetensors files (for tests and logs)


def bytes_read() -> int:
    """Bytes this process has read from checkpoint files through a source so far."""
    return _READ["bytes"]


def _counted(t: torch.Tensor) -> torch.Tensor:
    _READ["bytes"] += t.numel() * t.element_size()
    return t


def _along(dim: int, start: int, end: int) -> tuple:
    """The index of rows ``start:end`` along ``dim`` (get_slice takes one slice per dim)."""
    return (slice(None),) * dim + (slice(start, end),)


class SafetensorsSource:
    """The tensors of a safetensors checkpoint, by the model's names, read in pieces."""

    def __init__(self, model: nn.Module, folder: str):
        """``model`` as built (meta device, before shardwise wraps anything): its names and
        shapes are checked against the files' headers (only the headers are read)."""
        from safetensors import safe_open
        self.file_of, shapes = {}, {}
        for path in weight_files(folder):
            with safe_open(path, "pt") as fh:
                for k in fh.keys():
                    self.file_of[k] = path
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
        mapping = _plan(model, folder, shapes)           # file key -> model key; refuses gaps
        self.keys = {ours: k for k, ours in mapping.items()}
        self.shapes = {ours: shapes[k] for k, ours in mapping.items()}
        self._open: dict[str, object] = {}

    def holds(self, name: str) -> bool:
        return name in self.keys

    def _file(self, name: str):
        from safetensors import safe_open
        path = self.file_of[self.keys[name]]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path]

    def close(self) -> None:
        """Drop the open files (memory-mapped: pages read stay resident while one is open);
        a later read opens them again."""
        self._open.clear()

    def _whole(self, name: str) -> torch.Tensor:
        return _counted(self._file(name).get_tensor(self.keys[name]))

    def read(self, name: str, piece, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` (``piece`` of it when given), in ``dtype``: a new CPU tensor."""
        if isinstance(piece, Piece):
            sl = self._file(name).get_slice(self.keys[name])
            parts = [_counted(sl[_along(piece.dim, a, b)]) for a, b in piece.ranges]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, piece.dim)
        else:
            t = self._whole(name)
            t = t if piece is None else piece(t)
        return t.to(dtype).contiguous()

    def read_flat(self, name: str, piece, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``lo:hi`` of tensor ``name`` (or of ``piece`` of it) flattened, reading only
        the rows (along dim 0) that hold them when there is no piece."""
        shape = self.shapes[name]
        if piece is not None or not shape:
            return self.read(name, piece, dtype).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        sl = self._file(name).get_slice(self.keys[name])
        rows = _counted(sl[first:last]).reshape(-1)
        return rows[lo - first * row:hi - first * row].to(dtype)


def source_for(model: nn.Module, model_cfg) -> SafetensorsSource | None:
    """The checkpoint source of a meta-built model: ``--hf-weights`` for an ``hf:*`` model."""
    from shardwise.models import hf
    if hf.is_hf(model_cfg.name) and model_cfg.hf_weights:
        return SafetensorsSource(model, model_cfg.hf_weights)
    return None
