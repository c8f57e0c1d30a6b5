"""The data settings checked before launch (shardwise/run/validate.py calls :func:`check`): the IDX
folder of MNIST / Fashion-MNIST, and for ``--dataset text`` a path that matches files with text
in them and a tokenizer that exists (whether the files are UTF-8 and long enough is known once
they are read: the token cache, shardwise/data/token_cache.py). Settings only ``--dataset text``
reads are refused for other data.
"""
from __future__ import annotations

import os

from shardwise.config import Config, ConfigError
from shardwise.config.writable import check_writable


def check(cfg: Config) -> None:
    d = cfg.data
    if d.dataset in ("mnist", "fashion-mnist"):
        if not d.data_dir:
            raise ConfigError("data.data_dir", d.data_dir, f"{d.dataset} needs its IDX files",
                              "pass --data-dir DIR holding train-images-idx3-ubyte(.gz) etc.")
        if not os.path.isdir(d.data_dir):
            raise ConfigError("data.data_dir", d.data_dir, "no such directory",
                              "give an existing directory holding the IDX files")
    elif d.data_dir and not os.path.isdir(d.data_dir):
        raise ConfigError("data.data_dir", d.data_dir, "no such directory",
                          "give an existing directory, or leave it empty")
    _text_data(cfg)


def _text_data(cfg: Config) -> None:
    """--dataset text: a path that matches files with text in them, a tokenizer that exists.
    (Whether the files are UTF-8 and long enough is known once they are read: the token cache,
    before launch, shardwise/data/token_cache.py.) Its settings are refused for other data."""
    from shardwise.config import DataConfig
    from shardwise.data import files, tokenize
    d, default = cfg.data, DataConfig()
    if d.dataset != "text":
        for name in ("data_path", "tokenizer", "token_cache", "text_column"):
            if getattr(d, name) != getattr(default, name):
                raise ConfigError(f"data.{name}", getattr(d, name), f"only --dataset text reads "
                                  f"it (the data set is {d.dataset})", f"drop --"
                                  f"{name.replace('_', '-')}, or use --dataset text")
        return
    if not d.data_path:
        raise ConfigError("data.data_path", d.data_path, "--dataset text needs your files",
                          "pass --data-path FILE, DIR or a quoted glob such as 'docs/*.md'")
    found = files.find_files(d.data_path)
    if not found:
        raise ConfigError("data.data_path", d.data_path, "matches no file", "give a text file, "
                          "a directory of them, or a glob such as 'corpus/*.txt' (quoted)")
    if sum(os.path.getsize(f) for f in found) == 0:
        raise ConfigError("data.data_path", d.data_path, f"the corpus is empty ({len(found)} "
                          "file(s), 0 bytes)", "give files that hold text")
    try:
        kind, arg = tokenize.parse_spec(d.tokenizer)
        if kind == "path":
            tokenize.tokenizer_file(arg)
    except (ValueError, OSError) as exc:
        raise ConfigError("data.tokenizer", d.tokenizer, str(exc), "use bytes, bpe:N (e.g. "
                          "bpe:8192) or a local tokenizer.json (or a folder holding one)") from None
    if kind != "bytes":
        from shardwise.config.extras import available
        if not available("tokenizers"):
            raise ConfigError("data.tokenizer", d.tokenizer, "needs the 'tokenizers' package, "
                              "which is not installed", "pip install 'shardwise[hf]'")
    if d.token_cache:
        check_writable(d.token_cache, "data.token_cache")
