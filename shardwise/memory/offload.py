"""Where optimizer states and fp32 master weights live: the device, CPU memory, or disk.

:class:`OffloadStore` hands out zero-filled fp32 tensors in one of three places:

    none   on the training device (no offload)
    cpu    in CPU memory (pinned when CUDA is present, so copies to and from the GPU are fast);
           on a GPU this takes masters and optimizer states off the device, and the optimizer
           step runs on the CPU (ZeRO-Offload, Ren et al. 2021)
    disk   in numpy memory-mapped files (in ``directory``, or the temporary directory); each file
           is unlinked as soon as it is mapped, so nothing is left behind however the process
           ends (the kernel frees the space when the mapping goes); after each chunk of the optimizer step the store writes the
           chunk's pages back and drops them from this process's memory (madvise DONTNEED), so
           resident memory holds only the chunk being stepped (ZeRO-Infinity's NVMe tier, in
           miniature). The kernel's page cache may still keep the file's pages; it is not part
           of this process's resident set and is given up under memory pressure.

The math is the same in all three places: a tensor from the store is an ordinary torch tensor
(``torch.from_numpy`` of the memmap for disk), so torch.optim runs on it unchanged.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import torch

PLACES = ("none", "cpu", "disk")


class OffloadStore:
    """Allocates fp32 state tensors in one place; tracks them to report and release their memory."""

    def __init__(self, place: str, device: torch.device, directory: str = "", tag: str = "rank0"):
        if place not in PLACES:
            raise ValueError(f"offload place {place!r}: choose one of {PLACES}")
        self.place, self.device, self.tag = place, device, tag
        self._maps: dict[int, np.memmap] = {}   # data_ptr -> memmap (disk)
        self._tensors: list[torch.Tensor] = []
        self._ptrs: set[int] = set()       # data pointers of _tensors: owns() is checked per step
        self.directory = directory
        if place == "disk" and directory:
            os.makedirs(directory, exist_ok=True)

    @property
    def state_device(self) -> torch.device:
        """Where the optimizer step runs: the training device without offload, else the CPU."""
        return self.device if self.place == "none" else torch.device("cpu")

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled 1-D tensor of ``numel`` elements in this store's place."""
        if self.place == "none":
            t = torch.zeros(numel, dtype=dtype, device=self.device)
        elif self.place == "cpu":
            pin = torch.cuda.is_available()
            t = torch.zeros(numel, dtype=dtype, pin_memory=pin)
        else:
            if dtype != torch.float32:
                raise ValueError("disk offload holds fp32 tensors only")
            fd, path = tempfile.mkstemp(prefix=f"shardwise-{self.tag}-", suffix=".f32",
                                        dir=self.directory or None)
            os.close(fd)
            m = np.memmap(path, dtype=np.float32, mode="w+", shape=(max(1, numel),))
            os.unlink(path)                       # the mapping keeps the (nameless) file
            t = torch.from_numpy(m)[:numel]
            self._maps[t.data_ptr()] = m
        self._tensors.append(t)
        self._ptrs.add(t.data_ptr())
        return t

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.zeros(t.numel(), torch.float32).view(t.shape)

    def owns(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._ptrs

    def release(self, tensors) -> None:
        """Disk: write these tensors' pages back and drop them from resident memory."""
        if self.place != "disk":
            return
        for t in tensors:
            m = self._maps.get(t.data_ptr())
            if m is not None:
                m.flush()
                m._mmap.madvise(mmap.MADV_DONTNEED)

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
        """Bytes held in memory-mapped files (disk)."""
        return sum(m.nbytes for m in self._maps.values())

    def close(self) -> None:
        """Forget the tensors (the unlinked files vanish with their last mapping)."""
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
