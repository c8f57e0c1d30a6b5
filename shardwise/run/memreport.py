"""``--memory-report``: each rank's measured peak, and what each enabled memory technique saved.

Every figure is per rank, against this rank's ledger (``strategy.memory_ledger()``) and against
what the same ledger would hold without the technique:

    frozen parameters   (``--freeze``, ``--lora-rank``) the frozen elements times the bytes this
                        layout keeps per trainable element for gradients, optimizer states and
                        master weights (ledger bytes / trainable elements: measured, so a ZeRO
                        stage's 1/N is in it)
    8-bit optimizer     (``--optimizer adamw8bit``) 8 bytes per element with optimizer state
                        (fp32 Adam's two moments) minus the state bytes actually held
    accumulation        (``--grad-accum K``) saved activations of the whole batch minus those of
                        one micro-batch: (K - 1) x the measured peak (they grow with rows)
    checkpointing       (``--activation-checkpointing``) measured: one extra forward of the last
    mixed precision     batch with the technique switched off, its saved activations against the
                        run's (then discarded); not under a pipeline (no rank runs a whole forward)
    offload             (``--offload``) bytes of masters and optimizer states (with
                        ``--offload-params`` also parameter and gradient shards) held off the
                        device: on disk for ``disk``; for ``cpu`` on a GPU, in host memory (0 on
                        a CPU run)

The table is printed on rank 0 after the summary; the figures also go to summary.json
(``memory_report``).
"""
from __future__ import annotations

import contextlib

import torch

from shardwise.config import Config
from shardwise.memory.checkpointing import checkpointing_off
from shardwise.parallel import presets
from shardwise.run.metrics import human_bytes, peak_memory_bytes

STATE_CATEGORIES = ("gradients", "optimizer_states", "master_weights")


def _saved_bytes(strategy, x: torch.Tensor) -> int:
    """Distinct storages autograd saves in one training forward of ``x`` (parameters excluded)."""
    weights = {p.untyped_storage()._cdata for p in strategy.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in weights:
            seen[s._cdata] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = strategy.model(x.to(strategy.device))
    del out
    return sum(seen.values())


def _counterfactual(strategy, x, *, ckpt: bool, autocast: bool) -> int:
    """Saved activations of one forward with checkpointing and / or autocast as given."""
    off = checkpointing_off(strategy.model) if not ckpt else contextlib.nullcontext()
    amp = strategy.autocast() if autocast else contextlib.nullcontext()
    with off, amp:
        return _saved_bytes(strategy, x)


def _frozen_row(strategy, ledger: dict) -> tuple[str, int, str]:
    params = list(strategy.model.parameters())
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    per = sum(ledger.get(k, 0) for k in STATE_CATEGORIES) / max(1, trainable)
    return ("frozen parameters", int(frozen * per),
            f"{frozen:,} frozen elements x {per:.2f} B (gradient + optimizer + master per element)")


def _optim8_row(strategy, ledger: dict) -> tuple[str, int, str]:
    opt = strategy.optimizer
    elements = sum(p.numel() for p in opt.state)
    held = ledger.get("optimizer_states", 0)
    return ("8-bit optimizer", 8 * elements - held,
            f"{elements:,} elements: fp32 Adam 8 B each vs {held / max(1, elements):.2f} B held")


def rows(cfg: Config, strategy, x: torch.Tensor | None) -> list[tuple[str, int, str]]:
    """(technique, bytes saved on this rank, how) for every enabled technique."""
    m, ledger = cfg.memory, strategy.memory_ledger()
    out = []
    if m.freeze or m.lora_rank > 0:
        out.append(_frozen_row(strategy, ledger))
    if cfg.train.optimizer == "adamw8bit" and strategy.optimizer is not None:
        out.append(_optim8_row(strategy, ledger))
    act = ledger.get("activations_peak")
    if m.grad_accum > 1 and act:
        out.append(("gradient accumulation", (m.grad_accum - 1) * act,
                    f"{m.grad_accum} micro-batches: {m.grad_accum} x the measured "
                    f"{human_bytes(act)} of saved activations would be one batch's"))
    whole_forward = presets.forward_is_the_models(cfg)
    measure = x is not None and whole_forward and strategy.model is not None
    amp = m.mixed_precision != "no"
    if m.activation_checkpointing or amp:
        if not measure:
            out.append(("checkpointing / mixed precision", 0, "not measured under this layout "
                        "(no rank runs the whole forward)"))
        else:
            run = _counterfactual(strategy, x, ckpt=m.activation_checkpointing, autocast=amp)
            if m.activation_checkpointing:
                off = _counterfactual(strategy, x, ckpt=False, autocast=amp)
                out.append(("activation checkpointing", off - run,
                            f"saved activations {human_bytes(off)} without, {human_bytes(run)} with"))
            if amp:
                fp32 = _counterfactual(strategy, x, ckpt=m.activation_checkpointing, autocast=False)
                out.append((f"mixed precision ({m.mixed_precision})", fp32 - run,
                            f"saved activations {human_bytes(fp32)} in fp32, {human_bytes(run)} "
                            f"in {m.mixed_precision}"))
    if m.offload != "none":
        params = getattr(strategy, "params_offloaded", False)
        host = ["master_weights", "optimizer_states"] + (["parameters", "gradients"] if params
                                                         else [])
        off_device = ledger.get("on_disk", 0) if m.offload == "disk" else (
            sum(ledger.get(k, 0) for k in host) if strategy.device.type == "cuda" else 0)
        what = "masters, optimizer states" + (", parameter and gradient shards" if params else "")
        store = getattr(strategy, "store", None)
        syncs = store.syncs if store is not None else None
        writes = ("" if syncs is None else "; written chunks synced to the disk at once" if syncs
                  else "; written chunks left to the kernel's writeback (--offload-sync)")
        out.append((f"offload ({m.offload})", off_device, f"{what} off the device"
                    + ("" if off_device or m.offload == "disk" else
                       " (a CPU run: host memory is the device)") + writes))
    return out


def report(cfg: Config, strategy, x: torch.Tensor | None, gather) -> dict:
    """Every rank's peak and rows (``gather``: an all_gather_object over the world)."""
    mine = {"peak": peak_memory_bytes(strategy.device), "rows": rows(cfg, strategy, x)}
    return {"ranks": gather(mine)}


def print_report(rep: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title="memory report (per rank: measured peak; saved = ledger without - with)")
    for col in ("rank", "measured peak", "technique", "saved", "how"):
        t.add_column(col, justify="right" if col in ("measured peak", "saved") else "left")
    for r, rank in enumerate(rep["ranks"]):
        entries = rank["rows"] or [("(no memory technique enabled)", 0, "")]
        for i, (name, saved, how) in enumerate(entries):
            t.add_row(str(r) if i == 0 else "", human_bytes(rank["peak"]) if i == 0 else "",
                      name, human_bytes(saved), how)
    console.print(t)
