"""The largest GPT each side trains for 3 steps at world 2 inside a memory limit (``largest-model``).

    python -m shardwise.bench.largest_model --save                 # limit 8 GiB, every side
    python -m shardwise.bench.largest_model --memory-limit 4GiB --sides zero3 fsdp2
    python -m shardwise.bench.largest_model --trial fsdp2 --width 512   # one size, one side

Sides (all at world 2, fp32 weights, AdamW, sequence 64, batch 2, ``--n-layer`` blocks):

    zero3               shardwise train --strategy zero3 (meta-device init)
    zero3-offload-disk  + --offload disk --offload-params (ZeRO-Infinity: state on disk)
    fsdp2               torch FSDP2: fully_shard per block and the root, built on the meta device
                        then ``to_empty`` (FSDP2's own way to train what one rank cannot build)
    fsdp2-cpu-offload   + CPUOffloadPolicy (tried: on a CPU host, where it cannot run, the
                        row says so with torch's own error)

Each trial runs in a memory cgroup of its own (``memory.limit_in_bytes``, cgroup v1 or v2's
``memory.max``) so that running out of memory kills that trial only, never the machine's other
work; a trial fits when the run exits 0 after its 3 steps with a finite loss, and no process of
it was killed by the cgroup's OOM killer. The search per side doubles the width (``n_embd``,
64 per head) from ``--start-width`` until a trial fails, then bisects in steps of
``--resolution`` (a multiple of 64) between the last fit and the first failure. A trial that runs
past ``--trial-seconds`` counts as "too slow" (the cap keeps the bench bounded; the row says it),
and so does a size whose training state would not fit in the offload folder's free space.

Reported per side: the largest fitting width, its parameters and training-state bytes (16 per
parameter: fp32 weights, gradients, two Adam moments), the peak of the cgroup's memory (RSS and
page cache together: what the limit holds), the peak RSS per rank, seconds per step (median of
steps 2-3), the peak bytes written to the scratch folder's filesystem (offload files, the final
weights; sampled every second) and the first failure with its reason. Needs root (or a
delegated cgroup) to make the cgroups; without, it refuses in one line. The JSON
(``largest-model.json``) carries the commit, the dirty flag, the date and the machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from shardwise.config.names import Strategy

SIDES = (Strategy.ZERO3, "zero3-offload-disk", "fsdp2", "fsdp2-cpu-offload")
HEAD_DIM = 64
SEQ, BATCH, STEPS, VOCAB = 64, 2, 3, 256
GiB = 2 ** 30


def gpt_params(n_layer: int, width: int, vocab: int = VOCAB, seq: int = SEQ) -> int:
    """Parameters of shardwise's GPT (models/gpt.py: qkv without bias; proj, fc and fc-proj with; two
    layer norms per block, token and position embeddings, final norm, untied head)."""
    block = 12 * width * width + 10 * width
    return n_layer * block + vocab * width + seq * width + 2 * width + width * vocab


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '8e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?)?\s*", text)
    if not m:
        raise ValueError(f"--memory-limit {text!r}: not a size; fix: e.g. 8GiB or 6000MiB")
    unit = (m.group(2) or "").upper().rstrip("B").replace("I", "")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


# -- the memory cage --------------------------------------------------------------------------
class MemoryCage:
    """A memory cgroup with a limit; processes started through :meth:`run` (and their children)
    live in it. cgroup v1 (``/sys/fs/cgroup/memory``) or v2 (``/sys/fs/cgroup``)."""

    def __init__(self, limit: int, name: str):
        v1 = "/sys/fs/cgroup/memory"
        self.v1 = os.path.isdir(v1) and os.path.exists(os.path.join(v1, "memory.limit_in_bytes"))
        root = v1 if self.v1 else "/sys/fs/cgroup"
        self.path = os.path.join(root, name)
        try:
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))
            if self.v1 and os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self._write("memory.memsw.limit_in_bytes", str(limit))   # no escape into swap
        except OSError as exc:
            raise PermissionError(f"cannot make a memory cgroup at {self.path} ({exc.strerror}); "
                                  "fix: run as root, or in a container with a writable memory "
                                  "cgroup") from None
        self.limit = limit

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as fh:
            fh.write(value)

    def _read(self, name: str) -> str:
        try:
            with open(os.path.join(self.path, name)) as fh:
                return fh.read()
        except OSError:
            return ""

    def peak(self) -> int:
        text = self._read("memory.max_usage_in_bytes" if self.v1 else "memory.peak").strip()
        return int(text) if text.isdigit() else 0

    def oom_kills(self) -> int:
        text = self._read("memory.oom_control" if self.v1 else "memory.events")
        m = re.search(r"oom_kill (\d+)", text)
        return int(m.group(1)) if m else 0

    def run(self, cmd: list[str], timeout: float, env: dict, log: str) -> tuple[int | None, float]:
        """Run ``cmd`` inside the cgroup; (exit code, or None past ``timeout``; seconds)."""
        procs = os.path.join(self.path, "cgroup.procs")

        def enter() -> None:
            os.setsid()                              # its own process group: killed as one
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))
        began = time.perf_counter()
        with open(log, "w") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 preexec_fn=enter)
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                rc = None
        self._kill_rest()
        return rc, time.perf_counter() - began

    def _kill_rest(self) -> None:
        for pid in self._read("cgroup.procs").split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        self._kill_rest()
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


# -- one trial ---------------------------------------------------------------------------------
class DiskWatch:
    """Samples, every second, the bytes used on the filesystem that holds ``folder``, less what
    was used when it started; ``peak`` after :meth:`stop`. The filesystem, not the folder: the
    offload store unlinks its files as soon as it has mapped them (memory/offload.py), so no
    directory walk sees them. Other writers on the same filesystem count too (state it)."""

    def __init__(self, folder: str):
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self.base = shutil.disk_usage(folder).used
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _used(self) -> int:
        return max(0, shutil.disk_usage(self.folder).used - self.base)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, self._used())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, self._used())


def _shardwise_cmd(side: str, n_layer: int, width: int, work: str) -> list[str]:
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--strategy", Strategy.ZERO3,
           "--n-layer", str(n_layer), "--n-embd", str(width), "--n-head", str(width // HEAD_DIM),
           "--block-size", str(SEQ), "--vocab-size", str(VOCAB), "--batch-size", str(BATCH),
           "--steps", str(STEPS), "--repeat-batch", "--lr", "1e-6", "--warmup-steps", "0",
           "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
           "--nproc-per-node", "2", "--out-dir", os.path.join(work, "runs"), "--run-name", "t"]
    if side == "zero3-offload-disk":
        cmd += ["--offload", "disk", "--offload-params", "--offload-dir",
                os.path.join(work, "offload")]
    return cmd


def _torch_cmd(side: str, n_layer: int, width: int, work: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "shardwise.bench.largest_model", "--fsdp2-rank", "--side", side,
            "--n-layer", str(n_layer), "--width", str(width), "--out", work]


def _steps_of(side: str, work: str) -> tuple[list[dict], list[int]]:
    """(per-step loss and seconds, peak RSS per rank) that the trial wrote."""
    if side.startswith(Strategy.ZERO3):
        metrics = glob.glob(os.path.join(work, "runs", "*", "metrics.jsonl"))
        steps = []
        if metrics:
            with open(metrics[0]) as fh:
                steps = [json.loads(line) for line in fh if line.strip()]
        steps = [{"loss": s["loss"], "seconds": s["step_seconds"]} for s in steps]
        rss = steps and glob.glob(os.path.join(work, "runs", "*", "summary.json"))
        peaks = []
        if rss:
            with open(rss[0]) as fh:
                peaks = json.load(fh).get("peak_memory_per_rank") or []
        return steps, [int(p) for p in peaks]
    out = []
    for path in sorted(glob.glob(os.path.join(work, "fsdp2-rank*.json"))):
        with open(path) as fh:
            out.append(json.load(fh))
    if not out:
        return [], []
    return out[0]["steps"], [r["peak_rss"] for r in out]


def _error_line(log: str) -> str:
    """The last line of the trial's output that names an error (the reason of a failure)."""
    try:
        with open(log, errors="replace") as fh:
            lines = [ln.strip() for ln in fh if ln.strip()]
    except OSError:
        return ""
    raised = [ln for ln in lines if re.search(r"(^|\]: )[A-Za-z_.]*(Error|Exception): ", ln)
              and "ChildFailedError" not in ln]
    if raised:                                  # the first exception a rank raised
        return re.sub(r"^\[rank\d+\]: ", "", raised[0])[:300]
    errs = [ln for ln in lines if re.search(r"error:|Killed|killed|exit", ln)]
    return (errs or lines or [""])[-1][:300]


