"""``shardwise checkpoint inspect D`` and ``shardwise checkpoint export D OUT``.

Both read one process alone (no world): D is a checkpoint folder (``step-N/``) or a
``--checkpoint-dir`` (then the checkpoint its ``latest`` names). Export writes the plain
model's state dict (every name ``model.state_dict()`` of a fresh model of the saved config has,
tied names included, in the model's dtype) with safetensors, streamed a bounded group of
tensors at a time (export.py), so that ``model.load_state_dict(safetensors.torch.load_file(
path))`` loads it into a fresh model built from the same config
(``shardwise.models.build_model``), and an hf:* model's export folder loads with
``transformers.AutoModelForCausalLM.from_pretrained(OUT)``.
"""
from __future__ import annotations

import functools
import os

import torch

from shardwise.checkpoint import canonical, dcp_io, store
from shardwise.checkpoint import export as export_io
from shardwise.config import ConfigError, from_dict


def find(path: str) -> str:
    """The checkpoint folder ``path`` names (itself, or its ``latest``); ConfigError if none."""
    folder = store.resolve(path)
    if folder is None:
        raise ConfigError("checkpoint", path, "holds no checkpoint (no meta.json, no 'latest' "
                          "naming a complete step-N folder)", "give a --checkpoint-dir a run "
                          "saved into, or one of its step-N folders")
    why = store.damage(folder)
    if why is not None:
        other = store.newest_intact(os.path.dirname(folder)).folder
        raise ConfigError("checkpoint", folder, f"is damaged: {why}",
                          f"use {other}, the newest intact one" if other else
                          "restore the folder from a copy")
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


def export(path: str, out: str, max_shard_size: str | int = export_io.DEFAULT_MAX_SHARD) -> dict:
    """Write the plain model of the checkpoint at ``path`` to ``out``, streamed (export.py): a
    folder in the Hugging Face layout (one model.safetensors, or shards of at most
    ``max_shard_size`` plus model.safetensors.index.json; config.json for an hf:* model), or
    one file when ``out`` ends in .safetensors. Returns {"tensors": {name: shape}, "files":
    [the files written]}. Every name of the plain model's state dict is written, tied names
    included (each read from the one stored tensor)."""
    folder = find(path)
    meta = store.read_meta(folder)
    cfg = from_dict(meta["config"])
    if cfg.memory.lora_rank > 0:
        raise ConfigError("checkpoint", path, "was saved with LoRA adapters, which the plain "
                          "model does not have", "merge them first (memory.lora.merge_lora)")
    budget = export_io.parse_size(max_shard_size) if isinstance(max_shard_size, str) \
        else int(max_shard_size)
    from shardwise.models import build_model
    with torch.device("meta"):                     # names, shapes, dtypes: no memory
        model = build_model(cfg.model, cfg.train.seed, init="meta")
    stored = {k[len(canonical.MODEL):]: v for k, v in dcp_io.stored(folder).items()
              if v is not None and k.startswith(canonical.MODEL)}
    specs = plain_specs(model, stored)
    written = export_io.write(out, specs, functools.partial(_read_model, folder, stored),
                              budget, {"step": str(meta["step"])}, _hf_files(cfg, specs))
    return {"tensors": {s.name: list(s.shape) for s in specs}, "files": written}


def plain_specs(model: torch.nn.Module, stored: dict) -> list[export_io.Spec]:
    """The export's tensors: every name of ``model``'s state dict (built on the meta device) in
    its order, read from the stored key of that name or, for a tied name, of the name it is
    tied to; written in the model's dtype. Raises KeyError / ValueError naming a missing name
    or a shape that differs (canonical.plain_state_dict's rules, without the tensors)."""
    alias, seen = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), name)
        alias[name] = seen[id(p)]
    specs = []
    for name, ref in model.state_dict(keep_vars=True).items():
        key = name if name in stored else alias.get(name, name)
        if key not in stored:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        if tuple(stored[key][0]) != tuple(ref.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(stored[key][0])} vs model "
                             f"{tuple(ref.shape)}")
        specs.append(export_io.Spec(name, key, tuple(ref.shape), ref.dtype))
    return specs


def _read_model(folder: str, stored: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``keys`` (canonical names), read from the checkpoint alone."""
    got = dcp_io.read_keys(folder, {canonical.MODEL + k: stored[k] for k in keys})
    return {k[len(canonical.MODEL):]: t for k, t in got.items()}


def _hf_files(cfg, specs: list[export_io.Spec]) -> dict[str, str]:
    """{"config.json": text} for an hf:* model (its transformers config, so that
    ``AutoModelForCausalLM.from_pretrained(OUT)`` builds it), else {}."""
    from shardwise.models import hf
    if not hf.is_hf(cfg.model.name):
        return {}
    config = hf.hf_config(cfg.model)
    config.use_cache = True                 # training turns the cache off; inference wants it
    config.architectures = ["GPT2LMHeadModel" if hf.FAMILIES[cfg.model.name] == "gpt2"
                            else "LlamaForCausalLM"]
    dtype = specs[0].dtype if specs else torch.float32
    config.torch_dtype = str(dtype).replace("torch.", "")
    return {"config.json": config.to_json_string()}
