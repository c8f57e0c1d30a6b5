"""A person's text files: which files ``--data-path`` names, their fingerprint, their text.

``--data-path`` is one of
  * a file: that file;
  * a directory: every regular file below it (recursively), hidden files and folders (a name
    starting with '.') and ``__pycache__`` left out;
  * a glob (``'corpus/*.txt'``, ``'books/**/*.md'``; ``**`` descends into folders): every
    regular file it matches.
Files are taken in sorted path order, so the corpus (and its train/val split) is the same on
every machine that holds the same files. Text is read as UTF-8; a file that is not UTF-8 is
refused by name (:class:`NotUTF8`), never decoded with replacement characters.

Nothing here imports torch: this is plain file handling, shared by the token cache and the
checks that run before launch.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os

CHUNK_BYTES = 4 << 20        # read files 4 MiB at a time: a 1 GB corpus never sits in memory


class NotUTF8(ValueError):
    """A file of the corpus is not UTF-8 text: ``path`` and the byte ``offset`` where it fails."""

    def __init__(self, path: str, offset: int):
        self.path, self.offset = path, offset
        super().__init__(f"{path} is not UTF-8 text (invalid byte at offset {offset})")


def _visible(name: str) -> bool:
    return not name.startswith(".") and name != "__pycache__"


def find_files(data_path: str) -> list[str]:
    """The sorted absolute paths of the regular files ``data_path`` names (empty: none match)."""
    if not data_path:
        return []
    path = os.path.expanduser(data_path)
    if os.path.isfile(path):
        return [os.path.abspath(path)]
    found: list[str] = []
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if _visible(d))
            found.extend(os.path.join(dirpath, f) for f in filenames if _visible(f))
    elif glob.has_magic(path):
        found = glob.glob(path, recursive=True)
    return sorted({os.path.abspath(f) for f in found if os.path.isfile(f)})


def fingerprint(files: list[str]) -> list[list]:
    """[path, size, mtime_ns] per file: what the token cache is keyed by (a file that is edited,
    replaced, added or removed gives another key, so the corpus is tokenized again)."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def digest(*parts) -> str:
    """A short stable hash of JSON-able parts (the cache folder's name)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_digest(path: str) -> str:
    """The sha256 of a file's bytes, first 20 hex digits (a tokenizer file's identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
            h.update(block)
    return h.hexdigest()[:20]


def read_chunks(path: str, chunk_bytes: int = CHUNK_BYTES):
    """Yield (raw bytes, decoded text) of ``path``, chunk by chunk; raise NotUTF8 naming the
    file at its first invalid byte. Every chunk but the last ends after a newline when the file
    has one within the chunk, so a tokenizer never sees a line cut in two (nor a character: the
    incremental decoder holds back a split UTF-8 sequence)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, carry_raw, carry_text = 0, b"", ""
    with open(path, "rb") as fh:
        while True:
            raw = fh.read(chunk_bytes)
            final = not raw
            pending = len(decoder.getstate()[0])     # bytes of a character split last time
            try:
                text = decoder.decode(raw, final=final)
            except UnicodeDecodeError as exc:
                raise NotUTF8(path, offset - pending + exc.start) from None
            offset += len(raw)
            raw, text = carry_raw + raw, carry_text + text
            if final:
                if raw:
                    yield raw, text
                return
            cut = text.rfind("\n") + 1
            if cut == 0:                        # one long line: cut where the chunk ends
                cut = len(text)
            head = text[:cut]
            head_raw = head.encode("utf-8")
            carry_text, carry_raw = text[cut:], raw[len(head_raw):]
            if head:
                yield head_raw, head
