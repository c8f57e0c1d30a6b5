"""``--compile`` (shardwise/memory/compile.py, step 4b of parallel/compose.py): the same training
as without it, its compilation reported apart (``compile_seconds``), its kernels read back from
TorchInductor's on-disk cache by a later compile, and one clear line where it cannot run.

Every compile runs in a forked world (of 1 for ``single``), so that this pytest process never
starts Dynamo or Inductor's worker processes; all of them share one cache folder
(``TORCHINDUCTOR_CACHE_DIR``) made for this module.

Tolerance: fp32, rtol 1e-4 / atol 1e-5 on losses and parameters, with at most one element in a
thousand per tensor beyond it (``strays``): Inductor fuses and reorders floating-point work (the
layer norms' and softmax's sums, the fused GELU), so the last bits of the compiled block's
output differ from eager's; over a few Adam steps an element whose gradient is near zero can
turn that into a step of up to lr (tests/reference.py). A real fault (a block left untrained, a
gradient missing from the sync) moves whole tensors by far more.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from harness import assert_close_runs, run_world
from reference import tiny_config
from shardwise.cli import main

pytestmark = pytest.mark.timeout(600)
RTOL, ATOL = 1e-4, 1e-5
WHY = "fp32; Inductor fuses and reorders the block's floating-point work"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict:
    """The environment of every forked world here: one fresh Inductor cache folder."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}


def _cfg(strategy: str, compile: bool, ckpt: bool = False, **parallel):
    c = tiny_config(strategy, steps=4, **parallel)
    return replace(c, memory=replace(c.memory, compile=compile, activation_checkpointing=ckpt),
                   logging=replace(c.logging, schedule_png="off"))


def _train(cfg) -> tuple[list[float], dict, float | None]:
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    summary = train(cfg, init_runtime(cfg), quiet=True)
    return summary["losses"], summary["engine"].full_state_dict(), summary["compile_seconds"]


def _runs(rank, n, configs):
    return [_train(cfg) for cfg in configs]


def _fx_graphs(cache: dict) -> set[str]:
    """The compiled graphs Inductor's FX graph cache holds in ``cache``'s folder."""
    root = os.path.join(cache["TORCHINDUCTOR_CACHE_DIR"], "fxgraph")
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def _single_twice(rank, n, configs, cache):
    """Eager, compiled, then compiled again after Dynamo forgot everything it compiled in this
    process (as a new run would); the cache's graphs after each compile."""
    eager, compiled = _runs(rank, n, configs)
    first = _fx_graphs(cache)
    import torch._dynamo
    torch._dynamo.reset()
    again = _train(configs[1])
    return eager, compiled, again, first, _fx_graphs(cache)


def test_single_with_compile_equals_eager_and_reuses_the_cache(cache):
    configs = [_cfg("single", False), _cfg("single", True)]
    eager, compiled, again, first, second = run_world(_single_twice, 1, configs, cache,
                                                      env=cache, timeout=400)[0]
    assert_close_runs(compiled[0], eager[0], compiled[1], eager[1], RTOL, ATOL, WHY, strays=True)
    assert eager[2] is None                     # no --compile: nothing reported
    assert compiled[2] > 0                      # the first step compiled every block
    assert first and second == first            # the second compile wrote nothing: it read
    assert again[0] == compiled[0]              # every graph back, and the same kernels ran
    torch.testing.assert_close(again[1], compiled[1], rtol=0, atol=0)
    assert again[2] is not None and again[2] >= 0


@pytest.mark.slow   # 25-60 s (Inductor's first compile lands on whichever test runs first)
def test_zero3_with_checkpointing_and_a_pipeline_compile_in_a_world_of_two(cache):
    """ZeRO-3 gathers and frees each block around its compiled forward (its hooks stay eager),
    with activation checkpointing compiled inside; a GPipe pipeline of 2 compiles its stage's
    block. Eager checkpointing is bit-identical to none (test_memory_techniques.py), so one
    eager run is the reference for both compiled ZeRO-3 runs."""
    configs = [_cfg("zero3", False), _cfg("zero3", True, ckpt=True),
               _cfg("pp", False, pp=2), _cfg("pp", True, pp=2)]
    for rank, out in enumerate(run_world(_runs, 2, configs, env=cache, timeout=500)):
        for eager, compiled in ((out[0], out[1]), (out[2], out[3])):
            assert_close_runs(compiled[0], eager[0], compiled[1], eager[1], RTOL, ATOL,
                              f"{WHY}; rank {rank}", strays=True)
            assert eager[2] is None and compiled[2] > 0


def _refused(argv, capsys, field="memory.compile") -> str:
    code = main(["train", *argv, "--compile"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith(f"error: {field} = True") and "--compile" in err and "fix:" in err, err
    return err


def test_lenet_has_no_blocks_to_compile(capsys):
    assert "LeNet has none" in _refused(["--model", "lenet", "--dataset", "digits"], capsys)


def test_a_model_without_a_plan_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "plainnets.py").write_text(
        "import torch.nn as nn\n"
        "def build(cfg):\n"
        "    return nn.Sequential(nn.Embedding(cfg.vocab_size, 16), nn.Linear(16, cfg.vocab_size))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _refused(["--model", "plainnets:build", "--strategy", "single", "--dataset",
                    "synthetic"], capsys)
    assert "has no model plan" in err and "register_plan" in err


def test_no_cpp_compiler_is_one_line(capsys, monkeypatch):
    from torch._inductor import config as inductor_config
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/no/such/g++"))
    err = _refused(["--strategy", "single", "--device", "cpu"], capsys)
    assert "C++ compiler" in err and "/no/such/g++" in err
