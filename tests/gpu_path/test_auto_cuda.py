"""``--strategy auto``'s calibration on CUDA (issue 31): the GPUs' links are never a forked CPU
gloo world's bandwidth. One GPU: no link to calibrate; several: the planner's GPU catalogue,
and the printed calibration says so. And a ``--device cpu`` calibration on a GPU host asks
CUDA nothing, in the parent or in its forked ranks.

The CUDA host is simulated on the CPU: ``runtime.pick_device`` returns ``cuda:0`` (a device
object only), the compute measurement is replaced by fixed figures, ``torch.cuda``'s name and
properties are stubs, and any forked world (``run_world`` / ``measure_links``) fails the test.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from reference import tiny_config
from shardwise.launch import auto as autoplan
from shardwise.launch import calibrate
from shardwise.launch import torchrun as launch
from shardwise.run import runtime
from shardwise.launch import world as testing
from shardwise.planner import catalogue

pytestmark = pytest.mark.timeout(240)

FIXED = calibrate.Compute(threads=4, matmul_flops=50e12, model_flops=20e12,
                          block_overhead=1e-4, mem_bw=3e12, optimizer_bw=1e12)


def _no_fork(*args, **kwargs):
    raise AssertionError("a forked CPU gloo world was used to calibrate GPU links")


def simulate_cuda(monkeypatch, gpus: int, name: str = "NVIDIA H200"):
    monkeypatch.setattr(launch, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(runtime, "pick_device", lambda choice, rank, shared=False:
                        torch.device("cuda", rank))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(calibrate, "measure_compute", lambda *a, **k: FIXED)
    monkeypatch.setattr(calibrate, "measure_links", _no_fork)
    monkeypatch.setattr(testing, "run_world", _no_fork)


def _cfg(device: str = "cuda", batch: int = 8):
    cfg = tiny_config("auto", steps=3)
    return replace(cfg, train=replace(cfg.train, device=device, batch_size=batch))


def test_several_gpus_take_the_catalogue_links_and_say_so(monkeypatch):
    simulate_cuda(monkeypatch, 4)
    cal = calibrate.calibrate(_cfg())
    h200 = catalogue.accelerator("h200")
    assert cal.device == "cuda" and cal.processes == 4
    assert cal.allreduce_bw == h200.nvlink_bw
    assert cal.allreduce_latency == catalogue.INTERCONNECT_LATENCY["nvlink"]
    hw = cal.hardware(4)
    assert hw.interconnect == "nvlink" and hw.intra_bw == h200.nvlink_bw
    text = cal.describe()
    assert "the planner's catalogue (h200 over nvlink), not measured" in text, text
    assert "gloo" not in text, text
    # the plan the person reads names where the link figures come from
    said = []
    choice = autoplan.choose(_cfg(batch=16), cal, say=said.append)
    assert any("catalogue (h200 over nvlink)" in line for line in said), said
    assert choice.config.parallel.nproc_per_node <= 4


def test_a_pcie_gpu_and_an_unknown_gpu(monkeypatch):
    simulate_cuda(monkeypatch, 2, "NVIDIA H100 PCIe")
    cal = calibrate.calibrate(_cfg())
    assert cal.allreduce_bw == catalogue.accelerator("h100-80gb").pcie_bw
    assert cal.hardware(2).interconnect == "pcie"
    simulate_cuda(monkeypatch, 2, "NVIDIA L40S")            # not L4, not in the catalogue
    cal = calibrate.calibrate(_cfg())
    assert "'NVIDIA L40S' is not in the planner's catalogue" in cal.describe()
    assert cal.hardware(2).interconnect == "pcie" and cal.allreduce_bw > 0


def test_one_gpu_has_no_link_to_calibrate(monkeypatch):
    simulate_cuda(monkeypatch, 1)
    cal = calibrate.calibrate(_cfg("auto"))
    assert cal.processes == 1 and cal.allreduce_bw == 0.0
    assert "one GPU: no link to calibrate" in cal.describe()
    said = []
    choice = autoplan.choose(_cfg("auto"), cal, say=said.append)
    assert choice.config.parallel.strategy == "single"
    assert set(choice.alternatives) == {1}             # planned on the one GPU only


def test_cpu_calibration_on_a_gpu_host_asks_cuda_nothing(monkeypatch):
    """--device cpu on a (simulated) 4-GPU host: 2 processes (the CPU default), and neither the
    parent nor the forked ranks (which inherit these stubs) count or initialise CUDA."""
    def touched(name):
        def cuda_touched(*args, **kwargs):     # one object per name: dynamo maps each once
            raise AssertionError(f"{name} called during a --device cpu calibration")
        return cuda_touched
    monkeypatch.setattr(launch, "gpu_count", touched("gpu_count"))
    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
                 "set_device", "get_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, touched(f"torch.cuda.{name}"))
    cal = calibrate.calibrate(_cfg("cpu"))
    assert cal.device == "cpu" and cal.processes == 2
    assert cal.allreduce_bw > 0 and "allreduce over 2 processes (gloo)" in cal.describe()
