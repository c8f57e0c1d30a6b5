"""A Hugging Face ``datasets`` dataset saved to disk, as ``--dataset text --data-path DIR``.

A folder written by ``Dataset.save_to_disk`` (it holds ``state.json``) or
``DatasetDict.save_to_disk`` (``dataset_dict.json``; its ``train`` split is read, else the first
split by name) is read with ``datasets.load_from_disk``, never downloaded. Its string column
``data.text_column`` (default ``text``) is the corpus: the rows in the dataset's order, each
followed by a blank line, tokenized into the token cache like text files are
(shardwise/data/token_cache.py; the cache key covers every file of the folder, so a dataset saved
again is tokenized again). Arrow files are memory-mapped by ``datasets`` and the rows are read
1,024 at a time, so a large dataset does not sit in memory. Empty rows (None) are skipped.

Nothing here imports torch; ``datasets`` is imported only when such a folder is read (the
``datasets`` extra: ``pip install 'shardwise[datasets]'``).
"""
from __future__ import annotations

import os

from shardwise.config import ConfigError

MARKERS = ("state.json", "dataset_dict.json")
CHUNK_CHARS = 4 << 20         # hand the tokenizer about 4 MiB of text at a time
ROWS_PER_READ = 1024
SEPARATOR = "\n\n"            # after every row: documents do not run into each other
EXTRA = "pip install 'shardwise[datasets]'"


def is_saved(data_path: str) -> bool:
    """Whether ``data_path`` is a folder that ``save_to_disk`` wrote."""
    path = os.path.expanduser(data_path or "")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in MARKERS)


def load(data_path: str, column: str):
    """The dataset (one split) whose ``column`` is the corpus; ConfigError naming the field
    when ``datasets`` is missing, the folder does not load, or the column is not a string one."""
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ConfigError("data.data_path", data_path, "is a Hugging Face dataset saved to disk, "
                          "and reading it needs the 'datasets' package, which is not "
                          "installed", EXTRA) from None
    try:
        ds = load_from_disk(os.path.expanduser(data_path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; one line names it
        raise ConfigError("data.data_path", data_path, f"looks like a saved dataset but does "
                          f"not load ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                          "save it again with Dataset.save_to_disk") from None
    if isinstance(ds, DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if column not in ds.column_names:
        raise ConfigError("data.text_column", column, f"is not a column of {data_path} (its "
                          f"columns: {', '.join(ds.column_names)})", "use --text-column NAME")
    dtype = getattr(ds.features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise ConfigError("data.text_column", column, f"holds {dtype or ds.features[column]}, "
                          "not text", "name a string column with --text-column")
    return ds


def read_chunks(ds, column: str, chunk_chars: int = CHUNK_CHARS):
    """Yield (UTF-8 bytes, text) of the column's rows of dataset ``ds`` (:func:`load`), each
    followed by a blank line, about ``chunk_chars`` characters at a time (a chunk ends at a
    row's end, so no row is cut)."""
    parts, size = [], 0
    for batch in ds.iter(batch_size=ROWS_PER_READ):
        for text in batch[column]:
            if text is None:
                continue
            parts.append(text + SEPARATOR)
            size += len(text) + len(SEPARATOR)
            if size >= chunk_chars:
                chunk = "".join(parts)
                yield chunk.encode("utf-8"), chunk
                parts, size = [], 0
    if parts:
        chunk = "".join(parts)
        yield chunk.encode("utf-8"), chunk
