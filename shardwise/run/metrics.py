"""Per-step metrics: throughput, model FLOP utilisation, peak memory, traffic; the summary table
(the per-step JSONL file is written by runlog.py).

Peak memory per rank: CUDA's max_memory_allocated on a GPU; on CPU the process's peak resident
set (ru_maxrss), which includes the Python interpreter and torch itself (about 300-400 MB).
"""
from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak FLOP/s per device, from the vendors' data sheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "V100": 125e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's published peak, or None where unknown (CPUs): then MFU is not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_summary(summary: dict, console=None) -> None:
    """The end-of-run table (rank 0): losses, throughput, memory and traffic per rank."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=f"shardwise {summary['strategy']} · {summary['world_size']} process(es)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("layout", summary.get("layout", summary["strategy"])),
            ("steps", summary["steps"]), ("final train loss", f"{summary['final_loss']:.4f}"),
            ("final val loss", f"{summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "-")]
    if summary.get("val_accuracy") is not None:
        rows.append(("val accuracy", f"{100 * summary['val_accuracy']:.2f}%"))
    unit = summary["throughput_unit"]
    rows += [(f"{unit}/s (median step)", f"{summary['throughput']:,.0f}"),
             ("wall time", f"{summary['wall_seconds']:.1f} s")]
    if summary.get("compile_seconds") is not None:
        rows.append(("compile (first step minus median step)", f"{summary['compile_seconds']:.1f} s"))
    if summary.get("mfu") is not None:
        rows.append(("model FLOP utilisation", f"{100 * summary['mfu']:.1f}%"))
    for r, (mem, sent) in enumerate(zip(summary["peak_memory_per_rank"], summary["bytes_sent_per_rank"])):
        rows.append((f"rank {r}: peak memory / sent per step", f"{human_bytes(mem)} / {human_bytes(sent)}"))
    if summary.get("trainable_parameters"):
        trainable, total = summary["trainable_parameters"]
        if trainable != total:
            rows.append(("rank 0 trainable parameters", f"{trainable:,} of {total:,} "
                         f"({100 * trainable / max(1, total):.2f}%)"))
    if summary.get("loss_scale"):
        ls = summary["loss_scale"]
        rows.append(("fp16 loss scale / skipped steps", f"{ls['loss_scale']:g} / {ls['skipped_steps']}"))
    for k, v in summary.get("ledger", {}).items():
        rows.append((f"rank 0 holds {k}", human_bytes(v)))
    for k, v in rows:
        t.add_row(str(k), str(v))
    console.print(t)
