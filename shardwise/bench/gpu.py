"""The single-GPU part of ``shardwise bench``: our GPT in bf16 on one CUDA device, against a plain
PyTorch training loop (or PyTorch's own DDP / FSDP2) of the same model and settings, run in the
same process, alternately.

    python -m shardwise.bench.gpu --out DIR [--quick] [--sizes 350m,1.3b] [--cases ...]
    scripts/gpu_check.sh                      # the GPU suite, then this

Every run: our GPT (``shardwise.models.build_model``, tied embeddings, SDPA attention, which is
the fused flash kernel on CUDA in bf16), block size 1024, vocabulary 50304, synthetic tokens,
AdamW (betas 0.9 / 0.95, ``fused`` on CUDA: shardwise.run.api.optimizer_factory), bf16 autocast over
fp32 parameters, every block's forward compiled with ``torch.compile`` unless the case is ``eager``. Cases (shardwise side, and its peer):

    eager            single, no compile              | the plain loop, no compile
    compiled         single                          | the plain loop
    checkpointing    + memory.activation_checkpointing | the plain loop + PyTorch's checkpoint_wrapper
    adamw8bit        + train.optimizer adamw8bit     | none (PyTorch has no 8-bit Adam)
    zero1-offload    zero1, memory.offload cpu        | none
    ddp-nccl         ddp, NCCL world of 1             | torch DDP, NCCL world of 1
    zero3-nccl       zero3, NCCL world of 1           | FSDP2 (fully_shard per block), NCCL world of 1

A case with a peer runs peer, shardwise, peer, shardwise ... (``--reps`` pairs; A B A B: the GPU's
clocks and caches drift over a run) and reports the ratio of the medians. Each run: ``--steps``
steps, the first 4 untimed (compilation, allocator warm-up, the ledger's sampled forwards), each timed step ends with
``torch.cuda.synchronize``; tokens/s = rows x 1024 / median step; MFU = tokens/s x (6 N +
12 L T C) / the device's dense bf16 peak (shardwise.run.metrics.PEAK_FLOPS: 989 TFLOP/s for H100 and
H200; N counts the tied embedding once, as the head's matmul uses it). Memory: the peak of
``torch.cuda.max_memory_allocated`` over the run less what was allocated before it, and for
shardwise's runs the memory ledger at its peak instant (``memory_at_peak``, the bytes the
strategy accounts on the device) with its gap to that peak.

Results: one JSON per run in DIR/rows/ and all of them in DIR/gpu.json, each carrying the GPU's
name, the driver, torch and CUDA versions, the commit, a dirty flag and the date. ``--device cpu``
runs the same code on a tiny model on the CPU, to check the script on a machine without a GPU;
its figures mean nothing. On a machine without CUDA (and without ``--device cpu``) the part
prints one line and writes nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from shardwise.config.names import Strategy

SIZES = {"350m": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
         "1.3b": {"n_layer": 24, "n_embd": 2048, "n_head": 16},
         "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2}}       # --device cpu only
CASES = {  # name: (strategy, compile, config sections to override, peer or None)
    "eager": (Strategy.SINGLE, False, {}, "loop"),
    "compiled": (Strategy.SINGLE, True, {}, "loop"),
    "checkpointing": (Strategy.SINGLE, True, {"memory": {"activation_checkpointing": True}},
                      "loop-ckpt"),
    "adamw8bit": (Strategy.SINGLE, True, {"train": {"optimizer": "adamw8bit"}}, None),
    "zero1-offload": (Strategy.ZERO1, True, {"memory": {"offload": "cpu"}}, None),
    "ddp-nccl": (Strategy.DDP, True, {}, "torch-ddp"),
    "zero3-nccl": (Strategy.ZERO3, True, {}, "fsdp2"),
}
SKIPPED = "gpu part: skipped (no CUDA device: torch.cuda.is_available() is False)"
WARMUP = 4      # untimed: compilation, allocator warm-up, the ledger's 3 sampled forwards


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


# -- where and when ---------------------------------------------------------------------------
def provenance(device) -> dict:
    """The GPU, driver, software, commit (and whether the checkout had uncommitted changes)."""
    import torch
    from shardwise.bench.run import machine
    out = machine()          # commit and dirty flag included (SHARDWISE_COMMIT / _DIRTY win)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda_runtime"] = torch.version.cuda
        out["driver"] = _nvidia_smi("driver_version")
    return out


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


# -- one run ----------------------------------------------------------------------------------
def config(size: str, case: str, steps: int, batch: int, device: str):
    from shardwise.bench.harness import gpt_bench_config
    strategy, _, sections, _ = CASES[case]
    model = {**SIZES[size], "block_size": 1024 if size != "tiny" else 64,
             "vocab_size": 50304 if size != "tiny" else 256}
    merged = {"model": model, "memory": {"mixed_precision": "bf16"},
              "train": {"steps": steps, "batch_size": batch, "device": device, "lr": 3e-4}}
    for key, values in sections.items():
        merged[key] = {**merged.get(key, {}), **values}
    return gpt_bench_config(strategy, **merged)


def world_of_one(device) -> None:
    """A process group of this process alone (NCCL on a GPU), for the cases that need one."""
    import tempfile
    import torch.distributed as dist
    if dist.is_initialized():
        return
    path = os.path.join(tempfile.mkdtemp(prefix="shardwise-gpu-"), "rendezvous")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{path}", rank=0, world_size=1, **kwargs)


def flops_per_token(model, cfg) -> float:
    """6 N for the dense layers (forward + backward) + 12 L T C for attention (PaLM, app. B)."""
    n = sum(p.numel() for p in model.parameters())
    m = cfg.model
    return 6 * n + 12 * m.n_layer * m.block_size * m.n_embd


def compile_blocks(model) -> None:
    """``torch.compile`` each block's forward (the same on both sides). The forward, not the
    module: hooks that a strategy puts on a block (ZeRO-3's gathers, FSDP2's) stay outside the
    compiled graph."""
    import torch
    for block in model.blocks:
        block.forward = torch.compile(block.forward)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clean(device) -> int:
    """Free what the last run left; the bytes still allocated (this run's baseline)."""
    import torch
    gc.collect()
    if device.type != "cuda":
        return 0
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _timed(step, batches, device) -> list[float]:
    times = []
    for x, y in batches:
        _sync(device)
        t0 = time.perf_counter()
        step(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _batches(cfg, steps, device):
    from shardwise.data import build_data
    data = build_data(cfg)
    return [tuple(t.to(device) for t in data.batch(s, cfg.train.batch_size, 0, 1))
            for s in range(steps)]


def run_shardwise(cfg, compiled: bool, device) -> dict:
    """shardwise.prepare, the engine `shardwise train` drives."""
    import torch
    import shardwise
    from shardwise.run.api import optimizer_factory
    from shardwise.models import build_model, lm_loss
    from shardwise.run.runtime import init_runtime
    if cfg.parallel.strategy != Strategy.SINGLE:
        world_of_one(device)
    base = _clean(device)
    rt = init_runtime(cfg)
    model = build_model(cfg.model, cfg.train.seed)
    fpt = flops_per_token(model, cfg)
    if compiled:
        compile_blocks(model)
    engine = shardwise.prepare(model, optimizer_factory(cfg), cfg, loss_fn=lm_loss, runtime=rt)
    times = _timed(engine.train_step, _batches(cfg, cfg.train.steps, rt.device), rt.device)
    ledger = engine.strategy.memory_at_peak()
    out = {"impl": "shardwise", "flops_per_token": fpt, "times": times,
           "peak_memory": _peak(device) - base, "ledger": ledger,
           "params": sum(p.numel() for p in model.parameters())}
    engine.close()
    del engine, model
    return out


def run_peer(cfg, compiled: bool, peer: str, device) -> dict:
    """The plain PyTorch loop a user writes for the same model and settings (or DDP / FSDP2)."""
    import torch
    from shardwise.run.api import optimizer_factory
    from shardwise.models import build_model, lm_loss
    if peer in ("torch-ddp", "fsdp2"):
        world_of_one(device)
    base = _clean(device)
    model = build_model(cfg.model, cfg.train.seed).to(device)
    fpt = flops_per_token(model, cfg)
    if compiled:
        compile_blocks(model)
    if peer == "loop-ckpt":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing)
        blocks = set(model.blocks)
        apply_activation_checkpointing(model, check_fn=lambda m: m in blocks)
    if peer == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    elif peer == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = optimizer_factory(cfg)(list(model.parameters()))

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    times = _timed(step, _batches(cfg, cfg.train.steps, device), device)
    out = {"impl": f"pytorch ({peer})", "flops_per_token": fpt, "times": times,
           "peak_memory": _peak(device) - base}
    del model, opt
    return out


def _peak(device) -> int:
    import torch
    from shardwise.run.metrics import peak_memory_bytes
    return peak_memory_bytes(device) if device.type == "cuda" else 0


def figures(run: dict, cfg, device) -> dict:
    """Median step, tokens/s, MFU, the spread of the timed steps, the ledger's gap."""
    import torch
    from shardwise.run.metrics import device_peak_flops
    steady = run.pop("times")[WARMUP:]
    step = statistics.median(steady)
    rate = cfg.train.batch_size * cfg.model.block_size / step
    peak = device_peak_flops(torch.device(device))
    out = {**run, "step_seconds": step, "step_min": min(steady), "step_max": max(steady),
           "tokens_per_s": rate, "mfu": rate * run["flops_per_token"] / peak if peak else None}
    if "ledger" in run:
        total = sum(v for k, v in run["ledger"].items() if k != "on_disk")
        off = (run["ledger"].get("master_weights", 0) + run["ledger"].get("optimizer_states", 0)
               if cfg.memory.offload == "cpu" else 0)      # held in host memory, not the GPU's
        out["ledger_device_bytes"] = total - off
        if run["peak_memory"]:
            out["ledger_gap"] = (total - off) / run["peak_memory"] - 1
    return out


# -- the part ---------------------------------------------------------------------------------
OFFLOAD_STEPS = 6      # the optimizer steps on the host: seconds a step at 1.3B


def run_case(size: str, case: str, steps: int, batch: int, reps: int, device, emit,
             deadline: float = float("inf")) -> None:
    """``reps`` alternating pairs (peer, shardwise) of one case, or ``reps`` shardwise runs
    without a peer; each run emitted as a row. No run starts after ``deadline`` (monotonic
    seconds): it is emitted as skipped."""
    strategy, compiled, _, peer = CASES[case]
    steps = min(steps, OFFLOAD_STEPS) if "offload" in case else steps
    cfg = config(size, case, steps, batch, device.type)
    order = ["peer", "shardwise"] * reps if peer else ["shardwise"] * reps
    for i, side in enumerate(order):
        t0 = time.perf_counter()
        if time.monotonic() > deadline:
            emit({"case": case, "size": size, "strategy": strategy, "compiled": compiled,
                  "rep": i // (2 if peer else 1), "impl": side, "skipped": "--budget-s spent"})
            continue
        try:
            run = run_shardwise(cfg, compiled, device) if side == "shardwise" else \
                run_peer(cfg, compiled, peer, device)
            row = figures(run, cfg, device.type)
        except Exception as exc:        # one failing run (out of memory, say) is reported
            row = {"impl": side, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        emit({"case": case, "size": size, "strategy": strategy, "compiled": compiled,
              "rep": i // (2 if peer else 1), "batch": batch, "steps": steps,
              "wall_seconds": time.perf_counter() - t0, **row})


def ratios(rows: list[dict]) -> list[dict]:
    """Per (size, case) with a peer: the medians of each side's tokens/s and their ratio."""
    out = []
    for key in sorted({(r["size"], r["case"]) for r in rows}):
        mine = [r["tokens_per_s"] for r in rows if (r["size"], r["case"]) == key
                and r.get("impl") == "shardwise" and "tokens_per_s" in r]
        peer = [r["tokens_per_s"] for r in rows if (r["size"], r["case"]) == key
                and str(r.get("impl", "")).startswith("pytorch") and "tokens_per_s" in r]
        if mine and peer:
            out.append({"size": key[0], "case": key[1], "shardwise_tokens_per_s": statistics.median(mine),
                        "pytorch_tokens_per_s": statistics.median(peer),
                        "ratio": statistics.median(mine) / statistics.median(peer),
                        "runs": [len(mine), len(peer)]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu.json and rows/")
    ap.add_argument("--quick", action="store_true", help="350M only, 8 steps, one pair per case")
    ap.add_argument("--sizes", default="350m,1.3b", help=f"comma-separated, of {list(SIZES)[:2]}")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    ap.add_argument("--steps", type=int, default=12, help=f"steps per run (the first {WARMUP} untimed)")
    ap.add_argument("--batch", type=int, default=16, help="rows of 1024 tokens per step")
    ap.add_argument("--reps", type=int, default=1, help="peer / shardwise pairs per case")
    ap.add_argument("--reps-for", default="compiled",
                    help="cases that get --reps pairs; the others get one (comma-separated)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run after this many seconds (0: no limit); later runs are "
                         "listed as skipped")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a tiny model on the CPU, to check this script without a GPU")
    args = ap.parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print(SKIPPED)
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    sizes = ["tiny"] if args.device == "cpu" else (
        ["350m"] if args.quick else [s.strip() for s in args.sizes.split(",") if s.strip()])
    bad = [c for c in cases if c not in CASES] + [s for s in sizes if s not in SIZES]
    if bad or args.steps <= WARMUP or args.batch < 1 or args.reps < 1:
        print(f"error: --cases / --sizes / --steps / --batch / --reps: {bad or 'out of range'}; "
              f"fix: cases of {list(CASES)}, sizes of {list(SIZES)[:2]}, --steps > {WARMUP}, "
              "--batch and --reps >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    where = provenance(device)
    rows: list[dict] = []
    os.makedirs(os.path.join(args.out, "rows"), exist_ok=True)

    def emit(row: dict) -> None:
        row = {**row, "machine": where}
        rows.append(row)
        name = f"{row['size']}-{row['case']}-{row['rep']}-{row['impl'].split()[0]}.json"
        row["file"] = f"rows/{name}"
        with open(os.path.join(args.out, "rows", name), "w") as fh:
            json.dump(row, fh, indent=2)
        print(json.dumps({k: v for k, v in row.items() if k not in ("machine", "ledger")}),
              flush=True)
    steps = 8 if args.quick else args.steps
    reps_for = {c.strip() for c in args.reps_for.split(",")}
    deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else float("inf")
    for size in sizes:
        for case in cases:
            run_case(size, case, steps, args.batch, args.reps if case in reps_for else 1,
                     device, emit, deadline)
    with open(os.path.join(args.out, "gpu.json"), "w") as fh:
        json.dump({"machine": where, "device": where.get("gpu", "cpu"),
                   "goal": "MFU >= 45% (goal 50%) at 1.3B in bf16; >= 1.0x the plain PyTorch "
                           "loop's tokens/s; the ledger within 10% of max_memory_allocated",
                   "ratios": ratios(rows), "cases": rows}, fh, indent=2)
    for r in ratios(rows):
        print(f"{r['size']:>5} {r['case']:<14} shardwise / pytorch tokens/s = {r['ratio']:.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
