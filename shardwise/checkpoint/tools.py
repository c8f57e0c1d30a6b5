"""``shardwise checkpoint inspect D`` and ``shardwise checkpoint export D --out model.safetensors``.

Both read one process alone (no world): D is a checkpoint folder (``step-N/``) or a
``--checkpoint-dir`` (then the checkpoint its ``latest`` names). Export writes the plain
model's state dict (every name ``model.state_dict()`` of a fresh model of the saved config has,
tied names included, in the model's dtype) with safetensors, so that
``model.load_state_dict(safetensors.torch.load_file(path))`` loads it into a fresh model
built from the same config (``shardwise.models.build_model``).
"""
from __future__ import annotations

import os

import torch

from shardwise.checkpoint import canonical, dcp_io, store
from shardwise.config import ConfigError, from_dict


def find(path: str) -> str:
    """The checkpoint folder ``path`` names (itself, or its ``latest``); ConfigError if none."""
    folder = store.resolve(path)
    if folder is None:
        raise ConfigError("checkpoint", path, "holds no checkpoint (no meta.json, no 'latest' "
                          "naming a complete step-N folder)", "give a --checkpoint-dir a run "
                          "saved into, or one of its step-N folders")
    return folder


def inspect(path: str) -> dict:
    """What a checkpoint holds: step, layout, world, sizes, the stored keys, the config."""
    folder = find(path)
    meta = store.read_meta(folder)
    keys = dcp_io.stored(folder)
    model = {k[len(canonical.MODEL):]: list(v[0]) for k, v in keys.items()
             if v is not None and k.startswith(canonical.MODEL)}
    return {"folder": folder, "step": meta["step"], "layout": meta["layout"],
            "strategy": meta["strategy"], "world_size": meta["world_size"],
            "reshardable": meta["reshardable"], "parameters": meta["parameters"],
            "bytes": store.folder_bytes(folder),
            "rank_states": sum(1 for k in keys if k.startswith("rank")),
            "optimizer_tensors": sum(1 for k in keys if k.startswith(canonical.OPTIM)),
            "model": model, "config": meta["config"],
            "kept": [store.step_name(s) for s in store.steps(os.path.dirname(folder))]}


def describe(info: dict) -> str:
    """The lines ``shardwise checkpoint inspect`` prints."""
    cfg = info["config"]
    lines = [f"checkpoint {info['folder']}",
             f"  step        {info['step']} of {cfg['train']['steps']}",
             f"  layout      {info['layout']} (strategy {info['strategy']}), world "
             f"{info['world_size']}",
             f"  reshard     {'yes: loads into any resharding layout' if info['reshardable'] else 'no: resumes in this layout and world only'}",
             f"  size        {info['bytes']:,} bytes on disk; {info['parameters']:,} model "
             f"elements in {len(info['model'])} tensors; {info['optimizer_tensors']} optimizer "
             f"tensors; {info['rank_states']} rank states",
             f"  model       {cfg['model']}",
             f"  train       optimizer {cfg['train']['optimizer']}, lr {cfg['train']['lr']}, "
             f"batch {cfg['train']['batch_size']}, seed {cfg['train']['seed']}",
             f"  kept        {', '.join(info['kept'])}"]
    return "\n".join(lines)


def export(path: str, out: str) -> dict:
    """Write the plain model's state dict of the checkpoint at ``path`` to ``out``
    (safetensors); returns {name: shape}. Tied tensors are written once per name (cloned:
    safetensors refuses shared storage)."""
    from safetensors.torch import save_file
    from shardwise.models import build_model
    folder = find(path)
    cfg = from_dict(store.read_meta(folder)["config"])
    if cfg.memory.lora_rank > 0:
        raise ConfigError("checkpoint", path, "was saved with LoRA adapters, which the plain "
                          "model does not have", "merge them first (memory.lora.merge_lora)")
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed)
    tensors = dcp_io.read_tensors(folder, canonical.MODEL)
    state = canonical.plain_state_dict(model, tensors)
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file(state, out, metadata={"format": "pt", "step": str(store.read_meta(folder)["step"])})
    return {k: list(v.shape) for k, v in state.items()}
