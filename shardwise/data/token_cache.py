"""The token cache: a corpus tokenized once into a memory-mapped file, reused by later runs.

Where: ``data.token_cache`` (``--token-cache DIR``), else ``$SHARDWISE_CACHE/tokens``, else
``$XDG_CACHE_HOME/shardwise/tokens`` (``~/.cache/shardwise/tokens``). One folder per corpus and
tokenizer, named by a hash of every file's (absolute path, size, mtime) and the tokenizer (its
spec; for a tokenizer file, also its bytes' sha256), holding

    tokens.bin       every token of the corpus, files in sorted path order, in the smallest of
                     uint8 / uint16 / uint32 that holds the vocabulary (read with numpy.memmap:
                     a 1 GB corpus is never loaded into memory)
    meta.json        the count, dtype, vocabulary size, files and tokenizer; written last, so
                     its presence means the folder is complete
    tokenizer.json   bpe:N only: the BPE trained on this corpus

Both files are written to a temporary name and renamed into place (atomic on one file system),
so a run that is killed mid-way leaves no half file under the final name. Editing, adding or
removing a file changes the key: the corpus is tokenized again into a new folder (old folders
stay until deleted by hand).

Who builds: under a launcher (RANK / LOCAL_RANK set) only local rank 0 of each machine builds,
holding an exclusive lock (fcntl) on the folder so that machines sharing a file system build
once; the other ranks wait for meta.json. ``shardwise train`` builds before it launches any rank,
so the ranks find the folder ready. Progress lines go to stderr on global rank 0 only, for
corpora of PROGRESS_BYTES or more.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from shardwise.config import ConfigError
from shardwise.data import files as textfiles
from shardwise.data import hf_datasets, tokenize

CACHE_VERSION = 1
PROGRESS_BYTES = 16 << 20     # show progress for corpora of 16 MiB or more


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus in the cache: ``folder`` holds tokens.bin and meta.json."""
    folder: str
    n_tokens: int
    dtype: str
    vocab_size: int
    tokenizer: str
    built: bool = False         # True when this call tokenized it (False: found in the cache)

    @property
    def tokens_path(self) -> str:
        return os.path.join(self.folder, "tokens.bin")

    @property
    def tokenizer_path(self) -> str | None:
        """The trained BPE's tokenizer.json (None for bytes and for a tokenizer path)."""
        path = os.path.join(self.folder, "tokenizer.json")
        return path if os.path.isfile(path) else None

    def tokens(self) -> np.ndarray:
        """All tokens, memory-mapped read-only."""
        if self.n_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def default_cache_dir() -> str:
    if os.environ.get("SHARDWISE_CACHE"):
        return os.path.join(os.environ["SHARDWISE_CACHE"], "tokens")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardwise", "tokens")


def dtype_for(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def folder_for(files: list[str], spec: str, cache_dir: str, column: str | None = None) -> str:
    """The cache folder of these files under this tokenizer (``column``: the text column of a
    saved Hugging Face dataset, shardwise/data/hf_datasets.py)."""
    kind, arg = tokenize.parse_spec(spec)
    identity = [spec] + ([textfiles.file_digest(f) for f in tokenize.tokenizer_file(arg)]
                         if kind == "path" else [])
    if column is not None:
        identity.append(f"column:{column}")
    key = textfiles.digest(CACHE_VERSION, textfiles.fingerprint(files), identity)
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir())), key)


