"""What a run tells the person watching it and the files it leaves (rank 0 writes, all gather).

Every ``log_every`` steps (and at the last step) one record is made from the steps since the
previous one, the *logging window*: the mean train loss, the mean step time and throughput
(items over the window's seconds), MFU where the device's peak is known, each rank's peak memory
and mean bytes sent per step; ``val_loss`` / ``val_accuracy`` only on records where evaluation
ran. The record goes to

* ``metrics.jsonl``: strict JSON, one line each, flushed (a crash loses at most the open window);
  a non-finite value is written as ``null`` and named in the record's ``nonfinite`` list;
* ``metrics.csv`` with ``--csv``; TensorBoard event files in ``tensorboard/`` with
  ``--tensorboard`` (torch.utils.tensorboard; the ``tensorboard`` extra);
* the terminal: a progress bar when stdout is a terminal, otherwise (nohup, tee, SLURM logs) one
  printed line per record, in the style of torchtitan's log line:
  ``step 40/500 | loss 2.3456 | val 2.4012 | 25,612 tok/s | mfu - | mem 812 MiB | eta 1m20s``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
import time

from shardwise.run.metrics import human_bytes

CSV_FIELDS = ("step", "loss", "lr", "step_seconds", "items_per_second", "mfu", "val_loss",
              "val_accuracy", "max_peak_memory", "max_bytes_sent")


class Window:
    """Sums of the steps since the last record."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps, self.loss, self.seconds, self.sent, self.finite = 0, 0.0, 0.0, 0, True

    def add(self, loss: float, seconds: float, sent: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.sent += sent
        if math.isfinite(loss):
            self.loss += loss
        else:
            self.finite = False

    def mean_loss(self) -> float:
        return self.loss / self.steps if self.finite and self.steps else float("nan")


def strict(record: dict) -> dict:
    """Non-finite floats become None and are listed under ``nonfinite`` (JSON has no NaN)."""
    out, bad = {}, []
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
            bad.append(k)
        else:
            out[k] = v
    if bad:
        out["nonfinite"] = bad
    return out


def strict_tree(value):
    """Like :func:`strict` for a nested summary: non-finite floats anywhere become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_tree(v) for v in value]
    return value


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def log_line(record: dict, total: int, unit: str, eta_seconds: float) -> str:
    """The printed line for one record."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    parts = [f"step {record['step']}/{total}", f"loss {num(record['loss'], '.4f')}"]
    if "val_loss" in record:
        parts.append(f"val {num(record['val_loss'], '.4f')}")
    parts.append(f"{num(record['items_per_second'], ',.0f')} {unit}/s")
    parts.append(f"mfu {'-' if record.get('mfu') is None else format(100 * record['mfu'], '.1f') + '%'}")
    parts.append(f"mem {human_bytes(max(record['peak_memory_per_rank']))}")
    parts.append(f"eta {_duration(eta_seconds)}")
    return " | ".join(parts)


class _Progress:
    """A rich progress bar (rank 0, stdout a terminal)."""

    def __init__(self, total: int, done: int = 0):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(),
                            TextColumn("{task.completed}/{task.total}"),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task("train", total=total, completed=done, info="")
        self.bar.start()

    def update(self, info: str) -> None:
        self.bar.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.bar.stop()


class RunLog:
    """Rank 0's outputs for one run (a silent object on the other ranks)."""

    def __init__(self, folder: str, lg, total_steps: int, unit: str, main: bool, quiet: bool,
                 first_step: int = 0):
        """``first_step``: the steps already done when this run starts (a resumed run): the bar
        starts there and the time left is estimated from this run's own steps."""
        self.folder, self.total, self.unit, self.main = folder, total_steps, unit, main
        self.first = first_step
        self.start = time.perf_counter()
        self._jsonl = self._csv = self._csv_fh = self._tb = self._bar = None
        self._print_lines = False
        if not main:
            return
        os.makedirs(folder, exist_ok=True)
        self._jsonl = open(os.path.join(folder, "metrics.jsonl"), "w")
        if lg.csv:
            self._csv_fh = open(os.path.join(folder, "metrics.csv"), "w", newline="")
            self._csv = csv.DictWriter(self._csv_fh, fieldnames=CSV_FIELDS)
            self._csv.writeheader()
        if lg.tensorboard:
            from shardwise.config.extras import require
            require("tensorboard", "tensorboard", "--tensorboard")
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(folder, "tensorboard"))
        if not quiet and lg.progress:
            if sys.stdout.isatty():
                self._bar = _Progress(total_steps, first_step)
            else:
                self._print_lines = True

    def progress(self, loss: float, val: float | None) -> None:
        if self._bar:
            self._bar.update(f"loss {loss:.3f}" + (f" val {val:.3f}" if val is not None else ""))

    def write(self, record: dict) -> None:
        if not self.main:
            return
        record = strict(record)
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._csv:
            row = {k: record.get(k) for k in CSV_FIELDS if k in record}
            row["max_peak_memory"] = max(record["peak_memory_per_rank"])
            row["max_bytes_sent"] = max(record["bytes_sent_per_rank"])
            self._csv.writerow(row)
            self._csv_fh.flush()
        if self._tb:
            for key in ("loss", "lr", "items_per_second", "mfu", "val_loss", "val_accuracy"):
                if record.get(key) is not None:
                    self._tb.add_scalar(key if key != "loss" else "train_loss", record[key], record["step"])
            self._tb.add_scalar("peak_memory_max_rank", max(record["peak_memory_per_rank"]), record["step"])
            self._tb.flush()
        if self._print_lines:
            done = record["step"]
            elapsed, ran = time.perf_counter() - self.start, done - self.first
            eta = elapsed / ran * (self.total - done) if ran > 0 else 0.0
            print(log_line(record, self.total, self.unit, eta), flush=True)

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        for fh in (self._jsonl, self._csv_fh):
            if fh:
                fh.close()
        if self._tb:
            self._tb.close()
        self._jsonl = self._csv_fh = self._csv = self._tb = self._bar = None
