"""The checkpoint folder: one sub-folder per saved step, a ``latest`` pointer, atomic publishing.

    D/
      latest              the name of the newest complete checkpoint ("step-6"), one line
      step-3/             one complete checkpoint: DCP's files (.metadata, __<rank>_0.distcp)
        meta.json         layout, world size, step, sizes, the resolved config (store.META)
      step-6/
      step-9.partial/     a save in progress (or one a crash cut short): never read

Publishing (rank 0, after every rank's DCP write has returned): ``meta.json``, with the size and
CRC-32 of every other file of the folder, is written into ``step-N.partial/``, the folder is renamed to ``step-N/`` (os.replace: atomic on POSIX), then
``latest`` is rewritten through a temporary file and os.replace. A crash at any moment leaves
``latest`` naming the previous complete checkpoint, which stays loadable; the next save clears
every left-over ``.partial`` folder. Only the newest ``keep`` complete checkpoints are kept
(never the one ``latest`` names).

Damage (a truncated or bit-flipped file, a cut ``meta.json``, a ``latest`` naming nothing):
:func:`newest_intact` checks a folder's files against the sizes and CRC-32s its ``meta.json``
lists (reading every byte once: about 1 GB/s here) and falls back from ``latest`` to the newest
intact step, naming each damaged one it passed. A folder saved before checksums were recorded
(format 1) is checked for its files' presence only.

Nothing here is distributed: the caller (checkpoint/state.py) orders the ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field

LATEST = "latest"
META = "meta.json"
FORMAT = 2          # 2: meta.json lists every file's size and CRC-32 ("files")
_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step}"


def partial_path(root: str, step: int) -> str:
    """Where a save of ``step`` writes before it is published."""
    return os.path.join(root, step_name(step) + ".partial")


def begin(root: str, step: int) -> str:
    """Rank 0: an empty ``step-N.partial`` folder. Every ``.partial`` folder left by a save a
    crash or kill cut short is cleared (no save is in flight: the caller waits for a
    background one first)."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name.endswith(".partial") and _STEP.match(name[:-len(".partial")]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    tmp = partial_path(root, step)
    os.makedirs(tmp)
    return tmp


def checksums(folder: str) -> dict[str, list[int]]:
    """{file name: [bytes, CRC-32]} of every file in ``folder`` but meta.json."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != META and os.path.isfile(path):
            out[name] = [os.path.getsize(path), _crc32(path)]
    return out


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 23):
            crc = zlib.crc32(block, crc)
    return crc


def damage(folder: str) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted, in a few words, or None when its
    meta.json reads and every file it lists has its recorded size and CRC-32."""
    try:
        meta = read_meta(folder)
        int(meta["step"])
    except OSError as exc:
        return f"{META} cannot be read ({exc.strerror})"
    except (ValueError, KeyError, TypeError):
        return f"{META} is not a complete checkpoint description (cut short?)"
    for name, (size, crc) in meta.get("files", {}).items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} is {os.path.getsize(path):,} bytes, {META} says {size:,}"
        if _crc32(path) != crc:
            return f"{name} does not match its checksum (damaged on disk)"
    return None


@dataclass
class Found:
    """The checkpoint a resume uses (None: no intact one) and the damaged ones passed over,
    newest first, as (folder, why)."""
    folder: str | None
    damaged: list[tuple[str, str]] = field(default_factory=list)

    def note(self) -> str:
        """One line on what was passed over ("" when nothing was)."""
        return "; ".join(f"{os.path.basename(f)} is damaged ({why})" for f, why in self.damaged)


def newest_intact(root: str) -> Found:
    """The folder ``latest`` names when it is intact, else the newest intact ``step-N``."""
    named = latest(root)
    candidates = ([named] if named else []) + [
        os.path.join(root, step_name(s)) for s in reversed(steps(root))]
    found = Found(None)
    for folder in dict.fromkeys(candidates):
        why = damage(folder)
        if why is None:
            found.folder = folder
            return found
        found.damaged.append((folder, why))
    return found


def publish(root: str, step: int, meta: dict, keep: int, newest_only: bool = False) -> str:
    """Rank 0, once every rank's files are written: meta.json, rename, switch ``latest``,
    prune to the newest ``keep``. Returns the published folder. ``newest_only`` (replica
    groups, whose saves come from one trajectory by more than one writer): ``latest`` is not
    moved back to an older step than the complete one it names."""
    tmp, final = partial_path(root, step), os.path.join(root, step_name(step))
    _write_atomic(os.path.join(tmp, META), json.dumps({"format": FORMAT, **meta}, indent=2))
    if os.path.exists(final):            # the same step saved again (a resumed run's first save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    current = latest(root)
    if not (newest_only and current is not None
            and int(_STEP.match(os.path.basename(current)).group(1)) > step):
        _write_atomic(os.path.join(root, LATEST), step_name(step) + "\n")
    prune(root, keep)
    return final


def _write_atomic(path: str, text: str) -> None:
    """Write a temporary file next to ``path``, flush it to disk, then os.replace."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def steps(root: str) -> list[int]:
    """The steps of the complete checkpoints in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [int(m.group(1)) for m in map(_STEP.match, os.listdir(root)) if m]
    return sorted(s for s in found if os.path.exists(os.path.join(root, step_name(s), META)))


def prune(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (never the latest one)."""
    current = latest(root)
    done = steps(root)
    for s in done[:max(0, len(done) - keep)]:
        path = os.path.join(root, step_name(s))
        if path != current:
            shutil.rmtree(path, ignore_errors=True)


def latest(root: str) -> str | None:
    """The folder ``latest`` names, when it exists and is complete; else None."""
    try:
        with open(os.path.join(root, LATEST)) as fh:
            name = fh.read().strip()
    except OSError:
        return None
    path = os.path.join(root, name)
    if not _STEP.match(name) or not os.path.exists(os.path.join(path, META)):
        return None
    return path


def resolve(path: str) -> str | None:
    """A checkpoint folder from ``path``: the folder itself when it holds meta.json, else the
    one its ``latest`` names (``shardwise checkpoint inspect D`` takes either)."""
    if os.path.exists(os.path.join(path, META)):
        return path
    return latest(path)


def read_meta(folder: str) -> dict:
    with open(os.path.join(folder, META)) as fh:
        return json.load(fh)


def folder_bytes(folder: str) -> int:
    """Bytes of every file in a checkpoint folder."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, f)))
