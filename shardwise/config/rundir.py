"""The run directory: one folder per run, named once, never written over.

``<logging.out_dir>/<logging.run_name>`` holds everything a run leaves: ``config.json`` (the
resolved config, written before the first step), ``metrics.jsonl`` (and ``metrics.csv``,
``tensorboard/`` when asked), ``summary.json`` at the end, pictures, ``launcher.log`` after a
stop. The name is fixed once, before any rank starts, so every rank and picture uses the same
folder:

* no ``--run-name``: ``<strategy>-<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... appended when that
  folder exists already (two runs in one second);
* an explicit ``--run-name`` whose folder already holds files is refused (exit 2) instead of
  mixing two runs' metrics: pick another name, or delete the folder.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace

from shardwise.config import Config, ConfigError, to_dict

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,99}$")
CONFIG_FILE = "config.json"


def path(cfg: Config) -> str:
    """The run directory of a config whose run_name is set (or would be, for library use)."""
    name = cfg.logging.run_name or f"{cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    return os.path.join(cfg.logging.out_dir, name)


def check_name(name: str) -> None:
    if name and not _NAME.match(name):
        raise ConfigError("logging.run_name", name if len(name) <= 60 else name[:57] + "...",
                          "must be a plain folder name of at most 100 letters, digits and . _ - + =",
                          "pick a short name such as 'gpt-ddp-1'")


def _held(folder: str) -> bool:
    return os.path.isdir(folder) and bool(os.listdir(folder))


def name_run(cfg: Config) -> Config:
    """Fix logging.run_name: the user's (refused if its folder holds a run) or a fresh one."""
    lg = cfg.logging
    check_name(lg.run_name)
    if lg.run_name:
        folder = os.path.join(lg.out_dir, lg.run_name)
        if _held(folder):
            raise ConfigError("logging.run_name", lg.run_name, f"{folder} already holds a run",
                              "pick another --run-name, or delete that folder to start over")
        return cfg
    base = f"{cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, n = base, 1
    while os.path.exists(os.path.join(lg.out_dir, name)):
        n += 1
        name = f"{base}-{n}"
    return replace(cfg, logging=replace(lg, run_name=name))


def create(cfg: Config) -> str:
    """Make the run directory and write the resolved config into it; return its path."""
    folder = path(cfg)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_FILE), "w") as fh:
            json.dump(to_dict(cfg), fh, indent=2)
    except OSError as exc:
        raise ConfigError("logging.out_dir", cfg.logging.out_dir,
                          f"cannot write the run directory ({exc.strerror or exc})",
                          "pick a writable folder with free space (--out-dir)") from None
    return folder
