"""Streamed safetensors export: the plain model written a bounded group of tensors at a time.

    OUT/                                  a folder (the Hugging Face layout)
      model.safetensors                   when every tensor fits in one shard, else
      model-00001-of-0000N.safetensors    shards of at most ``max_shard_bytes`` each (a tensor
      ...                                 larger than that is a shard of its own), and
      model.safetensors.index.json        {"metadata": {"total_size": B},
                                           "weight_map": {name: file}}
      config.json                         for an hf:* model: its transformers config
    OUT.safetensors                       a file: one safetensors file, whatever its size

Memory: the names, shapes and dtypes come first (the checkpoint's metadata and the plain model
built on the meta device), so every safetensors header is written before any tensor is read.
The tensors are then read group by group (``read(keys)``), each group at most
``max_shard_bytes`` and at most READ_BUFFER (256 MiB) bytes, or one tensor larger than that;
each tensor is written straight from its own memory (no serialised copy) and the group is
dropped before the next is read. The export holds one group plus the one tensor DCP's reader
stages while it copies (:func:`dcp_io.read_keys`), never the whole model.

Atomic: every file is written as ``.tmp-export-*`` in its own folder, flushed and fsynced; only
when all are complete are they renamed into place (os.replace), the weights first and the index
last, then the files of an earlier export that the new one does not name (``model.safetensors``
after a sharded export, old shards, an old index) are removed. Each file is replaced atomically;
the set of files is not (a crash between two renames can mix two exports' shards). A failure
while writing (a full disk: ENOSPC) removes the temporary files and raises one ConfigError line
(path, why, fix); an earlier export in OUT is left as it was. Before anything is written, the
free space of OUT's filesystem is checked against the bytes the export needs.

The same writer serves any source of tensors: :func:`specs_of` a {name: tensor} mapping (meta
tensors will do) and a ``read`` that gathers the named tensors (one unit of a sharded model at
a time) give a streamed ``final.safetensors``.

The safetensors format (https://github.com/huggingface/safetensors, "Format"): 8 bytes
little-endian header length N, N bytes of JSON header ({name: {dtype, shape, data_offsets}},
"__metadata__": str -> str) padded with spaces to a multiple of 8, then the tensors' bytes in
the order of their offsets (little-endian, row-major, no gaps).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from shardwise.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_MAX_SHARD = "2GB"
# the most tensor bytes read at once when --max-shard-size is larger: a block of a multi-billion
# parameter model or less, and large enough that DCP's per-read cost (its metadata) is paid
# a few times per GB, not per tensor
READ_BUFFER = 256 * 2**20
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Spec:
    """One tensor of the export: its name in the file, the key its bytes are read under (a tied
    name reads the one stored tensor), its shape and the dtype written."""
    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def specs_of(tensors) -> list[Spec]:
    """A Spec per item of a {name: tensor} mapping, in its order, read under its own name (only
    shapes and dtypes are looked at: meta tensors will do)."""
    return [Spec(k, k, tuple(t.shape), t.dtype) for k, t in tensors.items()]


def parse_size(text: str, field: str = "--max-shard-size") -> int:
    """Bytes from '2GB' (10^9, as Hugging Face reads it), '500MiB' (2^20), '123' (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(field, text, "is not a size of at least one byte",
                          "give bytes with a unit, e.g. 2GB, 500MB or 64MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def plan_shards(specs: list[Spec], max_shard_bytes: int) -> list[list[Spec]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor: a group alone),
    Hugging Face's greedy order (transformers' shard_checkpoint)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards if shards[0] else []


def _header(specs: list[Spec], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header of a safetensors file holding ``specs`` in order."""
    head: dict = {"__metadata__": metadata}
    offset = 0
    for s in specs:
        if s.dtype not in _DTYPES:
            raise ConfigError("checkpoint", s.name, f"has dtype {s.dtype}, which safetensors "
                              "cannot store", "cast the model to a float or integer dtype")
        head[s.name] = {"dtype": _DTYPES[s.dtype], "shape": list(s.shape),
                        "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                      # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _write_tensor(fh, t: torch.Tensor) -> None:
    """The tensor's bytes, from its own memory (a view as bytes: no serialised copy)."""
    fh.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _write_file(path: str, specs: list[Spec], read: Callable[[list[str]], dict],
                budget: int, metadata: dict[str, str]) -> None:
    """One safetensors file at ``path`` (already a temporary name), its tensors read group by
    group: ``read(keys)`` -> {key: tensor}; each tensor is cast to its spec's dtype, written,
    and the group dropped before the next is read."""
    with open(path, "wb") as fh:
        fh.write(_header(specs, metadata))
        for group in plan_shards(specs, budget):   # read groups: the same greedy cut
            tensors = read(sorted({s.key for s in group}))
            for s in group:
                t = tensors[s.key]
                if tuple(t.shape) != s.shape:
                    raise ValueError(f"{s.name}: stored shape {tuple(t.shape)} vs model {s.shape}")
                _write_tensor(fh, t.to(s.dtype))
                del t
            del tensors                            # the group is freed before the next is read
        fh.flush()
        os.fsync(fh.fileno())


def _check_room(folder: str, need: int, out: str) -> None:
    """Refuse before writing when OUT's filesystem has fewer free bytes than the export needs
    (the temporary files sit beside the earlier export until they replace it)."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ConfigError("export", out, f"needs {need:,} bytes on its filesystem, which has "
                          f"{free:,} free", "free space there, or export to another folder")


def _tmp(folder: str, name: str) -> str:
    """A temporary path beside ``name`` (opened by the writer with the umask's permissions, as
    the final file would be; mkstemp's would be 0600)."""
    return os.path.join(folder, f".tmp-export-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")


def write(out: str, specs: list[Spec], read: Callable[[list[str]], dict],
          max_shard_bytes: int, metadata: dict[str, str] | None = None,
          extra: dict[str, str] | None = None) -> list[str]:
    """Write ``specs`` to ``out``: a folder (the Hugging Face layout, sharded at
    ``max_shard_bytes``), or one file when ``out`` ends in .safetensors; ``read(keys)`` gives
    the tensors of a group of at most min(``max_shard_bytes``, READ_BUFFER) bytes (or one
    larger tensor). ``extra``: more files for the folder
    ({name: text}, e.g. config.json), replaced the same way. Returns the files written."""
    if sys.byteorder != "little":
        raise ConfigError("export", out, "safetensors stores little-endian bytes; this machine "
                          "is big-endian", "export on a little-endian machine")
    single_file = out.endswith(".safetensors")
    folder = os.path.dirname(os.path.abspath(out)) if single_file else os.path.abspath(out)
    os.makedirs(folder, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards = [specs] if single_file else plan_shards(specs, max_shard_bytes) or [[]]
    names = ([os.path.basename(out)] if single_file else
             [SINGLE] if len(shards) == 1 else
             [SHARD.format(i + 1, len(shards)) for i in range(len(shards))])
    files = dict(extra or {}) if not single_file else {}
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: n for n, shard in zip(names, shards) for s in shard}}
        files[INDEX] = json.dumps(index, indent=2) + "\n"
    # the tensors' bytes, and a generous 512 bytes of header per tensor plus the small files
    _check_room(folder, sum(s.nbytes for s in specs) + 512 * len(specs)
                + sum(len(t) for t in files.values()), out)
    done: list[tuple[str, str]] = []               # (temporary path, final name), in order
    try:
        for name, shard in zip(names, shards):
            done.append((_tmp(folder, name), name))
            _write_file(done[-1][0], shard, read, min(max_shard_bytes, READ_BUFFER), meta)
        for name, text in files.items():
            done.append((_tmp(folder, name), name))
            with open(done[-1][0], "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
    except OSError as exc:
        _remove(p for p, _ in done)
        why = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise ConfigError("export", out, f"could not be written ({why}); nothing was replaced",
                          "free space (or fix the folder's permissions) and export again, or "
                          "export to another folder") from None
    except BaseException:
        _remove(p for p, _ in done)
        raise
    return _commit(folder, done, single_file)


def _remove(paths: Iterable[str]) -> None:
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def _commit(folder: str, done: list[tuple[str, str]], single_file: bool) -> list[str]:
    """Rename the complete temporary files into place (weights first, the index after them),
    then remove the earlier export's weight files the new one does not name."""
    order = sorted(done, key=lambda d: d[1] == INDEX)
    for tmp, name in order:
        os.replace(tmp, os.path.join(folder, name))
    written = [name for _, name in done]
    if not single_file:
        stale = [f for f in os.listdir(folder) if f not in written and
                 (f in (SINGLE, INDEX) or _SHARD_RE.match(f))]
        _remove(os.path.join(folder, f) for f in stale)
    return written
