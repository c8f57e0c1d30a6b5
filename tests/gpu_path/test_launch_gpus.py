"""One GPU per rank (issue 31): how many processes ``shardwise train`` starts on a GPU host, and
the refusal, before any process starts, of more ranks per node than visible GPUs (NCCL refuses
two ranks on one device, so such a run would fail at its first collective).

The GPU hosts here are simulated on the CPU: ``launch.gpu_count`` and ``torch.cuda``'s
``is_available`` / ``device_count`` / ``set_device`` / ``current_device`` are replaced; the
launch itself (``launch.relaunch``, ``ranks.train_here`` / ``train_rank``) is replaced by a
recorder, so nothing is started and no CUDA call reaches the driver.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from reference import tiny_config
from shardwise.launch import torchrun as launch
from shardwise.launch import ranks
from shardwise.run import runtime
from shardwise.cli import main
from shardwise.config import ConfigError

pytestmark = pytest.mark.timeout(120)

SMALL = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
         "--batch-size", "4", "--steps", "1", "--eval-batches", "1", "--dataset", "synthetic",
         "--no-progress"]


def simulate_gpus(monkeypatch, n: int) -> dict:
    """This process sees ``n`` CUDA devices (0: none); returns the simulated current device."""
    state = {"current": 0}

    def set_device(d):
        state["current"] = d if isinstance(d, int) else torch.device(d).index

    monkeypatch.setattr(launch, "gpu_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    return state


@pytest.fixture
def started(monkeypatch):
    """What would have started: [("torchrun", nproc)] or [("here", 1)] or [("rank", world)]."""
    calls = []
    monkeypatch.setattr(launch, "relaunch",
                        lambda nproc, *a, **k: calls.append(("torchrun", nproc)) or 0)
    monkeypatch.setattr(ranks, "train_here", lambda cfg, folder: calls.append(("here", 1)) or 0)
    monkeypatch.setattr(ranks, "train_rank", lambda cfg: calls.append(("rank", 0)) or 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return calls


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,names", [
    (["--nproc-per-node", "2", "--device", "cuda"], "parallel.nproc_per_node = 2"),
    (["--nproc-per-node", "2"], "parallel.nproc_per_node = 2"),          # auto: CUDA is present
    (["--strategy", "ddp", "--dp", "2", "--device", "cuda"], "parallel.dp = 2"),
    (["--strategy", "tp", "--tp", "2", "--device", "cuda"], "parallel.tp = 2"),
    (["--strategy", "ps", "--num-ps", "1", "--num-workers", "2", "--device", "cuda"],
     "parallel.num_workers = 2"),
    (["--strategy", "auto", "--nproc-per-node", "2", "--device", "cuda"],
     "parallel.nproc_per_node = 2"),
])
def test_more_ranks_than_gpus_is_refused_before_launch(argv, names, monkeypatch, started,
                                                       capsys, tmp_path):
    simulate_gpus(monkeypatch, 1)
    code = main(["train", *argv, *SMALL, "--out-dir", str(tmp_path)])
    err = one_line(capsys)
    assert code == 2 and started == []
    assert names in err and "1 CUDA device is visible" in err and "one GPU per rank" in err, err
    assert "fix:" in err and "or --device cpu" in err, err
    if "nproc_per_node" in names:
        assert "fix: --nproc-per-node 1, or --device cpu" in err, err


def test_as_many_ranks_as_gpus_launches(monkeypatch, started, tmp_path):
    simulate_gpus(monkeypatch, 2)
    assert main(["train", "--nproc-per-node", "2", "--device", "cuda", *SMALL,
                 "--out-dir", str(tmp_path)]) == 0
    assert started == [("torchrun", 2)]


def test_default_world_on_one_gpu_is_one_process(monkeypatch, started, tmp_path):
    """``shardwise train`` (ddp) on a one-GPU host: one rank on the GPU, in this process."""
    simulate_gpus(monkeypatch, 1)
    cfg = tiny_config("ddp")
    assert launch.local_world_size(replace(cfg, train=replace(cfg.train, device="auto"))) == 1
    assert main(["train", *SMALL, "--out-dir", str(tmp_path)]) == 0
    assert started == [("here", 1)]


def test_device_cpu_ignores_the_gpus(monkeypatch, started, tmp_path):
    """--device cpu on a 4-GPU host: the CPU default of 2 processes; the GPUs are not counted."""
    simulate_gpus(monkeypatch, 4)

    def no_count():
        raise AssertionError("gpu_count() consulted for a --device cpu run")
    monkeypatch.setattr(launch, "gpu_count", no_count)
    cfg = tiny_config("ddp")                        # device cpu, no process count set
    assert launch.local_world_size(cfg) == 2
    assert main(["train", "--device", "cpu", *SMALL, "--out-dir", str(tmp_path)]) == 0
    assert started == [("torchrun", 2)]
    # auto on the same host: one process per GPU
    simulate_gpus(monkeypatch, 4)
    auto = replace(cfg, train=replace(cfg.train, device="auto"))
    assert launch.local_world_size(auto) == 4


def test_under_a_launcher_more_local_ranks_than_gpus_is_refused(monkeypatch, started, capsys):
    simulate_gpus(monkeypatch, 1)
    world = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for k, v in world.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--device", "cuda", *SMALL]) == 2
    err = one_line(capsys)
    assert started == []
    assert "train.device = 'cuda'" in err and "2 ranks on this node" in err, err
    assert "fix: start at most 1 rank(s) per node (torchrun --nproc-per-node 1)" in err, err


def test_pick_device_refuses_a_local_rank_beyond_the_gpus(monkeypatch):
    state = simulate_gpus(monkeypatch, 1)
    assert runtime.pick_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(ConfigError) as exc:
        runtime.pick_device("cuda", 1)
    assert "train.device = 'cuda'" in str(exc.value) and "one GPU per rank" in str(exc.value)
    assert "--nproc-per-node 1" in str(exc.value)
    # a gloo world someone else started (a test harness): several ranks on one GPU, on purpose
    state["current"] = None
    assert runtime.pick_device("cuda", 1, shared_gpus=True) == torch.device("cuda", 0)
    # --device cpu never asks CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA asked"))
    assert runtime.pick_device("cpu", 3) == torch.device("cpu")


def test_init_runtime_under_a_launcher_refuses_before_the_process_group(monkeypatch):
    """torchrun --nproc-per-node 2 on one GPU: rank 1 stops with the one-line error, before
    init_process_group (where NCCL would fail, or wait for its peer)."""
    simulate_gpus(monkeypatch, 1)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **k: pytest.fail("init_process_group reached"))
    cfg = replace(tiny_config("ddp"), train=replace(tiny_config("ddp").train, device="cuda"))
    with pytest.raises(ConfigError, match="local rank 1 but 1 CUDA device"):
        runtime.init_runtime(cfg)


def test_a_world_someone_else_started(monkeypatch):
    """gloo (a harness sharing one GPU): local_rank % count, explicitly; NCCL without
    LOCAL_RANK: the GPU the starter bound the rank to, not GPU 0."""
    state = simulate_gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(runtime.Mesh, "build", staticmethod(lambda *sizes, **kw: sizes))  # no groups
    seen = []
    real = runtime.pick_device
    monkeypatch.setattr(runtime, "pick_device", lambda *a: seen.append(a) or real(*a))
    cfg = replace(tiny_config("ddp"), train=replace(tiny_config("ddp").train, device="cuda"))

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 1))   # init(device_id=cuda:1)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=bound))
    assert runtime.init_runtime(cfg).device == torch.device("cuda", 1)
    assert seen[-1] == ("cuda", 1, False)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setenv("LOCAL_RANK", "3")          # 4 ranks sharing 2 GPUs over gloo
    state["current"] = None
    assert runtime.init_runtime(cfg).device == torch.device("cuda", 1)
    assert seen[-1] == ("cuda", 3, True)


def test_real_process_exit_code_and_no_traceback(tmp_path):
    """The refusal from a real ``python -m shardwise.cli`` process: code 2, one stderr line,
    nothing launched (the one-GPU host simulated before the CLI runs)."""
    code = ("import sys, torch; from shardwise.launch import torchrun as launch; "
            "launch.gpu_count = lambda: 1; torch.cuda.is_available = lambda: True; "
            "torch.cuda.device_count = lambda: 1; from shardwise.cli import main; "
            f"sys.exit(main(['train', '--nproc-per-node', '2', '--device', 'cuda', "
            f"'--out-dir', {str(tmp_path)!r}]))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: parallel.nproc_per_node = 2: ") and \
        "fix: --nproc-per-node 1, or --device cpu" in done.stderr, done.stderr
    assert done.stdout == "" and os.listdir(tmp_path) == []
