"""The checkpoint folder: one sub-folder per saved step, a ``latest`` pointer, atomic publishing.

    D/
      latest              the name of the newest complete checkpoint ("step-6"), one line
      step-3/             one complete checkpoint: DCP's files (.metadata, __<rank>_0.distcp)
        meta.json         layout, world size, step, sizes, the resolved config (store.META)
      step-6/
      step-9.partial/     a save in progress (or one a crash cut short): never read

Publishing (rank 0, after every rank's DCP write has returned): ``meta.json`` is written into
``step-N.partial/``, the folder is renamed to ``step-N/`` (os.replace: atomic on POSIX), then
``latest`` is rewritten through a temporary file and os.replace. A crash at any moment leaves
``latest`` naming the previous complete checkpoint, which stays loadable; the next save clears
the left-over ``.partial`` folder. Only the newest ``keep`` complete checkpoints are kept
(never the one ``latest`` names).

Nothing here is distributed: the caller (checkpoint/state.py) orders the ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

LATEST = "latest"
META = "meta.json"
FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step}"


def partial_path(root: str, step: int) -> str:
    """Where a save of ``step`` writes before it is published."""
    return os.path.join(root, step_name(step) + ".partial")


def begin(root: str, step: int) -> str:
    """Rank 0: an empty ``step-N.partial`` folder (a crashed earlier attempt is cleared)."""
    os.makedirs(root, exist_ok=True)
    tmp = partial_path(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def publish(root: str, step: int, meta: dict, keep: int) -> str:
    """Rank 0, once every rank's files are written: meta.json, rename, switch ``latest``,
    prune to the newest ``keep``. Returns the published folder."""
    tmp, final = partial_path(root, step), os.path.join(root, step_name(step))
    _write_atomic(os.path.join(tmp, META), json.dumps({"format": FORMAT, **meta}, indent=2))
    if os.path.exists(final):            # the same step saved again (a resumed run's first save)
        shutil.rmtree(final)
    os.replace(tmp, final)
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
