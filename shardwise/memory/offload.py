"""Where optimizer states and fp32 master weights live: the device, CPU memory, or disk.

:class:`OffloadStore` hands out zero-filled fp32 tensors in one of three places:

    none   on the training device (no offload)
    cpu    in CPU memory; on a GPU this takes masters and optimizer states off the device, and
           the optimizer step runs on the CPU (ZeRO-Offload, Ren et al. 2021)
    disk   in memory-mapped files (in ``directory``, or the temporary directory; any dtype), each
           with its blocks reserved when it is made and unlinked as soon as it is mapped, so a
           full filesystem refuses at once naming the file, and nothing is left behind however
           the process ends (the kernel frees the space when the mapping goes). The store's
           owner says when a tensor's pages are needed and when they are done with:
           :meth:`prefetch` reads them in and :meth:`release` writes them back and drops them
           from this process's memory, both on one background thread
           (shardwise/memory/offload_io.py), so resident memory holds only the chunks in use
           and the disk works while the training thread computes (ZeRO-Infinity's NVMe tier,
           in miniature). Written chunks are synced to the disk at once, or left to the
           kernel's writeback where the state fits well within memory (:meth:`plan_writes`). :meth:`drain` waits for the disk; the kernel's page cache may still
           keep the file's pages, which are not part of this process's resident set and are
           given up under memory pressure.

The math is the same in all three places: a tensor from the store is an ordinary torch tensor
(``torch.frombuffer`` of the mapping for disk), so torch.optim runs on it unchanged.

Pinning (``cpu`` only, and only when the run's device is CUDA: a CPU run never touches CUDA, so
a forked CPU world on a GPU machine still starts). A tensor asked for with ``pin=True`` (what is
copied to the device every step: the masters) is an anonymous memory mapping of exactly its
bytes (page-aligned, so no two registrations share a page) registered with
``cudaHostRegister``, not torch's caching host allocator, which rounds a request up to a power
of two and keeps freed blocks: the pinned bytes are the bytes the memory ledger counts (plus
less than one 4 KiB page per tensor for the mapping's last page), and :meth:`close`
unregisters them. Optimizer states are stepped on the CPU and never copied: they stay
ordinary memory.

Copies to the device (:meth:`to_device`) are ``non_blocking`` from the host: the host does not
wait for the DMA (the chunk's all-gather is queued behind it on the stream). The host must not
write a pinned source before its copy finished: :meth:`wait_copies` (a CUDA event, recorded
after the last copy) is called at the end of the optimizer step, so anything after the step
(the next step, a state load) may write the masters. From pageable memory (disk; or a 16-bit
working dtype, whose cast torch makes on the host into a temporary, so only fp32 runs copy
straight from the pinned master) CUDA returns once the source was read, so nothing can race.
Copies from the device (a gradient shard, parallel/data/zero.py) stay blocking: the CPU
step reads them at once, so there is nothing to overlap them with.
"""
from __future__ import annotations

import mmap
import os

import torch

from shardwise.memory.offload_io import DiskIO, Region, discard, map_file, sync_needed

PLACES = ("none", "cpu", "disk")


