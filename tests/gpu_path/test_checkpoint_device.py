"""Checkpoints and the deferred stop on the run's own device (issue 31).

- The stop flag that ``DeferredStop.agreed`` all-reduces every step (with --checkpoint-dir) is
  made on ``comm.device``: NCCL reduces device tensors only, so a CPU flag failed at step 1.
- The RNG states a checkpoint holds touch CUDA only on a CUDA run, and then only the run's own
  device: a CPU run on a machine with GPUs (a forked gloo world) must not initialise CUDA
  ("Cannot re-initialize CUDA in forked subprocess"), and a resume must not depend on how many
  GPUs are visible. These tests make CUDA look present (``torch.cuda.is_available`` returns
  True) while every CUDA RNG call raises, so any such call in a CPU run is seen on this CPU-only
  machine; the CUDA path itself is checked with recording stand-ins for torch.cuda's RNG calls.
- A rank's state saved by a CUDA run reads back on the CPU (a CUDA storage tag is forged on
  this machine with ``torch.serialization.location_tag``, which torch.save asks for each one).
"""
from dataclasses import replace

import pytest
import torch

from reference import tiny_config
from shardwise.checkpoint import dcp_io, store
from shardwise.checkpoint import state as ck_state
from shardwise.run.deferred_stop import DeferredStop
from shardwise.comm.collectives import Group
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(240)
META = torch.device("meta")
# torch.manual_seed's own call of torch.cuda.manual_seed_all is queued until CUDA is used: safe
CUDA_RNG = ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "init",
            "_lazy_init")


class _Recorded(Exception):
    """Raised by the recording comm after it saw the flag (a meta flag cannot be read)."""


class RecordingComm:
    """A Comm stand-in on ``device``: records the device of every tensor it is handed."""

    def __init__(self, device, others: float = 0.0):
        self.device, self.others, self.seen = torch.device(device), others, []

    def all_reduce(self, t, group, op="sum", name=None):
        self.seen.append((t.device, op, name))
        if t.device.type == "meta":
            raise _Recorded
        t.copy_(torch.maximum(t, torch.full_like(t, self.others)))    # the other rank's flag


def test_the_stop_flag_lives_on_the_comm_device():
    comm = RecordingComm(META)
    with DeferredStop() as stop, pytest.raises(_Recorded):
        stop.agreed(comm, Group.solo())
    assert comm.seen == [(META, "max", "metrics")]


def test_a_signal_on_another_rank_is_agreed():
    comm = RecordingComm("cpu", others=15.0)
    with DeferredStop() as stop:
        assert stop.agreed(comm, Group.solo()) == 15
    assert comm.seen == [(torch.device("cpu"), "max", "metrics")]


class _CudaTouched(AssertionError):
    pass


def _poison_cuda(monkeypatch) -> None:
    """CUDA looks present; every CUDA RNG (or init) call fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in CUDA_RNG:
        def touched(*args, _name=name, **kwargs):
            raise _CudaTouched(f"a CPU run called torch.cuda.{_name}")
        monkeypatch.setattr(torch.cuda, name, touched)


def _cfg(root, steps, resume=False, background=False):
    cfg = tiny_config("single", steps=steps)
    return replace(cfg, train=replace(cfg.train, checkpoint_dir=f"{root}/ck", checkpoint_every=2,
                                      resume=resume, checkpoint_async=background),
                   logging=replace(cfg.logging, out_dir=str(root), run_name=f"r{steps}"))


def _train(cfg) -> list[float]:
    summary = train(cfg, init_runtime(cfg), quiet=True)
    summary["engine"].close()
    return summary["losses"]


def _saved_rng(root) -> dict:
    folder = store.latest(f"{root}/ck")
    return dcp_io.read_object(folder, "rank0/state", None)["rng"]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_cpu_run_saves_and_resumes_without_cuda(tmp_path, monkeypatch, background):
    """The RNG states, and DCP's writer (its copy-ahead loader asks CUDA for a stream)."""
    _poison_cuda(monkeypatch)
    assert len(_train(_cfg(tmp_path, 4, background=background))) == 4   # saves at 2 and 4
    assert "cuda" not in _saved_rng(tmp_path)
    assert len(_train(_cfg(tmp_path, 6, resume=True))) == 2      # resumes at 4, runs 5 and 6


def test_a_cpu_run_resumes_a_checkpoint_with_other_cuda_states(tmp_path, monkeypatch):
    """A checkpoint holding CUDA states (here three GPUs' worth, as older saves wrote every
    visible GPU's) resumed by a CPU run on a machine with GPUs: the states are ignored."""
    own = ck_state.rng_state
    states = [torch.zeros(16, dtype=torch.uint8) for _ in range(3)]
    with monkeypatch.context() as m:
        m.setattr(ck_state, "rng_state", lambda *a: {**own(*a), "cuda": states})
        _train(_cfg(tmp_path, 4))
    assert len(_saved_rng(tmp_path)["cuda"]) == 3
    _poison_cuda(monkeypatch)
    assert len(_train(_cfg(tmp_path, 6, resume=True))) == 2


class CudaRng:
    """Recording stand-ins for torch.cuda's per-device RNG calls (no GPU here)."""

    def __init__(self, monkeypatch):
        self.calls = []
        _poison_cuda(monkeypatch)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)

    def get(self, device="cuda"):
        self.calls.append(("get", torch.device(device)))
        return torch.full((16,), torch.device(device).index or 0, dtype=torch.uint8)

    def set(self, new_state, device="cuda"):
        self.calls.append(("set", torch.device(device), int(new_state[0])))


def test_a_cuda_run_saves_and_restores_its_own_device_only(monkeypatch):
    rng = CudaRng(monkeypatch)
    dev = torch.device("cuda", 1)
    state = ck_state.rng_state(dev)
    assert rng.calls == [("get", dev)] and int(state["cuda"][0]) == 1
    ck_state.set_rng_state(state, dev)
    assert rng.calls[-1] == ("set", dev, 1)


def test_a_cuda_resume_with_a_different_gpu_count(monkeypatch):
    """Every visible GPU's states (older checkpoints): this device's entry, if there is one."""
    rng = CudaRng(monkeypatch)
    base = ck_state.rng_state("cpu")
    three = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(3)]
    ck_state.set_rng_state({**base, "cuda": three}, torch.device("cuda", 2))
    assert rng.calls == [("set", torch.device("cuda", 2), 12)]
    ck_state.set_rng_state({**base, "cuda": three[:1]}, torch.device("cuda", 2))   # fewer GPUs
    ck_state.set_rng_state(base, torch.device("cuda", 0))                        # saved on CPU
    assert len(rng.calls) == 1


def test_a_state_saved_on_cuda_reads_on_the_cpu(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:3")
        buf = dcp_io.as_bytes({"w": torch.arange(4.0)})
    monkeypatch.setattr(dcp_io, "load", lambda template, folder, group: {k: buf for k in template})
    out = dcp_io.read_object("unused", "rank0/state", None)
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], torch.arange(4.0))
