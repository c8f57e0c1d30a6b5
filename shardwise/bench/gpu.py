"""The single-GPU part of ``shardwise bench``: GPT in bf16 on one CUDA device, its MFU, and what
each memory technique costs in time and saves in memory.

    python -m shardwise.bench.gpu --out DIR [--quick]     # what `shardwise bench` runs on CUDA

Cases, one after another in one process on device 0 (``shardwise.prepare``, the same engine
`shardwise train` drives; synthetic tokens; AdamW; bf16 autocast; SDPA attention, which is the
fused flash / memory-efficient kernel on CUDA in bf16; every block compiled with
``torch.compile`` (``nn.Module.compile``) unless the case says eager):

    eager            single, no compile (the baseline for compile's gain)
    compiled         single, compiled blocks
    checkpointing    + memory.activation_checkpointing
    adamw8bit        + train.optimizer adamw8bit
    zero1-offload    zero1, memory.offload cpu, in an NCCL world of 1
    ddp-nccl         ddp in an NCCL world of 1 (the NCCL code path, no peer to talk to)
    zero3-nccl       zero3 in an NCCL world of 1

Figures per case: tokens/s (median step after warm-up, each step ends with
``torch.cuda.synchronize``), MFU = tokens/s x 6 N (+ attention: 12 L T C) / the device's bf16
peak (shardwise.metrics.PEAK_FLOPS), and peak memory from ``torch.cuda.max_memory_allocated``
(reset before each case). The goal of issue 16: MFU >= 50% on H100 / H200 at 350M-1.3B.
Results: ``gpu.json`` in DIR (the report reads it). On a machine without CUDA the part prints one
line and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {"350m": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
         "1.3b": {"n_layer": 24, "n_embd": 2048, "n_head": 16}}
CASES = {  # name: (strategy, compile, sections of the config to override)
    "eager": ("single", False, {}),
    "compiled": ("single", True, {}),
    "checkpointing": ("single", True, {"memory": {"activation_checkpointing": True}}),
    "adamw8bit": ("single", True, {"train": {"optimizer": "adamw8bit"}}),
    "zero1-offload": ("zero1", True, {"memory": {"offload": "cpu"}}),
    "ddp-nccl": ("ddp", True, {}),
    "zero3-nccl": ("zero3", True, {}),
}
SKIPPED = "gpu part: skipped (no CUDA device: torch.cuda.is_available() is False)"


def run_gpu_part(out_dir: str, quick: bool = False) -> str | None:
    """From `shardwise bench`: run this module in a child process (the runner itself stays off
    CUDA, so its forked CPU worlds keep working); the path of gpu.json, or None on CPU."""
    import torch
    if not torch.cuda.is_available():
        print(SKIPPED, flush=True)
        return None
    cmd = [sys.executable, "-m", "shardwise.bench.gpu", "--out", out_dir] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, timeout=3600)
    if done.returncode != 0:
        print(f"gpu part: failed (exit {done.returncode}); its output is above", flush=True)
        return None
    return os.path.join(out_dir, "gpu.json")


def _config(size: str, strategy: str, sections: dict, steps: int, batch: int):
    from shardwise.bench.harness import gpt_bench_config
    model = {**SIZES[size], "block_size": 1024, "vocab_size": 50304}
    merged = {"model": model, "memory": {"mixed_precision": "bf16"},
              "train": {"steps": steps, "batch_size": batch, "device": "cuda", "lr": 3e-4}}
    for key, values in sections.items():
        merged[key] = {**merged.get(key, {}), **values}
    return gpt_bench_config(strategy, **merged)


def _nccl_world_of_one() -> None:
    """A process group of this process alone on NCCL (init_runtime then uses it)."""
    import tempfile
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="shardwise-gpu-"), "rendezvous")
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))


def flops_per_token(model, cfg) -> float:
    """6 N for the dense layers (forward + backward) + 12 L T C for attention (PaLM, app. B)."""
    n = sum(p.numel() for p in model.parameters())
    m = cfg.model
    return 6 * n + 12 * m.n_layer * m.block_size * m.n_embd


def run_case(name: str, size: str, steps: int, batch: int) -> dict:
    """One case on device 0; its tokens/s, MFU and CUDA peak memory."""
    import torch
    import shardwise
    from shardwise.api import optimizer_factory
    from shardwise.data import build_data
    from shardwise.metrics import device_peak_flops, peak_memory_bytes
    from shardwise.models import build_model, lm_loss
    from shardwise.runtime import init_runtime
    strategy, compiled, sections = CASES[name]
    cfg = _config(size, strategy, sections, steps, batch)
    if strategy != "single":
        _nccl_world_of_one()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rt = init_runtime(cfg)
    model = build_model(cfg.model, cfg.train.seed)
    fpt = flops_per_token(model, cfg)
    if compiled:
        for block in model.blocks:
            block.compile()
    engine = shardwise.prepare(model, optimizer_factory(cfg), cfg, loss_fn=lm_loss, runtime=rt)
    data = build_data(cfg)
    times = []
    for step in range(steps):
        x, y = data.batch(step, batch, *engine.strategy.data_shard())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.train_step(x.to(rt.device), y.to(rt.device))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[min(3, steps - 1):]      # compilation and allocation happen in the first steps
    rate = batch * cfg.model.block_size / statistics.median(steady)
    peak = device_peak_flops(rt.device)
    out = {"case": name, "size": size, "strategy": strategy, "compiled": compiled,
           "tokens_per_s": rate, "step_seconds": statistics.median(steady),
           "first_step_seconds": times[0], "flops_per_token": fpt,
           "mfu": rate * fpt / peak if peak else None,
           "peak_memory": peak_memory_bytes(rt.device), "params": sum(
               p.numel() for p in model.parameters()), "batch": batch, "steps": steps}
    engine.close()
    del engine, model
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu.json")
    ap.add_argument("--quick", action="store_true", help="350M only, fewer steps")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(SKIPPED)
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        print(f"error: --cases: {bad} unknown; fix: pick from {list(CASES)}", file=sys.stderr)
        return 2
    sizes, steps = (["350m"], 8) if args.quick else (["350m", "1.3b"], 20)
    results = []
    for size in sizes:
        for name in cases:
            try:
                r = run_case(name, size, steps, batch=8)
            except Exception as exc:      # one failing case (e.g. out of memory) is reported
                r = {"case": name, "size": size, "error": f"{type(exc).__name__}: {exc}"}
            results.append(r)
            print(json.dumps(r), flush=True)
    from shardwise.bench.run import machine
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu.json"), "w") as fh:
        json.dump({"machine": machine(), "device": torch.cuda.get_device_name(0),
                   "goal": "MFU >= 50% on H100 / H200 at 350M-1.3B", "cases": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
