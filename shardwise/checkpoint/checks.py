"""Checkpoint settings checked before any process starts (``shardwise train``; train() again in
each rank): each refusal is one ConfigError line naming the field, the value and the fix."""
from __future__ import annotations

from shardwise.checkpoint import store
from shardwise.config import Config, ConfigError, to_dict
from shardwise.config.writable import check_writable


def check(cfg: Config, world_size: int) -> store.Found | None:
    """Refuse what cannot save or resume; with ``--resume``, the checkpoint it will use
    (store.newest_intact: ``latest``'s, or the newest intact one when that is damaged)."""
    t = cfg.train
    if t.checkpoint_every < 0:
        raise ConfigError("train.checkpoint_every", t.checkpoint_every, "is negative",
                          "give a number of steps, or 0 (only at the end and on a stop)")
    if t.keep_checkpoints < 1:
        raise ConfigError("train.keep_checkpoints", t.keep_checkpoints, "keeps nothing",
                          "use --keep 1 or more")
    if not t.checkpoint_dir:
        for name, value in (("checkpoint_every", t.checkpoint_every), ("resume", t.resume),
                            ("checkpoint_async", t.checkpoint_async),
                            ("checkpoint_move_last", t.checkpoint_move_last)):
            if value:
                raise ConfigError(f"train.{name}", value, "needs a folder to save into or "
                                  "resume from", "add --checkpoint-dir DIR")
        return None
    check_writable(t.checkpoint_dir, "train.checkpoint_dir")
    if not t.resume:
        folder = store.latest(t.checkpoint_dir)
        if folder is not None:
            raise ConfigError("train.checkpoint_dir", t.checkpoint_dir, "holds a checkpoint "
                              f"already ({folder})", "add --resume to continue from it, or "
                              "give an empty folder")
        return None
    found = store.newest_intact(t.checkpoint_dir)
    if found.folder is None and found.damaged:
        raise ConfigError("train.resume", True, f"every checkpoint in {t.checkpoint_dir} is "
                          f"damaged: {found.note()}", "resume from a copy of the folder, or "
                          "drop --resume (and give an empty --checkpoint-dir) to start over")
    if found.folder is None:
        raise ConfigError("train.resume", True, f"there is no checkpoint in {t.checkpoint_dir} "
                          "(no 'latest' naming a complete step-N folder)",
                          "drop --resume to start from scratch, or point --checkpoint-dir at "
                          "a folder a run saved into")
    check_resumable(cfg, world_size, store.read_meta(found.folder), found.folder)
    return found


def check_resumable(cfg: Config, world_size: int, meta: dict, folder: str) -> None:
    """The checkpoint in ``folder`` loads into ``cfg``'s layout at ``world_size``: exactly (the
    same layout key) or resharded (both layouts have the layout-free optimizer state). Imports
    torch (through state / canonical) only here: a run without --resume starts without it."""
    from shardwise.checkpoint import canonical
    from shardwise.checkpoint.state import layout_key
    step = int(meta["step"])
    if step >= cfg.train.steps:
        raise ConfigError("train.steps", cfg.train.steps, f"the checkpoint {folder} is at step "
                          f"{step} already", f"give --steps above {step}")
    if meta["layout_key"] == layout_key(cfg, world_size):
        return
    saved = meta["config"]
    if saved["model"] != to_dict(cfg)["model"]:
        diff = sorted(k for k, v in saved["model"].items() if to_dict(cfg)["model"].get(k) != v)
        raise ConfigError(f"model.{diff[0]}", getattr(cfg.model, diff[0]), "differs from the "
                          f"checkpoint's ({saved['model'][diff[0]]!r})", "resume with the "
                          "model settings it was saved with")
    if saved["train"]["optimizer"] != cfg.train.optimizer:
        raise ConfigError("train.optimizer", cfg.train.optimizer, "differs from the "
                          f"checkpoint's ({saved['train']['optimizer']})",
                          f"use --optimizer {saved['train']['optimizer']}")
    where = f"{meta['layout']} at world {meta['world_size']}"
    why = None if meta.get("reshardable") else "it was saved without the layout-free " \
        "optimizer state (" + (canonical.why_not_reshardable(_as_config(saved)) or "?") + ")"
    why = why or canonical.why_not_reshardable(cfg)
    if why:
        raise ConfigError("train.resume", True, f"the checkpoint was saved by {where} and "
                          f"cannot be resharded into this layout: {why}", f"resume with the "
                          f"layout and world it was saved with ({where})")


def _as_config(saved: dict) -> Config:
    from shardwise.config import from_dict
    return from_dict(saved)
