"""The disk tier's file-backed tensors and the one background thread that moves their pages.

A :class:`Region` is one memory-mapped file (``MAP_SHARED``, unlinked as soon as it is mapped):
a tensor of the disk store is a view of exactly one region. Its blocks are reserved with
``posix_fallocate`` when it is made, so a filesystem without room refuses here, with one line
naming the file (``OSError(ENOSPC, ..., path)``), and never later as a SIGBUS on a write to a
hole.

:class:`DiskIO` moves the pages on two background threads (each a
``ThreadPoolExecutor(max_workers=1)``, so each runs its jobs in the order they were asked for),
while the training thread computes:

    prefetch(regions)     reader: read the pages in and map them (``MADV_POPULATE_READ``): the
                          next unit's parameter shard, the next chunk's master, gradient and
                          optimizer states are resident before the training thread touches them
                          (read-only, so unchanged pages are never written back; with ``write``,
                          for what the step overwrites anyway, mapped writable:
                          ``MADV_POPULATE_WRITE``); with ``cache_only``, into the kernel's page
                          cache only (``MADV_WILLNEED``), for a shard the training thread
                          copies into its unit and drops at once
    write_back(regions)   drop the pages from this process at once, on the calling thread,
                          after cancelling a read-ahead of them not yet started (or waiting
                          for one running: a read-ahead that ran late would map them again,
                          resident until their next use)
                          (``MADV_DONTNEED``, which only unmaps: for a shared file mapping a
                          dirty page goes to the kernel's page cache with its data, and a later
                          touch reads it back), then, when ``written`` and :attr:`DiskIO.sync`,
                          the writer writes the file's dirty pages to the disk
                          (``msync(MS_SYNC)``); without ``sync`` the kernel's own writeback
                          writes them when they expire or memory runs short (a page rewritten
                          every step is then written about once per expiry interval, not once
                          a step: ``memory.offload_sync``, decided by :func:`sync_needed`)

Two threads, so a read-ahead never waits behind a slow write; dropping first, so resident
memory falls as soon as a chunk is done with, however far the disk lags. Both are calls into libc through
ctypes, which releases the GIL, so the training thread runs on while the disk works. Each queue
is bounded (``max_pending`` jobs): asking for more waits for the oldest, so read-ahead never
holds more than a few chunks resident and written pages cannot pile up in RAM when the disk is
slower than the step. Correctness never waits on a job: a page the training thread touches
before its prefetch finished is read in by the fault itself, and a page written after its
write-back started is simply dirty again (the next write-back, or the kernel, writes it).
:meth:`DiskIO.drain` waits for every job: before a checkpoint reads the state and when the
store closes (the end of the run). A failed job (an I/O error, a full disk) is raised by the
next call on the training thread as an :class:`OffloadIOError` naming the file: one line
(shardwise/launch/ranks.py's resource_error).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

MS_SYNC = 4
MADV_WILLNEED, MADV_DONTNEED, MADV_REMOVE, MADV_POPULATE_READ, MADV_POPULATE_WRITE = \
    3, 4, 9, 22, 23
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = _libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class OffloadIOError(OSError):
    """A disk-tier operation failed: ``OSError(errno, what failed, the file's path)``; shardwise
    train prints it as one line (shardwise/launch/ranks.py)."""


@dataclass(eq=False)
class Region:
    """One mapped file: where it is in memory, how long, and its (unlinked) name for errors."""
    mapping: mmap.mmap
    address: int
    length: int          # bytes mapped (a multiple of the page size)
    path: str


def map_file(directory: str, tag: str, nbytes: int) -> Region:
    """A zero-filled file of ``nbytes`` (blocks reserved), mapped shared and unlinked."""
    length = max(PAGE, -(-nbytes // PAGE) * PAGE)
    fd, path = tempfile.mkstemp(prefix=f"shardwise-{tag}-", suffix=".bin", dir=directory or None)
    try:
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            raise OffloadIOError(exc.errno, f"offload=disk: reserving {length:,} bytes failed "
                          f"({exc.strerror})", path) from None
        mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)                   # the mapping keeps the (nameless) file
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return Region(mapping, address, length, path)


def _call(fn, region: Region, arg: int, what: str) -> None:
    if fn(region.address, region.length, arg) != 0:
        code = ctypes.get_errno()
        raise OffloadIOError(code, f"offload=disk: {what} failed ({os.strerror(code)})", region.path)


def populate(regions: list[Region], write: bool = False) -> None:
    """Read every page in and map it, writable when ``write`` (the caller is about to write
    every page: one write fault each here instead of a read fault and a write fault on the
    training thread); ``MADV_WILLNEED`` where the kernel is older than 5.14 and has no
    ``MADV_POPULATE_*``."""
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    for r in regions:
        if _libc.madvise(r.address, r.length, advice) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOSYS):
                raise OffloadIOError(code, f"offload=disk: reading in failed ({os.strerror(code)})",
                              r.path)
            _call(_libc.madvise, r, MADV_WILLNEED, "reading in")


def readahead(regions: list[Region]) -> None:
    """Start reading every page into the kernel's page cache (``MADV_WILLNEED``: on a shared
    file mapping the kernel reads ahead and maps nothing), so a later touch is a minor fault
    instead of a disk read, and nothing is resident in this process until then."""
    for r in regions:
        _call(_libc.madvise, r, MADV_WILLNEED, "reading ahead")


def drop(regions: list[Region]) -> None:
    """Unmap every page from this process (their data stays in the file's page cache)."""
    for r in regions:
        _call(_libc.madvise, r, MADV_DONTNEED, "dropping pages")


def discard(regions: list[Region]) -> None:
    """Free these files' disk blocks (``MADV_REMOVE``: a hole punched over the whole mapping;
    the mapping stays valid and reads zeros): for state that was moved elsewhere (the last
    checkpoint of a run, ``--checkpoint-move-last``) and is never read again."""
    for r in regions:
        _call(_libc.madvise, r, MADV_REMOVE, "freeing the disk blocks")


def sync(regions: list[Region]) -> None:
    """Write the files' dirty pages in these ranges to the disk, and wait for it."""
    for r in regions:
        _call(_libc.msync, r, MS_SYNC, "writing")


class _Queue:
    """One background thread and its bounded queue of jobs, each over a list of regions."""

    def __init__(self, name: str, max_pending: int):
        self.max_pending = max_pending
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shardwise-{name}")
        self.pending: deque[tuple[Future, list[Region]]] = deque()

    def submit(self, fn, regions: list[Region]) -> None:
        while self.pending and (self.pending[0][0].done() or
                                len(self.pending) >= self.max_pending):
            _settled(self.pending.popleft()[0])     # raises a failed job's error here
        self.pending.append((self.pool.submit(fn, regions), regions))

    def settle(self, regions: list[Region]) -> None:
        """No job of this queue touches ``regions`` after this returns: one not started yet is
        cancelled, one running is waited for (a read-ahead that ran after its chunk was done
        with would map the chunk's pages into this process again, where they would stay
        resident until its next use: the reader lags the training thread on a busy machine)."""
        ids = {id(r) for r in regions}
        for future, regs in self.pending:
            if any(id(r) in ids for r in regs) and not future.cancel():
                _settled(future)

    def drain(self) -> None:
        while self.pending:
            _settled(self.pending.popleft()[0])


def _settled(future: Future) -> None:
    """Wait for a job; raise its error (a cancelled job has none)."""
    if not future.cancelled():
        future.result()


def available_memory() -> int:
    """Bytes of memory available to start new work (``MemAvailable``; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * PAGE


def sync_needed(setting: str, host_bytes: int, available: int | None = None) -> bool:
    """``memory.offload_sync``: sync each written chunk (True) or leave it to the kernel's
    writeback (False). ``auto``: sync when ``host_bytes`` (the offloaded state of every rank on
    this machine) exceeds a quarter of the available memory, so the page cache could not hold
    it beside the training's own memory and the kernel's dirty-page limits would stall the
    training thread instead of the writer."""
    if setting == "always":
        return True
    if setting == "kernel":
        return False
    if setting != "auto":
        raise ValueError(f"offload_sync {setting!r}: one of auto, always, kernel")
    return host_bytes > (available if available is not None else available_memory()) // 4


class DiskIO:
    """The disk tier's reader and writer threads (module docstring)."""

    sync: bool = True     # write each written-back chunk at once (else the kernel's writeback)

    def __init__(self, max_pending: int = 4):
        self._reader = _Queue("offload-read", max_pending)
        # a write job holds no resident pages (they were dropped): its bound only stops the
        # training thread from running arbitrarily far ahead of a slow disk
        self._writer = _Queue("offload-write", 16 * max_pending)
        self._lock = threading.Lock()     # CUDA's autograd runs backward hooks on its own thread

    def prefetch(self, regions: list[Region], write: bool = False,
                 cache_only: bool = False) -> None:
        if regions:
            job = readahead if cache_only else functools.partial(populate, write=write)
            with self._lock:
                self._reader.submit(job, regions)

    def write_back(self, regions: list[Region], written: bool = True) -> None:
        """Drop the pages now; write them to the disk in the background (``written``: they
        may have changed since the last write-back)."""
        if regions:
            with self._lock:
                self._reader.settle(regions)
            drop(regions)
            if written and self.sync:
                with self._lock:
                    self._writer.submit(sync, regions)

    def drain(self) -> None:
        """Wait for every job; raise the first failure (an OffloadIOError naming its file)."""
        with self._lock:
            self._reader.drain()
            self._writer.drain()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._reader.pool.shutdown(wait=True)
            self._writer.pool.shutdown(wait=True)