class OffloadStore:
    """Allocates fp32 state tensors in one place; tracks them to report and release their memory."""

    def __init__(self, place: str, device: torch.device, directory: str = "", tag: str = "rank0"):
        if place not in PLACES:
            raise ValueError(f"offload place {place!r}: choose one of {PLACES}")
        self.place, self.device, self.tag = place, device, tag
        self._maps: dict[int, Region] = {}   # data_ptr -> mapped file (disk)
        self._tensors: list[torch.Tensor] = []
        self._ptrs: set[int] = set()       # data pointers of _tensors: owns() is checked per step
        self._pins: list[tuple[int, mmap.mmap]] = []   # (address, mapping) registered with CUDA
        self._copied = None                # CUDA event after the last non-blocking copy
        self.pinning = place == "cpu" and device.type == "cuda"   # never on a CPU run
        self.directory = directory
        self.io = DiskIO() if place == "disk" else None
        if place == "disk" and directory:
            os.makedirs(directory, exist_ok=True)

    def plan_writes(self, setting: str, host_bytes: int) -> None:
        """Disk: whether each written-back chunk is synced at once or left to the kernel's
        writeback (``memory.offload_sync``; ``host_bytes``: what every rank on this machine
        offloads, for ``auto``: shardwise/memory/offload_io.py ``sync_needed``)."""
        if self.io is not None:
            self.io.sync = sync_needed(setting, host_bytes)

    @property
    def syncs(self) -> bool | None:
        """Disk: True when written chunks are synced at once; None elsewhere."""
        return self.io.sync if self.io is not None else None

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32, pin: bool = False
              ) -> torch.Tensor:
        """A zero-filled 1-D tensor of ``numel`` elements in this store's place; ``pin``: it is
        copied to the device each step, so pin it (``cpu`` place on a CUDA run only)."""
        if self.place == "none":
            t = torch.zeros(numel, dtype=dtype, device=self.device)
        elif self.place == "cpu":
            t = self._pinned(numel, dtype) if pin and self.pinning and numel else \
                torch.zeros(numel, dtype=dtype)
        else:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            region = map_file(self.directory, self.tag, nbytes)
            t = torch.frombuffer(region.mapping, dtype=dtype, count=numel) if numel else \
                torch.empty(0, dtype=dtype)
            self._maps[t.data_ptr()] = region
        self._tensors.append(t)
        self._ptrs.add(t.data_ptr())
        return t

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Exactly ``numel`` values of page-locked memory: an anonymous mapping (zero-filled,
        page-aligned) registered with CUDA; unregistered by :meth:`close`."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        m = mmap.mmap(-1, nbytes)
        t = torch.frombuffer(m, dtype=dtype, count=numel)
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"offload=cpu: pinning {nbytes} bytes of host memory failed "
                               f"(cudaError {err}); fix: free host memory, raise the locked-"
                               "memory limit (ulimit -l), or use --offload disk")
        self._pins.append((t.data_ptr(), m))
        return t

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (on the device) <- src (from this store): non-blocking on CUDA; the host may write
        ``src`` again after :meth:`wait_copies`."""
        if dst.device.type != "cuda" or src.device.type != "cpu":   # no host copy to wait for
            dst.copy_(src)
            return
        dst.copy_(src, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(dst.device))

    def wait_copies(self) -> None:
        """Block the host until every :meth:`to_device` copy has read its source."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.zeros(t.numel(), torch.float32).view(t.shape)

    def owns(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._ptrs

    def _regions(self, tensors) -> list[Region]:
        regions = (self._maps.get(t.data_ptr()) for t in tensors if t is not None)
        return [r for r in regions if r is not None]

    def prefetch(self, tensors, write: bool = False, cache_only: bool = False) -> None:
        """Disk: read these tensors' pages in on the background thread (they are about to be
        used; ``write``: to be overwritten, so map them writable; ``cache_only``: into the
        kernel's page cache, not mapped into this process, for data the training thread copies
        out and drops at once); elsewhere nothing to do."""
        if self.io is not None:
            self.io.prefetch(self._regions(tensors), write, cache_only)

    def release(self, tensors, written: bool = True) -> None:
        """Disk: drop these tensors' pages from resident memory now and, if ``written`` (they
        may have changed), write them to the disk on the background thread (the caller may
        touch them again at once: they are read back)."""
        if self.io is not None:
            self.io.write_back(self._regions(tensors), written)

    def discard(self, tensors) -> None:
        """Disk: free the disk blocks of the store tensors these tensors are (or are views of)
        at once (they read zeros afterwards): for
        state moved into the last checkpoint (checkpoint/dcp_io.py), never used again. Pending
        writes finish first, so none lands in a freed file afterwards. Elsewhere nothing."""
        if self.io is not None:           # a view's region: the one its storage starts
            regions = [r for r in (self._maps.get(t.untyped_storage().data_ptr())
                                   for t in tensors if t is not None) if r is not None]
            if regions:
                self.io.drain()
                discard(regions)

    def drain(self) -> None:
        """Wait until every prefetch and write-back finished; raise the first I/O error (an
        OSError naming the file)."""
        if self.io is not None:
            self.io.drain()

    def held_bytes(self) -> int:
        """Bytes of every tensor this store handed out."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def adopt_state(self, state: dict) -> None:
        """Move any tensor in an optimizer's per-parameter state that is not yet in the store
        (e.g. created lazily by an optimizer we did not pre-fill) into the store."""
        if self.place == "none":
            return
        for key, v in list(state.items()):
            if torch.is_tensor(v) and v.dim() > 0 and not self.owns(v):
                t = self.zeros_like(v) if v.dtype == torch.float32 else v.cpu()
                if t is not v:
                    t.copy_(v)
                state[key] = t

    @property
    def mapped_bytes(self) -> int:
        """Bytes held in memory-mapped files (disk), as handed out (not rounded to pages)."""
        return sum(t.numel() * t.element_size() for t in self._tensors
                   if t.data_ptr() in self._maps)

    def close(self) -> None:
        """Forget the tensors (the unlinked files vanish with their last mapping) and give the
        pinned pages back to the system (a tensor still held elsewhere stays valid, unpinned);
        the disk's pending writes finish first."""
        self.wait_copies()
        if self.io is not None:
            self.io.close()
            self.io = None
        for ptr, _ in self._pins:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._pins.clear()
        self._tensors.clear()
        self._ptrs.clear()
        self._maps.clear()


def prefill_adam_state(optimizer: torch.optim.Optimizer, store: OffloadStore) -> None:
    """Create Adam / AdamW moment buffers in the store before the first step, so the optimizer
    never allocates them in RAM (torch.optim initialises state only when a parameter's state is
    empty). Other optimizers' states are moved into the store after their first step
    (:meth:`OffloadStore.adopt_state`)."""
    if store.place == "none" or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = store.zeros_like(p)
            st["exp_avg_sq"] = store.zeros_like(p)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = store.zeros_like(p)
