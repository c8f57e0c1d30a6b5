"""Peak memory per rank of every data-parallel stage against PyTorch's own, in one run.

    python -m shardwise.bench.memory                   # table on stdout, JSON to a temp folder
    python -m shardwise.bench.memory --steps 4 --out /tmp/mem
    python -m shardwise.bench.memory --save            # shardwise/bench/results/memory-57m.json

The model is shardwise's GPT at 8 layers x 768 (12 heads, seq 128, byte vocabulary: 57.0M
parameters, 228 MB in fp32), trained with AdamW in fp32 for a few steps at world 2 (global
batch 4). Sides: shardwise ddp, zero1, zero2, zero3; torch DDP; torch FSDP2 (``fully_shard`` on
each block, then the root). Each side runs in its own fresh forked gloo world.

Measuring memory on CPU: glibc keeps freed memory for reuse, so peak RSS would read the same for
every side. Each process first sets ``mallopt(M_MMAP_THRESHOLD, 131072)`` (what
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment does): blocks of 128 KiB or more are mapped
on their own and go back to the OS when freed, so RSS tracks live bytes. ``peak`` is
``ru_maxrss``; ``baseline`` is the resident memory after torch is imported, the process group
is up, the data is loaded and a first torch.optim optimizer has been built (it imports
torch._dynamo, ~74 MiB that every side pays and no ledger holds), before the model is built;
``peak - baseline`` is what the training state cost (plus what the process's first kernels
fault in: thread pools, code pages), which is what a side's ledger should account for; ``ledger / (peak - baseline)`` is reported per side.

Ledgers. Ours: ``strategy.memory_ledger()`` (shardwise/parallel/data/zero.py). The torch
sides get one computed from the torch objects by :class:`TorchLedger`, same categories, bytes
per rank:

    parameters        the module's parameters as this rank stores them (FSDP2: the local
                      shards of its DTensor parameters; DDP: the whole tensors)
    gradients         ``p.grad`` right after backward (the largest over the steps; FSDP2: local
                      shards of the reduced gradients)
    optimizer_states  AdamW's exp_avg / exp_avg_sq (local shards for FSDP2)
    master_weights    0 (fp32 training: no separate copy)
    comm_buffers      derived from each implementation's schedule, not measured (their buffers
                      are not visible from Python). DDP: its reducer's gradient buckets, a flat
                      copy of every gradient (``gradient_as_bucket_view=False``, the default).
                      FSDP2 on CPU (blocking collectives): 3 U + R, U = the largest unit's
                      unsharded bytes, R = the root's: during a block's backward the block in
                      use, the block prefetched before it and the block's unsharded gradients
                      (or, during its reduce-scatter, its flat input and gloo's whole-size copy
                      of it, beside the prefetched block)
    activations_peak  distinct storages autograd saved in one forward, parameters (and FSDP2's
                      unsharded parameters) excluded, via saved_tensors_hooks as
                      shardwise/parallel/ledger.py (ours also samples the peak instant there)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
from shardwise.config.names import ZERO_STRATEGIES, Strategy
from shardwise.bench.peers import same_optimizer
from shardwise.run.allocator import track_live_bytes

MODEL = {"n_layer": 8, "n_embd": 768, "n_head": 12, "block_size": 128, "vocab_size": 256}
SIDES = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3, "torch-ddp", "fsdp2")
MiB = 2 ** 20


def _rss_now() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm_now() -> int:
    """This process's resident high-water mark so far (VmHWM), bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _cfg(strategy: str, steps: int, batch: int):
    from shardwise.bench.harness import gpt_bench_config
    return gpt_bench_config(strategy, model=MODEL, train={"steps": steps, "batch_size": batch})


class RssSampler:
    """The largest resident memory seen by a thread that reads /proc/self/statm every
    ``interval`` seconds while it runs (the peak of one phase, e.g. training after ``prepare``:
    ru_maxrss holds the whole process's peak and cannot be split; a spike shorter than the
    interval can be missed)."""

    def __init__(self, interval: float = 0.002):
        import threading
        self.peak, self.interval = _rss_now(), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as fh:
            while not self._stop.wait(self.interval):
                fh.seek(0)
                self.peak = max(self.peak, int(fh.read().split()[1]) * page)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_now())