def trial(side: str, n_layer: int, width: int, cage_limit: int, seconds: float,
          scratch: str) -> dict:
    """Train ``side`` at ``width`` for 3 steps inside a fresh cgroup; the verdict and figures."""
    params = gpt_params(n_layer, width)
    out = {"side": side, "width": width, "n_layer": n_layer, "params": params,
           "state_bytes": 16 * params}
    work = tempfile.mkdtemp(prefix=f"{side}-{width}-", dir=scratch)
    if side == "zero3-offload-disk":
        free = shutil.disk_usage(work).free
        if 16 * params * 1.3 > free:     # state + final weights + slack
            shutil.rmtree(work, ignore_errors=True)
            return {**out, "fits": False, "reason": f"too slow: state {16 * params / GiB:.1f} "
                    f"GiB would not fit the disk's {free / GiB:.1f} GiB free"}
    make = _shardwise_cmd if side.startswith(Strategy.ZERO3) else _torch_cmd
    cmd = make(side, n_layer, width, work)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    cage = MemoryCage(cage_limit, f"shardwise-largest-{os.getpid()}-{side}-{width}")
    disk = DiskWatch(work)
    log = os.path.join(scratch, f"{side}-{width}.log")
    try:
        rc, took = cage.run(cmd, seconds, env, log)
        kills = cage.oom_kills()
        out.update(cgroup_peak=cage.peak(), wall_seconds=round(took, 1))
    finally:
        disk_peak = disk.stop()
        cage.close()
    steps, rss = _steps_of(side, work)
    shutil.rmtree(work, ignore_errors=True)
    losses = [s["loss"] for s in steps]
    out.update(steps=steps, peak_rss_per_rank=rss, disk_peak=disk_peak, returncode=rc,
               oom_kills=kills)
    if len(steps) >= 2:
        out["step_seconds"] = statistics.median(s["seconds"] for s in steps[1:])
    if rc is None:
        out.update(fits=False, reason=f"too slow: past the {seconds:.0f} s cap per trial")
    elif kills:
        out.update(fits=False, reason=f"out of memory: the cgroup's OOM killer ({kills} kill(s))")
    elif rc != 0:
        out.update(fits=False, reason=f"exit {rc}: {_error_line(log)}")
    elif len(steps) < STEPS or not all(math.isfinite(v) for v in losses):
        out.update(fits=False, reason=f"{len(steps)} of {STEPS} steps, losses {losses}")
    else:
        out.update(fits=True, reason="trained 3 steps")
    return out