def _read_meta(folder: str) -> Corpus | None:
    """The complete corpus in ``folder``, or None: not built yet, or damaged (see _damage)."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            m = json.load(fh)
        corpus = Corpus(folder, int(m["n_tokens"]), str(m["dtype"]), int(m["vocab_size"]),
                        str(m["tokenizer"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if _damage(corpus) else corpus


def _damage(corpus: Corpus) -> str | None:
    """Why a cache folder whose meta.json reads cannot be used (tokens.bin missing, or not
    the size meta.json says), or None."""
    path = corpus.tokens_path
    if not os.path.isfile(path):
        return "tokens.bin is missing"
    want = corpus.n_tokens * np.dtype(corpus.dtype).itemsize
    if os.path.getsize(path) != want:
        return f"tokens.bin is {os.path.getsize(path):,} bytes, meta.json says {want:,}"
    return None


def _say_if_damaged(folder: str) -> None:
    """One line on stderr when a cache folder exists but is damaged (it is built again)."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            m = json.load(fh)
        why = _damage(Corpus(folder, int(m["n_tokens"]), str(m["dtype"]),
                             int(m["vocab_size"]), str(m["tokenizer"])))
    except (ValueError, KeyError, TypeError):
        why = "meta.json is damaged"
    except OSError:
        return                                  # not built yet: nothing to say
    if why:
        print(f"token cache {folder}: {why}; tokenizing the corpus again", file=sys.stderr,
              flush=True)


def _launcher_ranks() -> tuple[int, int] | None:
    """(global rank, local rank) under a launcher, None when this process is not a rank."""
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return rank, int(os.environ.get("LOCAL_RANK", rank))


def prepare(data_path: str, spec: str, cache_dir: str = "", timeout: float = 300.0,
            max_vocab: int | None = None, text_column: str = "text") -> Corpus:
    """The tokenized corpus of ``data_path`` under tokenizer ``spec``: found in the cache, built
    now, or (a rank other than local rank 0) waited for. Raises ConfigError on a path that
    matches no file, an empty corpus or a file that is not UTF-8; and, when ``max_vocab`` is
    given, on a tokenizer with more tokens, as soon as it is known (before a long
    tokenization; a trained BPE stays cached). A folder that ``save_to_disk`` wrote is a
    Hugging Face dataset: its ``text_column`` is the corpus (hf_datasets.py)."""
    files, saved = _corpus_files(data_path, text_column)
    try:
        folder = folder_for(files, spec, cache_dir, text_column if saved else None)
    except (ValueError, OSError) as exc:
        raise ConfigError("data.tokenizer", spec, str(exc), "use bytes, bpe:N or the path of a "
                          "tokenizer.json (or a folder holding one)") from None
    found = _read_meta(folder)
    if found is not None:
        return found
    if saved:    # loaded once (memory-mapped), refused here before anything is built
        dataset = hf_datasets.load(data_path, text_column)

        def chunks():
            return hf_datasets.read_chunks(dataset, text_column)
    else:
        def chunks():
            return (pair for f in files for pair in textfiles.read_chunks(f))
    total = sum(os.path.getsize(f) for f in files)
    if total == 0:
        raise ConfigError("data.data_path", data_path, f"the corpus is empty ({len(files)} "
                          "file(s), 0 bytes)", "give files that hold text")
    ranks = _launcher_ranks()
    if ranks is not None and ranks[1] != 0:
        return _wait_for(folder, timeout)
    os.makedirs(folder, exist_ok=True)
    with _locked(folder):
        found = _read_meta(folder)           # another machine built it while we waited
        if found is not None:
            return found
        show = total >= PROGRESS_BYTES and (ranks is None or ranks[0] == 0)
        if ranks is None or ranks[0] == 0:
            _say_if_damaged(folder)
        try:
            return _build(files, chunks, spec, folder, total, show, max_vocab)
        except textfiles.NotUTF8 as exc:
            raise ConfigError("data.data_path", data_path, str(exc), "convert that file to "
                              "UTF-8, or leave it out of --data-path") from None


def _corpus_files(data_path: str, text_column: str) -> tuple[list[str], bool]:
    """The corpus's files, and whether it is a Hugging Face dataset saved to disk."""
    files = textfiles.find_files(data_path)
    if not files:
        raise ConfigError("data.data_path", data_path, "matches no file", "give a text file, a "
                          "directory of them, or a glob such as 'corpus/*.txt' (quoted)")
    saved = hf_datasets.is_saved(data_path)
    if not saved and text_column != "text":
        raise ConfigError("data.text_column", text_column, f"only a Hugging Face dataset saved "
                          f"to disk has columns, and {data_path} is not one", "drop "
                          "--text-column, or point --data-path at a save_to_disk folder")
    return files, saved