def side(rank: int, world: int, kind: str, steps: int = 4, batch: int = 4,
         memory: dict | None = None, init: str = "eager") -> dict:
    """Train ``kind`` for ``steps``; this rank's baseline, peak RSS, ledger and tokens/s.
    ``memory``: MemoryConfig fields for ours (e.g. offload); ``peak_prepare`` is the resident
    high-water mark when the model is built and prepared, ``peak_train`` the largest resident
    memory sampled while it trains (:class:`RssSampler`). ``init``: how ours builds the model
    ("meta": as ``shardwise train`` does by default, each rank materialising only what it
    keeps; "eager": whole on every rank first, as torch's sides do)."""
    track_live_bytes()      # freed blocks of 128 KiB or more return to the OS
    from dataclasses import replace
    from shardwise.bench.harness import threads_for, timed_steps
    from shardwise.data import build_data
    from shardwise.models import build_model, lm_loss
    threads_for(world)
    ours = kind in (Strategy.DDP, *ZERO_STRATEGIES)
    cfg = _cfg(kind if ours else Strategy.SINGLE, steps, batch)
    cfg = replace(cfg, memory=replace(cfg.memory, **(memory or {})))
    # what every side pays before it holds any training state: the data, and the modules the
    # first torch.optim optimizer imports (torch._dynamo: ~74 MiB of resident code and data)
    data = build_data(cfg)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    baseline = _rss_now()
    model = build_model(cfg.model, cfg.train.seed, init=init if ours else "eager")
    params = sum(p.numel() for p in model.parameters())
    ledger, per = None, batch // world
    state = {"step": 0}
    if kind in (Strategy.DDP, *ZERO_STRATEGIES):
        import shardwise
        from shardwise.run.api import optimizer_factory
        from shardwise.run.runtime import init_runtime
        engine = shardwise.prepare(model, optimizer_factory(cfg), cfg, loss_fn=lm_loss,
                                   runtime=init_runtime(cfg))

        def step():
            x, y = data.batch(state["step"], batch, rank, world)
            state["step"] += 1
            engine.train_step(x, y)
    else:
        if kind == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = same_optimizer(cfg, model.parameters())
        book = TorchLedger(kind, model, opt)

        def step():
            x, y = data.batch(state["step"], batch, rank, world)
            state["step"] += 1
            lm_loss(book.forward(x), y).backward()
            book.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    prepared = _hwm_now()
    sampler = RssSampler()
    seconds = timed_steps(step, max(1, steps - 1), warmup=1)
    trained = sampler.stop()
    if kind in (Strategy.DDP, *ZERO_STRATEGIES):
        ledger = engine.strategy.memory_ledger()
        instant = engine.strategy.memory_at_peak()     # sampled at the peak (parallel/ledger.py)
        engine.close()
    else:
        ledger = book.ledger()
        instant = None                                 # torch's buffers are not visible: modelled
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "params": params, "baseline": baseline, "peak": peak,
            "peak_prepare": prepared, "peak_train": trained,
            "ledger": ledger, "ledger_instant": instant,
            "items_per_s": batch * cfg.model.block_size / seconds,
            "rows_per_rank": per}


def _local_bytes(tensors) -> int:
    """Bytes this rank stores of each tensor (a DTensor's local shard)."""
    out = 0
    for t in tensors:
        if t is not None:
            t = getattr(t, "_local_tensor", t)
            out += t.numel() * t.element_size()
    return out


class TorchLedger:
    """The ledger of a torch DDP / FSDP2 side (categories: the module docstring)."""

    def __init__(self, kind: str, model, opt):
        self.kind, self.model, self.opt = kind, model, opt
        self.grads = self.acts = 0

    def forward(self, x):
        seen: dict[int, int] = {}

        def pack(t):      # FSDP2 swaps its unsharded parameters in during forward: look now
            s = t.untyped_storage()
            if s._cdata not in {p.untyped_storage()._cdata for p in self.model.parameters()}:
                seen[s._cdata] = s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.model(x)
        self.acts = max(self.acts, sum(seen.values()))
        return out

    def after_backward(self) -> None:
        self.grads = max(self.grads, _local_bytes(p.grad for p in self.model.parameters()))

    def ledger(self) -> dict[str, int]:
        params = list(self.model.parameters())
        states = [v for st in self.opt.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0]
        if self.kind == "torch-ddp":
            comm = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        else:
            def full(m):
                return sum(p.numel() * p.element_size() for p in m.parameters())
            root = full(self.model) - sum(full(b) for b in self.model.blocks)
            comm = 3 * max(full(b) for b in self.model.blocks) + root
        return {"parameters": _local_bytes(params), "gradients": self.grads,
                "optimizer_states": _local_bytes(states), "master_weights": 0,
                "comm_buffers": comm, "activations_peak": self.acts, "on_disk": 0}


