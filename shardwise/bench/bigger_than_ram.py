"""A model whose training state does not fit in this machine's RAM, trained from the command line.

    python -m shardwise.bench.bigger_than_ram --save        # the issue's 3.2B GPT (minutes)
    python -m shardwise.bench.bigger_than_ram --n-layer 2   # a quick look at the same path

Runs ``shardwise train --strategy zero3 --offload disk --offload-params`` at world 2 on a GPT
(default 32 x 2880, 24 heads, sequence 64: 3.2B parameters, whose fp32 weights, Adam moments
and gradients are 16 bytes a parameter: about 51 GB, twice this machine's RAM), on one repeated
batch (``--repeat-batch``: the loss must fall), for 3 steps; then ``shardwise generate`` from
the run's streamed ``final.safetensors``. Every 2 s it samples the resident memory of each of the
run's processes (peak per process) and the bytes the offload folder holds on disk.

Writes ``bigger-than-ram.json`` (``--save``: into shardwise/bench/results/; else a temporary
folder): the command, the machine (commit, dirty flag, date), the machine's RAM, parameters,
training-state bytes, per-step loss and seconds, peak RSS per process, peak disk bytes, the
generation's seconds, and a markdown ``table`` (docs: ``json-table``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def _rss_of_run(marker: str) -> dict[int, int]:
    """{pid: resident bytes} of every process whose command line holds ``marker``."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() not in fh.read():
                    continue
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        out[int(pid)] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return out


def _free_bytes(folder: str) -> int:
    """Free bytes of the filesystem that holds ``folder`` (or its nearest existing parent):
    the offload store's files may be unlinked while open, so the folder's own listing would
    not show them; the filesystem's free space does."""
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


class Sampler(threading.Thread):
    """Peak RSS per process of the run, and the peak of disk bytes used on the offload
    folder's filesystem since the start (the fall of its free space)."""

    def __init__(self, marker: str, folder: str, every: float = 2.0):
        super().__init__(daemon=True)
        self.marker, self.folder, self.every = marker, folder, every
        self.peaks: dict[int, int] = {}
        self.free_at_start = _free_bytes(folder)
        self.disk_peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for pid, rss in _rss_of_run(self.marker).items():
                self.peaks[pid] = max(self.peaks.get(pid, 0), rss)
            self.disk_peak = max(self.disk_peak, self.free_at_start - _free_bytes(self.folder))
            self.done.wait(self.every)


def _ram_bytes() -> int:
    with open("/proc/meminfo") as fh:
        return int(fh.readline().split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.bigger_than_ram")
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=2880)
    ap.add_argument("--n-head", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", default="1e-6", help="Adam's step size (2e-5 spiked the loss: "
                    "its first sign-sized step over 3.2B weights; 1e-6 falls step over step)")
    ap.add_argument("--offload-dir", default="", help="default: a new folder under /tmp")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    from shardwise.bench.run import machine
    from shardwise.planner.model import ModelSpec
    where = machine()                                 # commit and dirty flag, before the run
    work = tempfile.mkdtemp(prefix="shardwise-bigger-")
    offload = args.offload_dir or os.path.join(work, "offload")
    runs, name = os.path.join(work, "runs"), f"big-{os.getpid()}"
    train = ["shardwise", "train", "--strategy", "zero3", "--offload", "disk", "--offload-params",
             "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head",
             str(args.n_head), "--block-size", "64", "--batch-size", "2", "--steps",
             str(args.steps), "--repeat-batch", "--lr", args.lr, "--warmup-steps", "0",
             "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]
    cmd = [*train, "--offload-dir", offload, "--out-dir", runs, "--run-name", name]
    params = ModelSpec(args.n_layer, args.n_embd, args.n_head, 64, 256,
                       tied_embeddings=False).params - 3 * args.n_embd * args.n_layer
    print(f"{params:,} parameters; training state {16 * params / 2**30:.1f} GiB; "
          f"RAM {_ram_bytes() / 2**30:.1f} GiB; {' '.join(cmd)}", flush=True)
    sampler = Sampler(name, offload)
    sampler.start()
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", *cmd[1:]], text=True,
                          capture_output=True)
    seconds = time.monotonic() - began
    sampler.done.set()
    sampler.join()
    run_dir = os.path.join(runs, name)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))] \
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    gen = None
    if done.returncode == 0:
        t0 = time.monotonic()
        g = subprocess.run([sys.executable, "-m", "shardwise.cli", "generate", "--run", run_dir,
                            "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"],
                           text=True, capture_output=True)
        gen = {"returncode": g.returncode, "seconds": time.monotonic() - t0,
               "output": g.stdout.strip()[-200:], "stderr": g.stderr.strip()[-300:]}
    result = {"machine": where, "command": " ".join(train), "ram_bytes": _ram_bytes(),
              "parameters": params, "training_state_bytes": 16 * params,
              "returncode": done.returncode, "seconds": seconds,
              "stderr_tail": done.stderr.strip()[-1500:],
              "steps": [{"step": r["step"], "loss": r["loss"], "seconds": r["step_seconds"]}
                        for r in records],
              "peak_rss_per_process": sorted(sampler.peaks.values(), reverse=True),
              "disk_peak_bytes": sampler.disk_peak,
              "final_weights_bytes": os.path.getsize(os.path.join(run_dir, "final.safetensors"))
              if os.path.exists(os.path.join(run_dir, "final.safetensors")) else None,
              "generate": gen}
    result["table"] = table(result)
    print(result["table"])
    out = os.path.join(os.path.dirname(__file__), "results") if args.save else work
    with open(os.path.join(out, "bigger-than-ram.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"result: {os.path.join(out, 'bigger-than-ram.json')}")
    shutil.rmtree(offload, ignore_errors=True)
    for f in glob.glob(os.path.join(run_dir, "final.safetensors")):
        os.remove(f)
    return 0 if done.returncode == 0 else 1


def table(r: dict) -> str:
    gib = 2 ** 30
    rows = ["| figure | value |", "|---|---:|",
            f"| parameters | {r['parameters']:,} |",
            f"| training state (fp32 weights, gradients, Adam moments: 16 B each) | "
            f"{r['training_state_bytes'] / gib:.1f} GiB |",
            f"| this machine's RAM | {r['ram_bytes'] / gib:.1f} GiB |",
            f"| state / RAM | {r['training_state_bytes'] / r['ram_bytes']:.2f} |",
            f"| peak disk use during the run (offload, final weights) | "
            f"{r['disk_peak_bytes'] / gib:.1f} GiB |"]
    for i, rss in enumerate(r["peak_rss_per_process"][:3]):
        rows.append(f"| peak RSS, process {i + 1} (largest first) | {rss / gib:.2f} GiB |")
    for s in r["steps"]:
        rows.append(f"| step {s['step']}: loss, seconds | {s['loss']:.4f}, {s['seconds']:.0f} |")
    if r.get("final_weights_bytes"):
        rows.append(f"| final.safetensors (streamed) | {r['final_weights_bytes'] / gib:.1f} GiB |")
    if r.get("generate"):
        g = r["generate"]
        rows.append(f"| shardwise generate (exit {g['returncode']}) | {g['seconds']:.0f} s |")
    rows.append(f"| run exit code, wall seconds | {r['returncode']}, {r['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
