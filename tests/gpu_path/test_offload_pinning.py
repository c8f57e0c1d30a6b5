"""Offload to CPU pins host memory only on a CUDA run, and pins exactly the bytes it hands out.

A CPU run on a machine with CUDA must never pin (pinning initialises CUDA, which a forked CPU
world cannot do: "Cannot re-initialize CUDA in forked subprocess"). Here CUDA is pretended
(``torch.cuda.is_available`` -> True) and every way to pin raises, then a ZeRO-1 run with
``offload=cpu`` trains in a forked world of 2 on the CPU. On a CUDA run the store registers each
pinned tensor's own bytes with ``cudaHostRegister`` (a fake cudart records the calls here) and
unregisters them on close.
"""
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import tiny_config
from shardwise.config import MemoryConfig
from shardwise.memory.offload import OffloadStore

pytestmark = pytest.mark.timeout(120)


def _forbid_pinning(monkeypatch=None):
    """CUDA "present", every pinning path raising (in this process; a child needs no undo)."""
    def refuse(*a, **k):
        raise AssertionError("pinned memory on a CPU run")

    def no_pin(fn):
        def wrapped(*a, **k):
            if k.get("pin_memory"):
                refuse()
            return fn(*a, **k)
        return wrapped
    patches = [(torch.cuda, "is_available", lambda: True), (torch.Tensor, "pin_memory", refuse),
               (torch.cuda, "cudart", refuse), (torch, "zeros", no_pin(torch.zeros)),
               (torch, "empty", no_pin(torch.empty))]
    for obj, name, value in patches:
        if monkeypatch is None:
            setattr(obj, name, value)
        else:
            monkeypatch.setattr(obj, name, value)


def _offloaded_run(rank, n):
    _forbid_pinning()
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    cfg = tiny_config("zero1", steps=3)
    cfg = replace(cfg, memory=MemoryConfig(offload="cpu"))
    s = train(cfg, init_runtime(cfg), quiet=True)
    st = s["engine"].strategy
    return s["losses"], st.store.place, st.store.pinning


def test_cpu_run_with_cuda_present_never_pins():
    out = run_world(_offloaded_run, 2, timeout=100)
    for losses, place, pinning in out:
        assert place == "cpu" and not pinning
        assert len(losses) == 3 and all(l == l for l in losses)   # trained, no nan
    assert out[0][0] == out[1][0]                                  # one loss, every rank


def test_store_on_cpu_device_pins_nothing(monkeypatch):
    _forbid_pinning(monkeypatch)
    store = OffloadStore("cpu", torch.device("cpu"))
    t = store.zeros(1000, pin=True)
    assert t.shape == (1000,) and not t.any() and store.held_bytes() == 4000
    dst = torch.ones(1000)
    store.to_device(dst, t)                    # a CPU "device": a plain copy, nothing to wait
    store.wait_copies()
    assert not dst.any()
    store.close()


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; succeeds (0) like CUDA."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_cuda_run_pins_exactly_the_masters_bytes_and_frees_them(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.Tensor, "pin_memory",     # not torch's caching host allocator
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("pin_memory")))
    store = OffloadStore("cpu", torch.device("cuda", 0))
    assert store.pinning
    master = store.zeros(1001, pin=True)              # copied to the device each step: pinned
    state = store.zeros(1001)                         # stepped on the CPU: ordinary memory
    assert fake.registered == [(master.data_ptr(), 1001 * 4)]   # exactly the ledger's bytes
    assert master.data_ptr() % 4096 == 0              # page-aligned: no page shared with another
    assert not master.any() and master.dtype == torch.float32
    master.add_(1.5)                                  # ordinary tensor memory, writable
    assert float(master.sum()) == 1.5 * 1001 and not state.any()
    assert store.held_bytes() == 2 * 1001 * 4
    store.close()
    assert fake.unregistered == [master.data_ptr()]


def test_no_pinning_for_disk_or_device_places(monkeypatch):
    _forbid_pinning(monkeypatch)
    for place in ("none", "disk"):
        assert not OffloadStore(place, torch.device("cuda", 0)).pinning
