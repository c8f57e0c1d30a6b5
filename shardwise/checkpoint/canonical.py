"""The layout-free form of a checkpoint: what any layout can load (reshard) and export reads.

    model/<name>               the plain model's tensors by their state-dict names (parameters
                               in fp32 as the masters hold them, buffers), whole
    optim/<name>/<state>       the optimizer's per-parameter state by the same names, whole
                               (Adam: exp_avg, exp_avg_sq, step)

Saving gathers per parameter (``strategy.full_state_dict()`` and
``strategy.canonical_optimizer_state()``): every rank ends up holding the whole model and the
whole optimizer state on CPU for the save (about 3x the fp32 parameter bytes for Adam, on each
rank, freed after the save), and DCP writes each key once (the ranks' values are equal). ZeRO
with disk offload writes the same keys without gathering: each rank its own boxes of them
(pieces.py).
Loading (another layout): every rank reads the model tensors into the plain model before
``prepare`` (every layout starts from global rank 0's weights and shards them itself), then
the optimizer tensors, and ``strategy.load_canonical_optimizer_state`` keeps this rank's piece.

Layouts whose optimizer state has this form: single, dp (replica 0's; every replica loads it),
ddp, zero1-3, tp, the pipeline (pp and 3d: its stages' states merged over pp, parallel/pipeline/
driver.py) and the parameter server (its ps tasks' states merged over the world,
parallel/ps.py), with Adam, AdamW or SGD (:func:`why_not_reshardable`). 8-bit AdamW (moments
quantised in blocks of the flat shard: a reshard would re-block them) and LoRA (the adapters are
injected inside ``prepare``, after the plain model is loaded) keep their own layouts: their
checkpoints resume exactly in the same layout, and export, but do not reshard.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.config import Config

MODEL, OPTIM = "model/", "optim/"


def why_not_reshardable(cfg: Config) -> str | None:
    """None when ``cfg``'s layout saves (and loads) the layout-free optimizer state; else why."""
    if cfg.train.optimizer == "adamw8bit":
        return "8-bit AdamW's moments are quantised in blocks of the flat shard"
    if cfg.memory.lora_rank > 0:
        return "LoRA adapters are not part of the plain model"
    return None


def model_state(strategy, comm, mesh) -> dict[str, torch.Tensor]:
    """Every parameter (whole, by original name) and buffer of the model, on CPU (collectives:
    whatever full_state_dict needs; a pipeline's buffers are merged over pp)."""
    out = dict(strategy.full_state_dict())
    model = strategy.model
    if model is None:
        return out
    rename = getattr(model, "global_name", None) if mesh.pp > 1 else None
    buffers = {(rename(n) if rename else n): b.detach().cpu().clone()
               for n, b in model.named_buffers()}
    if rename is not None:
        merged = {}
        for part in comm.all_gather_object(buffers, mesh.pp_group):
            merged.update(part)
        buffers = merged
    out.update(buffers)
    return out


def flat_optimizer(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: {state: tensor}} as DCP keys ``optim/<name>/<state>``."""
    return {f"{OPTIM}{name}/{key}": v for name, entry in state.items() for key, v in entry.items()}


def nested_optimizer(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of :func:`flat_optimizer` (keys without the ``optim/`` prefix)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        name, state = key.rsplit("/", 1)
        out.setdefault(name, {})[state] = v
    return out


def plain_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """The plain ``model``'s full state dict from canonical tensors: tied names (a tensor under
    two names, such as a shared embedding and head) take the one name stored; raises KeyError
    naming what is missing, ValueError naming a shape that differs."""
    alias = {}
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), name)
        alias[name] = seen[id(p)]
    out = {}
    for name, ref in model.state_dict().items():
        key = name if name in tensors else alias.get(name, name)
        if key not in tensors:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} vs model "
                             f"{tuple(ref.shape)}")
        out[name] = t.to(ref.dtype)
    return out


@torch.no_grad()
def load_model(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy canonical tensors into the plain model (before ``prepare``)."""
    model.load_state_dict(plain_state_dict(model, tensors))
