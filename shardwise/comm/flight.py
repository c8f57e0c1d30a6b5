"""The flight recorder: each rank's last collectives, in a file that outlives the rank.

Every collective a :class:`~shardwise.comm.collectives.Comm` runs (the backend's, the ring's
send / recv, the shared-memory allreduce and pipeline sends) is written into a small ring of
fixed-size records in a memory-mapped file, ``<run dir>/flight/rank-<r>.bin``, when it starts
(its end time 0) and again when it completes. A rank that is stopped (SIGSTOP), killed or hung
inside a collective leaves its file as it was at that moment: the kernel holds the written
pages, so nothing has to run at the time of the failure. torch's own flight recorder exists
for NCCL only; this one works for gloo, our shared-memory paths and NCCL alike.

Record (``RECORD``, 112 bytes): sequence number (this rank's count of collectives, from 1),
step, operation name, group (its global ranks), bytes, start and end times (``time.time()``;
end 0 while in flight). Header: rank, pid, capacity, and the last sequence number written.
Cost per collective: two struct writes into the mapping (about a microsecond); memory and disk:
``capacity`` x 112 bytes per rank (64 records: 7 KiB).

:func:`read` parses a file (any process, at any time); shardwise/launch/hang.py turns every
rank's file into the report of who is behind.
"""
from __future__ import annotations

import mmap
import os
import struct
import time

HEADER = struct.Struct("<qqqq")                 # rank, pid, capacity, last sequence number
RECORD = struct.Struct("<qq40s48sqdd")          # seq, step, op, group, bytes, start, end
CAPACITY = 64


def path_for(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "flight", f"rank-{rank}.bin")


class FlightRecorder:
    """This rank's ring of the last ``capacity`` collectives (module docstring). ``step`` is
    set by the training loop; ``begin`` / ``end`` by Comm around every collective."""

    def __init__(self, path: str, rank: int, capacity: int = CAPACITY):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = HEADER.size + capacity * RECORD.size
        with open(path, "w+b") as fh:
            fh.truncate(size)
            self._map = mmap.mmap(fh.fileno(), size)
        self.rank, self.capacity, self.seq, self.step = rank, capacity, 0, 0
        self.skip_seq = 0         # a test hook: skip the collective of this number (0: none)
        HEADER.pack_into(self._map, 0, rank, os.getpid(), capacity, 0)

    def skips_next(self) -> bool:
        """The test hook (``skip_seq``): whether the next collective is to be skipped, as a
        buggy program would (not run, not recorded, its number taken by the one after)."""
        if self.skip_seq and self.seq + 1 == self.skip_seq:
            self.skip_seq = 0
            return True
        return False

    def begin(self, op: str, ranks: tuple, nbytes: int) -> int:
        """Record a collective starting now; returns its sequence number (for :meth:`end`)."""
        self.seq += 1
        group = ",".join(map(str, ranks)) if len(ranks) <= 12 else f"{ranks[0]}..{ranks[-1]}"
        RECORD.pack_into(self._map, self._offset(self.seq), self.seq, self.step,
                         op.encode()[:40], group.encode()[:48], int(nbytes), time.time(), 0.0)
        HEADER.pack_into(self._map, 0, self.rank, os.getpid(), self.capacity, self.seq)
        return self.seq

    def end(self, seq: int) -> None:
        """The collective ``seq`` completed now (ignored once its slot has been reused)."""
        at = self._offset(seq)
        if struct.unpack_from("<q", self._map, at)[0] == seq:
            struct.pack_into("<d", self._map, at + RECORD.size - 8, time.time())

    def _offset(self, seq: int) -> int:
        return HEADER.size + ((seq - 1) % self.capacity) * RECORD.size

    def close(self) -> None:
        self._map.close()


def read(path: str) -> dict:
    """{"rank", "pid", "last_seq", "records": [{seq, step, op, group, bytes, start, end}]}
    oldest first; a missing or short file raises OSError / ValueError."""
    with open(path, "rb") as fh:
        data = fh.read()
    rank, pid, capacity, last = HEADER.unpack_from(data, 0)
    if len(data) < HEADER.size + capacity * RECORD.size:
        raise ValueError(f"{path}: cut short")
    records = []
    for i in range(capacity):
        seq, step, op, group, nbytes, start, end = RECORD.unpack_from(
            data, HEADER.size + i * RECORD.size)
        if seq > 0:
            records.append({"seq": seq, "step": step, "op": op.rstrip(b"\0").decode(),
                            "group": group.rstrip(b"\0").decode(), "bytes": nbytes,
                            "start": start, "end": end})
    records.sort(key=lambda r: r["seq"])
    return {"rank": rank, "pid": pid, "last_seq": last, "records": records}
