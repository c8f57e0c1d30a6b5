"""Batches of several inputs: a tensor, a tuple of tensors, or a dict of tensors.

A model's forward may take one tensor (``model(x)``), several positional inputs
(``model(input_ids, attention_mask)``: the batch is a tuple) or keyword arguments
(``model(input_ids=..., attention_mask=..., labels=...)``: the batch is a dict). Every tensor of
a batch has the batch dimension first; these helpers cut all of them along it together, move
them to a device and call the model with them. Entries that are not tensors (a flag, None) are
passed to every piece unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def _leaves(batch) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _leaves(v)]
    return []


def _map(fn, batch):
    """``batch`` with ``fn`` applied to every tensor, the structure kept."""
    if torch.is_tensor(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: _map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(fn, v) for v in batch)
    return batch


def check(batch, what: str = "batch") -> None:
    """Refuse a batch with no tensor, or tensors that disagree on the batch dimension."""
    if batch is None:
        return
    leaves = _leaves(batch)
    if not leaves:
        raise TypeError(f"the {what} holds no tensor ({type(batch).__name__}); fix: pass a "
                        "tensor, a tuple of tensors (positional inputs) or a dict of tensors "
                        "(keyword arguments to forward)")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"the tensors of the {what} disagree on the batch dimension (first "
                         f"sizes {sorted(map(str, sizes))}); fix: give every input the batch's "
                         "rows first, e.g. input_ids and attention_mask both (B, T)")


def rows(batch) -> int:
    """The batch's number of rows (the first dimension of its tensors)."""
    return _leaves(batch)[0].shape[0]


def take(batch, index):
    """Rows ``index`` (a slice or index tensor) of every tensor in ``batch``."""
    return _map(lambda t: t[index], batch)


def chunk(batch, n: int) -> list:
    """``batch`` cut into ``n`` micro-batches along the rows (as ``tensor.chunk(n)``); None
    stays None in every piece."""
    if batch is None:
        return [None] * n
    total = rows(batch)
    per = -(-total // n)                       # tensor.chunk's sizes: ceil, last one shorter
    return [take(batch, slice(i, min(i + per, total))) for i in range(0, total, per)]


def to(batch, device):
    """Every tensor of ``batch`` moved to ``device``."""
    return _map(lambda t: t.to(device), batch)


def call(fn, batch):
    """``fn(batch)`` for a tensor, ``fn(*batch)`` for a tuple / list, ``fn(**batch)`` for a
    dict: the model's forward with the batch's inputs."""
    if isinstance(batch, Mapping):
        return fn(**batch)
    if isinstance(batch, (tuple, list)):
        return fn(*batch)
    return fn(batch)


def read_loss(out, key):
    """The model's own loss in its output: ``out[key]`` of a dict / ModelOutput (``key`` a
    name such as "loss"), item ``key`` of a tuple (an int); a scalar, cast to fp32."""
    if isinstance(out, Mapping):
        loss = out.get(key) if isinstance(key, str) else None
    elif isinstance(out, (tuple, list)) and isinstance(key, int) and -len(out) <= key < len(out):
        loss = out[key]
    else:
        loss = None
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise TypeError(f"loss_from={key!r}: the model's output ({type(out).__name__}) holds no "
                        f"scalar loss there; fix: pass the labels the model needs to compute its "
                        "loss in the batch (e.g. batch['labels']), or use loss_fn instead")
    return loss.float()


def loss_from(key):
    """A loss function ``(output, target) -> loss`` that takes the model's own loss from its
    output (``read_loss``); the target must be None: the labels travel in the batch."""
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise TypeError(f"loss_from={key!r}: give the output's key (a str such as 'loss') or a "
                        "tuple index (an int)")

    def loss_fn(out, target):
        if target is not None:
            raise ValueError(f"loss_from={key!r} takes the model's own loss, so a separate "
                             "target would be ignored; fix: put the labels in the batch "
                             "(batch['labels']) and call train_step(batch) without y")
        return read_loss(out, key)
    loss_fn.loss_from = key
    return loss_fn
