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

``--checkpoint`` (the same 3.2B GPT by default) runs the chain from a checkpoint instead: the
same training with ``--checkpoint-dir --checkpoint-move-last`` (saved at the last step, after
final.safetensors; each rank writes its own pieces of the masters and Adam moments, never
gathering them: shardwise/checkpoint/pieces.py, and frees each offload file's disk blocks once
its pieces are written, so the checkpoint replaces the offload files on disk), then ``shardwise
checkpoint export`` of it into one .safetensors file (streamed), checked tensor by tensor
against the run's ``final.safetensors``, then ``shardwise generate`` from the export
(``generate --run`` reads a folder's config.json and final.safetensors: the export is written
under that name into a folder holding a copy of the run's config.json). Before it starts it
refuses (exit 2, one line) when the filesystem has fewer free bytes than what coexists at the
chain's peak (:func:`disk_needed`: 20 bytes a parameter with the move; 32 with ``--copy``, the
last checkpoint copied beside the offload files). It samples each phase's peak RSS per process and disk bytes, and writes
``bigger-than-ram-checkpoint.json`` with the same records plus the checkpoint's, the export's
and the generation's; the offload folder, checkpoint and export are removed at the end unless
``--keep``. Without the move (``--copy``) 3.2B parameters need 102 GB at once, more than this
disk's 77 GB: the chain ran one size down (18 x 2880, 1.8B) before the move existed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
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

    def __init__(self, marker: str, folder: str, every: float = 2.0,
                 watch: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.marker, self.folder, self.every = marker, folder, every
        self.peaks: dict[int, int] = {}
        self.free_at_start = _free_bytes(folder)
        self.disk_peak = 0
        self.done = threading.Event()
        self.watch, self.seen = dict(watch or {}), {}   # label -> path; label -> first seen, s
        self.began = time.monotonic()

    def run(self) -> None:
        while not self.done.is_set():
            for pid, rss in _rss_of_run(self.marker).items():
                self.peaks[pid] = max(self.peaks.get(pid, 0), rss)
            self.disk_peak = max(self.disk_peak, self.free_at_start - _free_bytes(self.folder))
            for label, path in self.watch.items():
                if label not in self.seen and os.path.exists(path):
                    self.seen[label] = time.monotonic() - self.began
            self.done.wait(self.every)


def _ram_bytes() -> int:
    with open("/proc/meminfo") as fh:
        return int(fh.readline().split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.bigger_than_ram")
    ap.add_argument("--checkpoint", action="store_true", help="the chain from a checkpoint: "
                    "train with --checkpoint-dir, export it, generate from the export "
                    "(bigger-than-ram-checkpoint.json), the last checkpoint moved from the "
                    "offload files (--checkpoint-move-last)")
    ap.add_argument("--copy", action="store_true", help="--checkpoint: copy the last "
                    "checkpoint beside the offload files instead of moving it (32 B a "
                    "parameter on disk at once instead of 20)")
    ap.add_argument("--keep", action="store_true", help="--checkpoint: keep the offload "
                    "folder, checkpoint and export (tens of GB) instead of removing them")
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=2880)
    ap.add_argument("--n-head", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", default="1e-6", help="Adam's step size (2e-5 spiked the loss: "
                    "its first sign-sized step over 3.2B weights; 1e-6 falls step over step)")
    ap.add_argument("--offload-dir", default="", help="default: a new folder under /tmp")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    if args.checkpoint:
        return checkpoint_chain(args)
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


# --checkpoint -------------------------------------------------------------------------------
CHECKPOINT_RESULT = "bigger-than-ram-checkpoint.json"
# bytes a parameter each file holds, fp32: the offload store (the parameter shard, which is the
# master, its gradient, two Adam moments), the checkpoint (masters and two moments, each value
# once), final.safetensors and the export (the weights)
OFFLOAD_B, CHECKPOINT_B, WEIGHTS_B = 16, 12, 4
HEADROOM = 2 * 2**30      # logs, the pieces' headers, the generation folder's copy of the config


def disk_needed(params: int, move: bool = True) -> int:
    """Bytes that coexist on disk at the chain's peak. With the move: the offload files and
    final.safetensors at the end of training (20 B a parameter), the offload files shrinking
    as the checkpoint grows while it is saved, then the checkpoint, final.safetensors and the
    export (20 B). With a copy: the offload files, the checkpoint and final.safetensors at the
    end of training (32 B)."""
    if move:
        return max(OFFLOAD_B, CHECKPOINT_B + WEIGHTS_B) * params + WEIGHTS_B * params + HEADROOM
    return (OFFLOAD_B + CHECKPOINT_B + WEIGHTS_B) * params + HEADROOM


def _train_command(args) -> list[str]:
    return ["shardwise", "train", "--strategy", "zero3", "--offload", "disk", "--offload-params",
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head",
            str(args.n_head), "--block-size", "64", "--batch-size", "2", "--steps",
            str(args.steps), "--repeat-batch", "--lr", args.lr, "--warmup-steps", "0",
            "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]


def _phase(cmd: list[str], marker: str, folder: str, watch: dict | None = None) -> dict:
    """Run ``shardwise`` ``cmd`` (its first word left out) in a child process while sampling
    the processes whose command line holds ``marker``: exit code, seconds, peak RSS per process,
    peak disk bytes, the first-seen times of ``watch``'s paths, the output's tails."""
    sampler = Sampler(marker, folder, watch=watch)
    sampler.start()
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", *cmd[1:]], text=True,
                          capture_output=True)
    seconds = time.monotonic() - began
    sampler.done.set()
    sampler.join()
    return {"returncode": done.returncode, "seconds": seconds,
            "peak_rss_per_process": sorted(sampler.peaks.values(), reverse=True),
            "disk_peak_bytes": sampler.disk_peak, "seen": sampler.seen,
            "stdout_tail": done.stdout.strip()[-300:], "stderr_tail": done.stderr.strip()[-1500:]}


def _same_tensors(a: str, b: str) -> bool:
    """Whether two safetensors files hold the same names and equal tensors, one at a time."""
    import torch
    from safetensors import safe_open
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
               for f in files)


