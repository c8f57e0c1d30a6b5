"""The CPU heap: glibc malloc's thresholds for a training process (``train.cpu_allocator``).

Why: glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a mapping of
its own and unmaps it when freed, and gives the top of its heap back to the kernel once more
than its trim threshold (128 KiB, or twice the mmap threshold once that has adapted) is free.
A training step allocates and frees the same large tensors every step (activations, logits,
gradients, the optimizer's temporaries), so each comes back as new pages that the kernel faults
in and zeroes on first touch, every step: thousands to tens of thousands of page faults a step
at 57M parameters (``python -m shardwise.bench.malloc_cost``; docs/benchmarks.md has its figures).
PyTorch's CUDA caching allocator keeps freed GPU memory for reuse for the same reason; its CPU
allocator is glibc's malloc.

``cache``: ``mallopt(M_MMAP_THRESHOLD, 256 MiB)`` and ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)``:
a block under 256 MiB comes from the heap, and a freed one stays there for the next step's
tensors; the heap's top goes back to the kernel only when 2 GiB of it are free (mallopt takes a
C int). Blocks of 256 MiB or more are mapped and unmapped as before (at 57M and 350M parameters
every tensor of a step is smaller). Measured by malloc_cost: at 57M and 350M parameters a
training step's peak RSS is the same within 2%, and after a few steps no page fault is left.

The price, and why the ceiling is 256 MiB: PyTorch asks glibc for 64-byte aligned blocks, which
glibc serves by over-asking, so a freed block is a little too small for the next request of
the same size. A step's tensors of many sizes fill such holes (hence the same peak above), but a
loop that frees and reallocates one large tensor alone grows the heap by a few copies of it
before the holes merge (tests/foundation/test_cpu_allocator.py: 144 MiB zeros in a loop hold
several times the RSS they hold on glibc as it is, and 300 MiB ones, above the ceiling, none).
The ceiling bounds that to a few times 256 MiB.

``system``: glibc as it is (and whatever MALLOC_* variables say).

``auto`` (the default): ``cache`` where all of these hold, else ``system``:

- the run's tensors are on the CPU (on a GPU the host heap holds little);
- the C library is glibc (mallopt is glibc's; musl and macOS have no such knobs);
- no ``MALLOC_*_`` threshold variable and no ``glibc.malloc`` tunable is set (whoever set one
  chose: shardwise's memory measurements set ``MALLOC_MMAP_THRESHOLD_=131072`` so that peak
  resident memory follows live bytes, :func:`track_live_bytes`);
- no ZeRO offload (``memory.offload`` none): offloading is for runs short of memory, which want
  what they free back.

The setting is the process's: :func:`configure` is called once by ``init_runtime`` (the CLI's
ranks and ``shardwise.prepare`` alike), and a process started by ``fork`` inherits it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # glibc's mallopt parameters (malloc.h)
CACHE_MMAP_THRESHOLD = 256 << 20
CACHE_TRIM_THRESHOLD = (1 << 31) - 1              # the largest C int
LIVE_BYTES_THRESHOLD = 131072                       # what the memory measurements use
CHOICES = ("auto", "cache", "system")
_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
              "MALLOC_MMAP_MAX_")


def _glibc():
    """glibc's handle, or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def unusable() -> str | None:
    """Why ``cache`` cannot be set in this process (None: it can)."""
    if _glibc() is None:
        return (f"the C library here is not glibc ({platform.system()}, "
                f"{platform.libc_ver()[0] or 'unknown'}), and its thresholds are glibc's")
    return None


def chosen_elsewhere() -> str | None:
    """The environment variable or tunable that already sets glibc's thresholds, if any."""
    for name in _VARIABLES:
        if name in os.environ:
            return name
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def decide(choice: str, device: torch.device, offload: str = "none") -> tuple[str, str]:
    """(``cache`` or ``system``, why) for ``train.cpu_allocator`` = ``choice`` (module
    docstring's rules for ``auto``)."""
    if choice not in CHOICES:
        raise ValueError(f"train.cpu_allocator {choice!r}: one of {', '.join(CHOICES)}")
    if choice != "auto":
        return choice, "asked for"
    if device.type != "cpu":
        return "system", f"the tensors are on {device.type}"
    why = unusable()
    if why:
        return "system", why
    name = chosen_elsewhere()
    if name:
        return "system", f"{name} is set"
    if offload != "none":
        return "system", f"ZeRO offload ({offload}) wants the memory it frees back"
    return "cache", "a CPU run on glibc"


def configure(choice: str, device: torch.device, offload: str = "none") -> str:
    """Apply ``train.cpu_allocator`` to this process; returns what it is now, in words
    (``cache``, or ``system (why)``), for the run's summary. ``cache`` where glibc is absent
    raises RuntimeError (the config check refuses it before launch: run/validate.py)."""
    mode, why = decide(choice, device, offload)
    if mode == "system":
        return f"system ({why})"
    libc = _glibc()
    if libc is None:
        raise RuntimeError(f"train.cpu_allocator cache: {unusable()}; fix: --cpu-allocator "
                           "system (or auto)")
    ok = libc.mallopt(M_MMAP_THRESHOLD, CACHE_MMAP_THRESHOLD) and \
        libc.mallopt(M_TRIM_THRESHOLD, CACHE_TRIM_THRESHOLD)
    return "cache" if ok else "system (glibc refused the thresholds)"


def track_live_bytes() -> None:
    """For memory measurements: glibc returns every freed block of 128 KiB or more to the
    kernel (``mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD, 131072)``, as
    ``MALLOC_MMAP_THRESHOLD_=131072`` does), so peak resident memory follows live bytes; the
    variable is set too, so that ``auto`` leaves it so in this process and in those it starts."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_BYTES_THRESHOLD)
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LIVE_BYTES_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, LIVE_BYTES_THRESHOLD)