# -- the FSDP2 worker (one rank; run by torchrun inside a trial's cgroup) ----------------------
def fsdp2_rank(side: str, n_layer: int, width: int, out: str) -> int:
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from shardwise.config import ModelConfig
    from shardwise.models import build_model, lm_loss
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = ModelConfig(name="gpt", n_layer=n_layer, n_embd=width, n_head=width // HEAD_DIM,
                      block_size=SEQ, vocab_size=VOCAB, dropout=0.0)
    model = build_model(cfg, 0, init="meta")
    mesh = init_device_mesh("cpu", (world,))
    policy = {"offload_policy": CPUOffloadPolicy()} if side == "fsdp2-cpu-offload" else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    model.to_empty(device="cpu")
    with torch.no_grad():                      # FSDP2's way: initialise each rank's shards
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("bias"):
                local.zero_()
            elif local.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH // world, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH // world, SEQ), generator=g)
    steps = []
    for _ in range(STEPS):
        t = time.perf_counter()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"loss": float(loss), "seconds": time.perf_counter() - t})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out, f"fsdp2-rank{rank}.json"), "w") as fh:
        json.dump({"steps": steps, "peak_rss": peak}, fh)
    return 0          # torchrun tears the world down (no collective is in flight)


# -- the search --------------------------------------------------------------------------------
def search(side: str, args, scratch: str, say) -> dict:
    """Double the width from ``start`` until a trial fails, then bisect to ``resolution``."""
    tried: list[dict] = []

    def attempt(width: int) -> bool:
        r = trial(side, args.n_layer, width, args.limit, args.trial_seconds, scratch)
        tried.append(r)
        say(f"  {side} width {width} ({r['params'] / 1e6:,.0f}M): "
            + ("fits" if r["fits"] else r["reason"])
            + (f", {r['step_seconds']:.1f} s/step" if r.get("step_seconds") else ""))
        return r["fits"]
    lo, hi, width = 0, 0, args.start_width
    while width <= args.max_width:
        if attempt(width):
            lo, width = width, width * 2
        else:
            hi = width
            break
    if hi and lo:
        while hi - lo > args.resolution:
            mid = (lo + hi) // 2 // HEAD_DIM * HEAD_DIM
            if mid in (lo, hi):
                break
            if attempt(mid):
                lo = mid
            else:
                hi = mid
    best = max((r for r in tried if r["fits"]), key=lambda r: r["width"], default=None)
    fail = min((r for r in tried if not r["fits"] and (best is None or r["width"] > best["width"])),
               key=lambda r: r["width"], default=None)
    return {"side": side, "best": best, "first_failure": fail, "trials": tried,
            "capped": hi == 0 and lo > 0}