TRANSIENT = ("comm_buffers", "activations_peak")


def ledger_total(ledger: dict | None) -> int | None:
    """Every category added up: each is its own high-water mark, so this over-reads when they
    peak at different moments."""
    if ledger is None:
        return None
    return sum(v for k, v in ledger.items() if k != "on_disk")


def ledger_at_peak(ledger: dict | None, instant: dict | None = None) -> int | None:
    """What the ledger says the peak holds. Ours: ``instant``, the ledger sampled at the instant
    saved activations + transient buffers peaked together (shardwise/parallel/ledger.py), added
    up. Torch's sides (no instant: their buffers are not visible from Python): a model, the
    state that lives through the step plus the larger of the two transients (saved activations
    peak at the end of forward, before any gradient buffer exists; communication buffers peak
    in backward and after the step, when most activations are freed)."""
    if instant is not None:
        return ledger_total(instant)
    if ledger is None:
        return None
    steady = sum(v for k, v in ledger.items() if k not in TRANSIENT and k != "on_disk")
    return steady + max(ledger.get(k, 0) for k in TRANSIENT)


def measure(steps: int, batch: int, world: int = 2) -> dict:
    from shardwise.launch.world import run_world
    out = {}
    for kind in SIDES:
        ranks = run_world(side, world, kind, steps, batch, timeout=1800)
        worst = max(ranks, key=lambda r: r["peak"])
        out[kind] = {**worst, "peak_per_rank": [r["peak"] for r in ranks],
                     "ledger_total": ledger_total(worst["ledger"]),
                     "ledger_at_peak": ledger_at_peak(worst["ledger"], worst["ledger_instant"])}
        print(f"{kind:10s} peak {worst['peak'] / MiB:8,.0f} MiB  baseline "
              f"{worst['baseline'] / MiB:6,.0f} MiB", flush=True)
    return out


def table(res: dict) -> str:
    ddp, fsdp = res["torch-ddp"]["peak"], res["fsdp2"]["peak"]
    lines = ["| side | peak RSS / rank (MiB) | vs torch DDP | vs FSDP2 | peak - baseline (MiB) "
             "| ledger sum (MiB) | sum / used | ledger at peak (MiB) | at peak / used | at peak is |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    names = {Strategy.DDP: "shardwise DDP", Strategy.ZERO1: "shardwise ZeRO-1",
             Strategy.ZERO2: "shardwise ZeRO-2", Strategy.ZERO3: "shardwise ZeRO-3",
             "torch-ddp": "torch DDP", "fsdp2": "torch FSDP2"}
    for kind in SIDES:
        r = res[kind]
        used = r["peak"] - r["baseline"]
        led = ledger_total(r["ledger"])
        at = ledger_at_peak(r["ledger"], r.get("ledger_instant"))
        lines.append(f"| {names[kind]} | {r['peak'] / MiB:,.0f} | {r['peak'] / ddp:.2f} | "
                     f"{r['peak'] / fsdp:.2f} | {used / MiB:,.0f} | "
                     + (f"{led / MiB:,.0f} | {led / used:.2f} | {at / MiB:,.0f} | "
                        f"{at / used:.2f} | " + ("sampled" if r.get("ledger_instant") else "modelled")
                        + " |" if led else "- | - | - | - | - |"))
    return "\n".join(lines)


def cli_args(prog: str, doc: str, argv: list[str] | None):
    """The options every 57M memory benchmark takes (this one and shardwise/bench/techniques.py)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--reps", type=int, default=1,
                    help="passes over every side, alternated (A B C .. A B C); medians reported")
    ap.add_argument("--out", default="", help="folder for the results (default: a temp dir)")
    ap.add_argument("--save", action="store_true", help="write to shardwise/bench/results/")
    return ap.parse_args(argv)


def write_results(out_dir: str, name: str, args, res: dict, text: str) -> str:
    """``<out_dir>/<name>.json``: the model, the run's settings, the machine, the sides, the table."""
    from shardwise.bench.run import machine
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as fh:
        json.dump({"model": MODEL, "steps": args.steps, "batch": args.batch, "world": 2,
                   "reps": getattr(args, "reps", 1),
                   "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "sides": res, "table": text}, fh, indent=2)
    print(f"results: {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    args = cli_args("python -m shardwise.bench.memory", __doc__, argv)
    from shardwise.bench.run import results_dir
    res = measure(args.steps, args.batch)
    print(table(res))
    write_results(results_dir(args), "memory-57m", args, res, table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