def checkpoint_chain(args) -> int:
    """``--checkpoint``: train with a checkpoint, export it, generate from the export."""
    from shardwise.bench.run import machine
    from shardwise.planner.model import ModelSpec
    params = ModelSpec(args.n_layer, args.n_embd, args.n_head, 64, 256,
                       tied_embeddings=False).params - 3 * args.n_embd * args.n_layer
    base = os.path.dirname(args.offload_dir) if args.offload_dir else tempfile.gettempdir()
    move = not args.copy
    need, free = disk_needed(params, move), _free_bytes(base)
    if free < need:
        print(f"error: {params:,} parameters need {need:,} bytes of disk at once "
              f"({need // params} bytes a parameter with the last checkpoint "
              f"{'moved' if move else 'copied'}, and {HEADROOM:,} to spare); {free:,} are free "
              f"on {base}; fix: a smaller --n-layer, or free disk", file=sys.stderr)
        return 2
    where = machine()                                 # commit and dirty flag, before the run
    work = tempfile.mkdtemp(prefix="shardwise-bigger-ck-")
    name = os.path.basename(work)                     # in every command line: the marker
    offload = args.offload_dir or os.path.join(work, "offload")
    ckpt = os.path.join(work, "checkpoint")
    runs, gen = os.path.join(work, "runs"), os.path.join(work, "export")
    run_dir = os.path.join(runs, "run")
    exported = os.path.join(gen, "final.safetensors")
    train = _train_command(args)
    moving = ["--checkpoint-move-last"] if move else []
    cmds = {"train": [*train, "--checkpoint-dir", ckpt, *moving, "--out-dir", runs,
                      "--run-name", "run"],
            "export": ["shardwise", "checkpoint", "export", ckpt, exported],
            "generate": ["shardwise", "generate", "--run", gen, "--prompt", "def ",
                         "--max-new-tokens", "4", "--temperature", "0"]}
    full_train = [*cmds["train"], "--offload-dir", offload]
    step = f"step-{args.steps}"
    print(f"{params:,} parameters; training state {16 * params / 2**30:.1f} GiB; RAM "
          f"{_ram_bytes() / 2**30:.1f} GiB; disk needed {need / 2**30:.1f} GiB of "
          f"{free / 2**30:.1f} GiB free; {' '.join(full_train)}", flush=True)
    result = {"machine": where, "command": " ".join([*train, "--checkpoint-dir", "CKPT",
                                                     *moving]),
              "moved": move,
              # WORK: a new folder under the temporary directory (the offload files in
              # WORK/offload); the export is WORK/export/final.safetensors beside a copy of the
              # run's config.json, the folder generate --run reads
              "commands": {k: shlex.join(v).replace(work, "WORK") for k, v in cmds.items()},
              "ram_bytes": _ram_bytes(), "parameters": params,
              "training_state_bytes": 16 * params,
              "state_over_ram": 16 * params / _ram_bytes(),
              "disk_needed_bytes": need, "disk_free_bytes": free,
              "bytes_per_parameter": {"offload": OFFLOAD_B, "checkpoint": CHECKPOINT_B,
                                      "final_weights": WEIGHTS_B, "export": WEIGHTS_B}}
    try:
        t = _phase(full_train, name, work, watch={
            "save_started": os.path.join(ckpt, step + ".partial"),
            "save_published": os.path.join(ckpt, step, "meta.json"),
            "final_written": os.path.join(run_dir, "final.safetensors")})
        metrics = os.path.join(run_dir, "metrics.jsonl")
        records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        seen = t.pop("seen")
        result.update(returncode=t["returncode"], seconds=t["seconds"],
                      stderr_tail=t["stderr_tail"],
                      steps=[{"step": r["step"], "loss": r["loss"], "seconds": r["step_seconds"]}
                             for r in records],
                      peak_rss_per_process=t["peak_rss_per_process"],
                      disk_peak_bytes=t["disk_peak_bytes"])
        final = os.path.join(run_dir, "final.safetensors")
        result["final_weights_bytes"] = os.path.getsize(final) if os.path.exists(final) else None
        if os.path.isfile(os.path.join(ckpt, step, "meta.json")):
            with open(os.path.join(ckpt, step, "meta.json")) as fh:
                meta = json.load(fh)
            on_disk = _folder_bytes(os.path.join(ckpt, step))
            result["checkpoint"] = {
                "step": meta["step"], "bytes": on_disk, "bytes_per_parameter": on_disk / params,
                "parameters": meta["parameters"], "files": len(meta["files"]),
                "save_seconds": seen["save_published"] - seen["save_started"]
                if {"save_started", "save_published"} <= seen.keys() else None,
                "seen_seconds": seen}
        if t["returncode"] == 0 and "checkpoint" in result:
            os.makedirs(gen)
            shutil.copy(os.path.join(run_dir, "config.json"), gen)   # generate's model
            shutil.rmtree(offload, ignore_errors=True)   # gone with the run; its empty folder
            e = _phase(cmds["export"], name, work)
            e.pop("seen")
            e["bytes"] = os.path.getsize(exported) if os.path.exists(exported) else None
            if e["returncode"] == 0:
                t0 = time.monotonic()
                e["equals_final_safetensors"] = _same_tensors(exported, final)
                e["compare_seconds"] = time.monotonic() - t0
            result["export"] = e
            if e["returncode"] == 0:
                g = _phase(cmds["generate"], name, work)
                g.pop("seen")
                g["output"] = g.pop("stdout_tail")[-200:]
                g["stderr"] = g.pop("stderr_tail")[-300:]
                result["generate"] = g
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(offload, ignore_errors=True)
    result["table"] = checkpoint_table(result)
    print(result["table"])
    out = os.path.join(os.path.dirname(__file__), "results") if args.save else \
        tempfile.mkdtemp(prefix="shardwise-bigger-ck-result-")
    with open(os.path.join(out, CHECKPOINT_RESULT), "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"result: {os.path.join(out, CHECKPOINT_RESULT)}"
          + (f"; kept {work}" if args.keep else ""))
    ok = result["returncode"] == 0 and result.get("export", {}).get("returncode") == 0 \
        and result.get("generate", {}).get("returncode") == 0
    return 0 if ok else 1