def table(rows: list[dict], limit: int) -> str:
    lines = [f"| side (world 2, limit {limit / GiB:.1f} GiB) | largest width | parameters | "
             "training state | cgroup peak | peak RSS per rank | s/step | disk | first failure |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b, f = r["best"], r["first_failure"]
        fail = (f"width {f['width']} ({f['params'] / 1e6:,.0f}M): {f['reason']}" if f else
                ("none below the width cap" if r["capped"] else "-"))
        if b is None:
            lines.append(f"| {r['side']} | - | - | - | - | - | - | - | {fail} |")
            continue
        rss = " / ".join(f"{v / GiB:.2f}" for v in b.get("peak_rss_per_rank", [])) or "-"
        lines.append(f"| {r['side']} | {b['width']} | {b['params']:,} | "
                     f"{16 * b['params'] / GiB:.2f} GiB | {b.get('cgroup_peak', 0) / GiB:.2f} GiB"
                     f" | {rss} GiB | {b.get('step_seconds', float('nan')):.1f} | "
                     f"{b.get('disk_peak', 0) / GiB:.2f} GiB | {fail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.largest_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--memory-limit", default="8GiB", help="the cgroup's limit per trial")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--start-width", type=int, default=512)
    ap.add_argument("--max-width", type=int, default=16384)
    ap.add_argument("--resolution", type=int, default=256, help="bisect until hi - lo <= this")
    ap.add_argument("--trial-seconds", type=float, default=420.0, help="cap per trial")
    ap.add_argument("--scratch", default="", help="folder for trials (default: a temp dir)")
    ap.add_argument("--save", action="store_true", help="write to shardwise/bench/results/")
    ap.add_argument("--out", default="", help="folder for largest-model.json")
    ap.add_argument("--trial", choices=SIDES, help="run one trial of this side (with --width)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--fsdp2-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", default="fsdp2", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fsdp2_rank:
        return fsdp2_rank(args.side, args.n_layer, args.width, args.out)
    bad = [w for w in (args.start_width, args.resolution, args.width) if w % HEAD_DIM]
    if bad:
        print(f"error: widths must be multiples of {HEAD_DIM} (one head each); got {bad}",
              file=sys.stderr)
        return 2
    try:
        args.limit = parse_bytes(args.memory_limit)
        probe = MemoryCage(args.limit, f"shardwise-largest-probe-{os.getpid()}")
        probe.close()
    except (ValueError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scratch = args.scratch or tempfile.mkdtemp(prefix="shardwise-largest-")
    os.makedirs(scratch, exist_ok=True)
    if args.trial:
        r = trial(args.trial, args.n_layer, args.width, args.limit, args.trial_seconds, scratch)
        print(json.dumps(r, indent=2))
        return 0 if r["fits"] else 1
    from shardwise.bench.run import machine
    rows, began = [], time.time()
    for side in args.sides:
        print(f"{side}:", flush=True)
        rows.append(search(side, args, scratch, lambda s: print(s, flush=True)))
    text = table(rows, args.limit)
    print(text)
    from shardwise.bench.run import results_dir
    folder = args.out or (results_dir(args) if args.save else scratch)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "largest-model.json")
    with open(path, "w") as fh:
        json.dump({"machine": machine(), "memory_limit": args.limit, "n_layer": args.n_layer,
                   "sequence": SEQ, "batch": BATCH, "steps": STEPS, "vocab": VOCAB,
                   "trial_seconds": args.trial_seconds, "resolution": args.resolution,
                   "seconds": round(time.time() - began), "sides": rows, "table": text},
                  fh, indent=2)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
