"""The disk tier's file-backed tensors and the one background thread that moves their pages.

A :class:`Region` is one memory-mapped file (``MAP_SHARED``, unlinked as soon as it is mapped):
a tensor of the disk store is a view of exactly one region. Its blocks are reserved with
``posix_fallocate`` when it is made, so a filesystem without room refuses here, with one line
naming the file (``OSError(ENOSPC, ..., path)``), and never later as a SIGBUS on a write to a
hole.

:class:`DiskIO` runs the disk traffic on one thread (``ThreadPoolExecutor(max_workers=1)``, so
jobs run in the order they were asked for) while the training thread computes:

    prefetch(regions)     read the pages in and map them (``MADV_POPULATE_WRITE``): the next
                          unit's parameter shard, the next chunk's master, gradient and optimizer
                          states are resident before the training thread touches them
    write_back(regions)   write the dirty pages to the file (``msync(MS_SYNC)``) and drop them
                          from this process (``MADV_DONTNEED``: for a shared file mapping the
                          data stays in the file; a later touch reads it back)

Both are calls into libc through ctypes, which releases the GIL, so the training thread runs
on while the disk works. The queue is bounded (``max_pending`` jobs): asking for more waits for
the oldest, so read-ahead never holds more than a few chunks resident. Correctness never waits
on a job: a page the training thread touches before its prefetch finished is read in by the
fault itself, and a page written after its write-back started is simply dirty again (the next
write-back, or the kernel, writes it). :meth:`DiskIO.drain` waits for every job: before a
checkpoint reads the state and when the store closes (the end of the run). A failed job (an I/O
error, a full disk) is raised by the next call on the training thread as an ``OSError`` naming
the file: one line (shardwise/launch/ranks.py's resource_error).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

MS_SYNC = 4
MADV_WILLNEED, MADV_DONTNEED, MADV_POPULATE_WRITE = 3, 4, 23
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = _libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


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
            raise OSError(exc.errno, f"offload=disk: reserving {length:,} bytes failed "
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
        raise OSError(code, f"offload=disk: {what} failed ({os.strerror(code)})", region.path)


def populate(regions: list[Region]) -> None:
    """Read every page in and map it writable (``MADV_WILLNEED`` where the kernel is older
    than 5.14 and has no ``MADV_POPULATE_WRITE``)."""
    for r in regions:
        if _libc.madvise(r.address, r.length, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOSYS):
                raise OSError(code, f"offload=disk: reading in failed ({os.strerror(code)})",
                              r.path)
            _call(_libc.madvise, r, MADV_WILLNEED, "reading in")


def sync_and_drop(regions: list[Region]) -> None:
    """Write the dirty pages to the file, then drop every page from this process."""
    for r in regions:
        _call(_libc.msync, r, MS_SYNC, "writing")
        _call(_libc.madvise, r, MADV_DONTNEED, "dropping pages")


class DiskIO:
    """One background thread for the disk tier's page traffic (module docstring)."""

    def __init__(self, max_pending: int = 6):
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-offload")
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()     # CUDA's autograd runs backward hooks on its own thread

    def prefetch(self, regions: list[Region]) -> None:
        self._submit(populate, regions)

    def write_back(self, regions: list[Region]) -> None:
        self._submit(sync_and_drop, regions)

    def _submit(self, fn, regions: list[Region]) -> None:
        if not regions:
            return
        with self._lock:
            self._enqueue(fn, regions)

    def _enqueue(self, fn, regions: list[Region]) -> None:
        while self._pending and (self._pending[0].done() or
                                 len(self._pending) >= self.max_pending):
            self._pending.popleft().result()        # raises a failed job's OSError here
        self._pending.append(self._pool.submit(fn, regions))

    def drain(self) -> None:
        """Wait for every job; raise the first failure (an OSError naming its file)."""
        with self._lock:
            while self._pending:
                self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