def _needed_words(r: dict) -> str:
    if r.get("moved"):
        return ("offload 16 + final weights 4 B a parameter; the checkpoint, 12, takes the "
                "offload files' place")
    return "offload 16 + checkpoint 12 + final weights 4 B a parameter"


def checkpoint_table(r: dict) -> str:
    gib = 2 ** 30
    rows = ["| figure | value |", "|---|---:|",
            f"| parameters | {r['parameters']:,} |",
            f"| training state (fp32 weights, gradients, Adam moments: 16 B each) | "
            f"{r['training_state_bytes'] / gib:.1f} GiB |",
            f"| this machine's RAM | {r['ram_bytes'] / gib:.1f} GiB |",
            f"| state / RAM | {r['state_over_ram']:.2f} |",
            f"| disk needed at once ({_needed_words(r)}) "
            f"/ free at the start | {r['disk_needed_bytes'] / gib:.1f} / "
            f"{r['disk_free_bytes'] / gib:.1f} GiB |"]
    if "disk_peak_bytes" in r:
        rows.append(f"| training: peak disk use (offload, checkpoint, final weights) | "
                    f"{r['disk_peak_bytes'] / gib:.1f} GiB |")
        for i, rss in enumerate(r["peak_rss_per_process"][:2]):
            rows.append(f"| training: peak RSS, process {i + 1} (largest first) | "
                        f"{rss / gib:.2f} GiB |")
        for s in r["steps"]:
            rows.append(f"| step {s['step']}: loss, seconds | {s['loss']:.4f}, "
                        f"{s['seconds']:.0f} |")
    c = r.get("checkpoint")
    if c:
        save = f", saved in about {c['save_seconds']:.0f} s" if c.get("save_seconds") else ""
        how = "moved from the offload files" if r.get("moved") else "each rank's pieces"
        rows.append(f"| checkpoint at step {c['step']} ({how}) | "
                    f"{c['bytes'] / gib:.1f} GiB ({c['bytes_per_parameter']:.1f} B a "
                    f"parameter){save} |")
    if r.get("final_weights_bytes"):
        rows.append(f"| final.safetensors (streamed) | {r['final_weights_bytes'] / gib:.1f} GiB |")
    if "returncode" in r:
        rows.append(f"| training exit code, wall seconds | {r['returncode']}, "
                    f"{r['seconds']:.0f} |")
    e = r.get("export")
    if e:
        rss = max(e["peak_rss_per_process"], default=0)
        same = {True: "yes", False: "NO"}.get(e.get("equals_final_safetensors"), "not checked")
        rows += [f"| shardwise checkpoint export (exit {e['returncode']}): seconds, peak RSS | "
                 f"{e['seconds']:.0f} s, {rss / gib:.2f} GiB |"]
        if e.get("bytes"):
            rows.append(f"| export: bytes, equal to final.safetensors tensor by tensor | "
                        f"{e['bytes'] / gib:.1f} GiB, {same} |")
    g = r.get("generate")
    if g:
        rss = max(g["peak_rss_per_process"], default=0)
        rows.append(f"| shardwise generate from the export (exit {g['returncode']}): seconds, "
                    f"peak RSS | {g['seconds']:.0f} s, {rss / gib:.2f} GiB |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