@contextlib.contextmanager
def _locked(folder: str):
    import fcntl
    with open(folder + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _wait_for(folder: str, timeout: float) -> Corpus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _read_meta(folder)
        if found is not None:
            return found
        time.sleep(0.2)
    raise ConfigError("data.data_path", folder, f"local rank 0 did not finish tokenizing the "
                      f"corpus within {timeout:g} s", "look at rank 0's output, or tokenize "
                      "first with 'shardwise train --print-config' and the same flags")


def _build(files: list[str], chunks, spec: str, folder: str, total: int, show: bool,
           max_vocab: int | None = None) -> Corpus:
    """Tokenize the corpus (``chunks()``: its (bytes, text) pieces in order) into
    folder/tokens.bin, then write meta.json (both atomically)."""
    tok = tokenize.for_spec(spec, folder)
    if tok is None:                                       # bpe:N, first time on this corpus
        if show:
            print(f"training a byte-level BPE ({spec}) on {folder}", file=sys.stderr, flush=True)
        tok = tokenize.train_bpe((text for _, text in chunks()), tokenize.parse_spec(spec)[1],
                                 os.path.join(folder, "tokenizer.json"))
    if max_vocab is not None and tok.vocab_size > max_vocab:
        raise ConfigError("model.vocab_size", max_vocab, f"smaller than the tokenizer's "
                          f"vocabulary ({tok.vocab_size:,} tokens, {spec})", f"use --vocab-size "
                          f"{tok.vocab_size} or more, or leave --vocab-size out (it is then set "
                          "to the tokenizer's)")
    dtype = dtype_for(tok.vocab_size)
    tmp = os.path.join(folder, f"tokens.bin.tmp-{os.getpid()}")
    progress = _Progress(total, len(files), spec, folder) if show else None
    n = 0
    try:
        with open(tmp, "wb") as out:
            for raw, text in chunks():
                ids = tok.encode_chunk(raw, text)
                out.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                n += len(ids)
                if progress:
                    progress.add(len(raw))
        os.replace(tmp, os.path.join(folder, "tokens.bin"))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    meta = {"version": CACHE_VERSION, "n_tokens": n, "dtype": dtype,
            "vocab_size": tok.vocab_size, "tokenizer": spec, "bytes": total,
            "files": textfiles.fingerprint(files)}
    tmp = os.path.join(folder, f"meta.json.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1)
    os.replace(tmp, os.path.join(folder, "meta.json"))
    if progress:
        progress.done(n)
    return Corpus(folder, n, dtype, tok.vocab_size, spec, built=True)


class _Progress:
    """One stderr line at start and at every 10% of the bytes (rewritten in place on a tty)."""

    def __init__(self, total: int, n_files: int, spec: str, folder: str):
        self.total, self.seen, self.shown, self.t0 = total, 0, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        print(f"tokenizing {n_files:,} file(s), {total / 1e6:,.1f} MB, with {spec} into "
              f"{folder}", file=sys.stderr, flush=True)

    def add(self, n: int) -> None:
        self.seen += n
        tenth = 10 * self.seen // self.total
        if tenth > self.shown:
            self.shown = tenth
            rate = self.seen / 1e6 / max(1e-9, time.perf_counter() - self.t0)
            end = "\r" if self.tty else "\n"
            print(f"  tokenized {self.seen / self.total:4.0%} ({self.seen / 1e6:,.1f} MB, "
                  f"{rate:,.1f} MB/s)", end=end, file=sys.stderr, flush=True)

    def done(self, n_tokens: int) -> None:
        print(f"{'' if not self.tty else chr(10)}  {n_tokens:,} tokens in "
              f"{time.perf_counter() - self.t0:,.1f} s", file=sys.stderr, flush=True)
