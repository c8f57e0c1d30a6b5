"""The one training loop every strategy runs.

Per step: learning rate from the schedule -> this process's shard of the global batch ->
``strategy.train_step`` -> metrics. Evaluation every ``eval_every`` steps and at the end.
Rank 0 shows a progress bar (or a log line every ``log_every`` steps when stdout is not a
terminal), writes ``metrics.jsonl`` (the mean over each logging window; shardwise/run/runlog.py) and
``summary.json``, and prints the summary table (its tokens/s is the median step's, from the
third step on; with ``--compile`` the first step's compilation is ``compile_seconds`` there,
never in tokens/s). SIGINT / SIGTERM stop the loop cleanly
(shardwise/run/stopping.py). With ``train.checkpoint_dir`` set, the loop saves a checkpoint every
``checkpoint_every`` steps, at the end and when stopped (the stop is taken at the next step
boundary, after the save: checkpoint/stop.py), and ``train.resume`` continues from the latest
one (a token run also leaves the plain model's weights as ``final.safetensors``, for ``shardwise
generate``): exactly in the same layout, resharded in another (shardwise/checkpoint/). A loss that turns nan or infinite stops the loop at that step with
:class:`NonFiniteLoss` (the CLI prints its one line and exits 1; the metrics so far are kept):
the check reads the float ``train_step`` already returns every step (averaged over the data
shards, so every rank sees the same value and all stop together), so it adds no device sync.
With ``--ft-replicas`` (parallel/replicas.py) each step
first takes a quorum of the live replica groups, trains on this group's share of the global
batch and averages over the live groups, redone in a new quorum when a peer is lost; a
restarted group joins before its first step with a live group's state and step. Checkpoints
are then written by the lowest-id live group only, and a stop is agreed in the quorum instead
of over the world: every group leaves at the same step boundary, the writer saving that step.
Per-rank figures (peak memory, bytes sent)
are gathered to rank 0 with one small object collective per logged step (metered as 'objects',
left out of the traffic figures).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch

from dataclasses import replace

from shardwise import checkpoint
from shardwise.run.api import Engine, optimizer_factory, prepare
from shardwise.checkpoint.checks import check as check_checkpoint
from shardwise.run.deferred_stop import DeferredStop
from shardwise.comm.collectives import CollectiveError
from shardwise.config import Config, to_dict
from shardwise.data import build_data
from shardwise.parallel.layout import describe
from shardwise.parallel.replicas import StopAgreed, attach as attach_replicas
from shardwise.run import memreport
from shardwise.config import rundir
from shardwise.run import stopping
from shardwise.run.metrics import device_peak_flops, peak_memory_bytes, print_summary
from shardwise.models import build_model, loss_for
from shardwise.run.runlog import RunLog, Window, strict_tree
from shardwise.run.runtime import Runtime, init_runtime
from shardwise.run.stopping import Stopped

IMAGE_SETS = ("digits", "mnist", "fashion-mnist")    # the other datasets are token streams
FINAL_WEIGHTS = "final.safetensors"                  # the plain model at the end (token runs)


class NonFiniteLoss(RuntimeError):
    """The global batch's loss was nan or infinite: training cannot recover, so it stops."""

    def __init__(self, step: int, loss: float, lr: float):
        super().__init__(f"the training loss is {loss} at step {step} (lr {lr:g}); the metrics "
                         "so far are kept; fix: lower --lr, set --grad-clip 1.0, or use bf16 "
                         "instead of fp16")
        self.step = step


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to 10% of it (or constant)."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def init_mode(cfg: Config, plan) -> str:
    """``model.init``, except that the model is built whole (eager) when something must be read
    into the whole plain model first: a resume that reshards. (``--hf-weights`` on the meta
    path: each rank reads only its pieces, models/weights.py.)"""
    if plan is not None and not plan.exact:
        return "eager"
    return cfg.model.init


def run_dir(cfg: Config) -> str:
    return rundir.path(cfg)


def evaluate(engine: Engine, data, cfg: Config) -> tuple[float, float | None]:
    """Mean validation loss (and accuracy) over ``eval_batches`` fixed global batches."""
    index, count = engine.strategy.data_shard()
    losses, accs = [], []
    for i in range(cfg.train.eval_batches):
        x, y = data.batch(i, cfg.train.batch_size, index, count, split="val")
        loss, acc = engine.evaluate(x, y)
        losses.append(loss)
        if acc is not None:
            accs.append(acc)
    return sum(losses) / len(losses), (sum(accs) / len(accs) if accs else None)


def train(cfg: Config, runtime: Runtime | None = None, *, quiet: bool = False) -> dict:
    """Train ``cfg`` in the current world and return the summary (also written to summary.json)."""
    rt = runtime or init_runtime(cfg)
    found = check_checkpoint(cfg, rt.world_size)
    plan = checkpoint.plan_resume(cfg, rt.world_size, found)
    if plan is not None and rt.is_main and not quiet:
        print(plan.line(), flush=True)
    data = build_data(cfg)
    model = build_model(cfg.model, cfg.train.seed, init=init_mode(cfg, plan))
    checkpoint.restore_model(model, plan)            # a reshard: into the plain model
    flops_per_item = model.flops_per_token() if hasattr(model, "flops_per_token") else None
    # the strategy is built for the steps this run still takes (the ps counts its messages)
    left = replace(cfg, train=replace(cfg.train, steps=cfg.train.steps - plan.step)) if plan else cfg
    engine = prepare(model, optimizer_factory(cfg), left, loss_fn=loss_for(cfg.model), runtime=rt)
    start = checkpoint.restore(engine, plan)         # last: it also sets the RNG states
    ft = attach_replicas(engine.strategy, cfg, run_dir(cfg))   # --ft-replicas, else None
    if ft is not None:
        ft.finish_saves = lambda: _finish_background_save(engine)
        try:
            start = ft.join(start)      # the live groups' step, with their state
        except StopAgreed as exc:       # the others stopped before this group rejoined
            raise Stopped(exc.signum) from None
    index, count = engine.strategy.data_shard()
    items = cfg.train.batch_size * (cfg.model.block_size if data.kind == "tokens" else 1)
    out = run_dir(cfg)
    main = rt.is_main
    unit = "tok" if data.kind == "tokens" else "samples"
    log = RunLog(out, cfg.logging, cfg.train.steps, unit, main, quiet, first_step=start)
    peak = device_peak_flops(rt.device)
    losses, step_times, val, train_sent = [], [], (None, None), 0
    window, done, saved = Window(), start, start
    stop = DeferredStop(enabled=bool(cfg.train.checkpoint_dir))
    began = time.perf_counter()
    try:
        stop.__enter__()
        for step in range(start, cfg.train.steps):
            rt.comm.at_step(step + 1)
            lr = lr_at(step, cfg)
            engine.strategy.set_lr(lr)
            batch = lambda i, n: data.batch(0 if cfg.data.repeat_batch else step,  # noqa: E731
                                            cfg.train.batch_size, i, n)
            x, y = batch(index, count) if ft is None else (None, None)
            sent0 = rt.comm.meter.total().bytes_sent
            t0 = time.perf_counter()
            if ft is None:
                loss = engine.train_step(x, y)
            else:   # --ft-replicas: this step's quorum and share (parallel/replicas.py)
                try:
                    loss, x, y = ft.train_step(step, batch, lambda: stop.signum)
                except StopAgreed as agreed:   # every live group stops before this step
                    if cfg.train.checkpoint_dir and agreed.writer and saved != done:
                        checkpoint.save(engine, cfg, done)
                    _finish_background_save(engine)   # --checkpoint-async: written first
                    stop.stop(agreed.signum)
            dt = time.perf_counter() - t0
            sent = rt.comm.meter.total().bytes_sent - sent0   # this step's training traffic only
            train_sent += sent
            losses.append(loss)
            step_times.append(dt)
            window.add(loss, dt, sent)
            done = step + 1
            if not math.isfinite(loss):   # the same value on every rank: all stop here
                log.write(_record(step, window, lr, items, flops_per_item, peak, None, rt))
                raise NonFiniteLoss(done, loss, lr)
            last = step == cfg.train.steps - 1
            evaluated = bool(cfg.train.eval_every and done % cfg.train.eval_every == 0) or last
            if evaluated:
                val = evaluate(engine, data, cfg)
            if done % cfg.logging.log_every == 0 or last:
                log.write(_record(step, window, lr, items, flops_per_item, peak,
                                  val if evaluated else None, rt))
                window.reset()
            log.progress(loss, val[0])
            saved = _checkpoint(engine, cfg, done, last, saved, stop, ft)
    except Stopped as exc:
        if main:
            stopping.write_marker(out, done, exc.signum)
        raise
    except CollectiveError as exc:
        exc.step = done + 1           # the step this rank was in when its peers went missing
        raise
    finally:
        stop.__exit__()
        log.close()
    if ft is not None:
        ft.finish()
    _finish_background_save(engine)   # a group that saved before it stopped being the writer
    summary = _summary(cfg, engine, rt, losses, step_times, val, items, flops_per_item, peak,
                       time.perf_counter() - began, train_sent)
    if data.kind == "tokens":   # after the summary: its gather is not the training's traffic
        _save_final(engine, out, main)   # every rank: gathering a sharded model is a collective
    summary["start_step"] = start
    summary["run_dir"] = out          # this run's folder (metrics, final weights, summary)
    if cfg.memory.memory_report:      # every rank: the counterfactual forwards may communicate
        summary["memory_report"] = memreport.report(cfg, engine.strategy, x,
                                                    lambda v: _per_rank(rt, v))
    if cfg.train.checkpoint_move_last and saved != done and \
            (ft is None or ft.writes_checkpoints()):      # last: the state goes into it
        checkpoint.save(engine, cfg, done, move=True)
    summary["checkpoint"] = checkpoint.store.latest(cfg.train.checkpoint_dir) \
        if cfg.train.checkpoint_dir else None
    if main:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump(strict_tree({**summary, "config": to_dict(cfg)}), fh, indent=2, allow_nan=False)
        if not quiet:
            print_summary(summary)
            if "memory_report" in summary:
                memreport.print_report(summary["memory_report"])
            print(f"metrics: {os.path.join(out, 'metrics.jsonl')}  summary: {os.path.join(out, 'summary.json')}")
    summary["engine"] = engine
    return summary


def _checkpoint(engine: Engine, cfg: Config, done: int, last: bool, saved: int,
                stop: DeferredStop, ft=None) -> int:
    """After step ``done``: save when it is due (every ``checkpoint_every``, the last step:
    with ``checkpoint_move_last`` train() moves that one after the final weights) or when any
    rank was asked to stop (then stop: raises Stopped). Returns the last saved step. Under
    ``--ft-replicas`` (``ft``) only the lowest-id live group saves, and the stop is agreed in
    the next step's quorum instead (train()'s StopAgreed); a group that is no longer the
    writer finishes a background save (``--checkpoint-async``) it began as the writer
    before its next step's vote (ReplicaGroups.finish_saves), so the new writer's save
    begins after it is published."""
    if not cfg.train.checkpoint_dir:
        return saved
    every = cfg.train.checkpoint_every
    moved_later = last and cfg.train.checkpoint_move_last   # train() moves it, at the very end
    due = (last and not moved_later) or (every and done % every == 0 and not moved_later)
    if due and (ft is None or ft.writes_checkpoints()):
        checkpoint.save(engine, cfg, done)
        saved = done
    if ft is not None:
        return saved
    signum = stop.agreed(engine.runtime.comm, engine.runtime.mesh.world)
    if signum:
        if saved != done:
            checkpoint.save(engine, cfg, done)
        _finish_background_save(engine)   # a background save of this step: written first
        stop.stop(signum)
    return saved


def _finish_background_save(engine: Engine) -> None:
    """Wait for a ``--checkpoint-async`` save still being written (and published), if any."""
    pending = getattr(engine, "checkpoint_async", None)
    if pending is not None:
        pending.wait()


def _save_final(engine: Engine, out: str, main: bool) -> None:
    """``final.safetensors`` in the run directory: the plain model's parameters by name after
    the last step (gathered from any layout), which ``shardwise generate`` samples from. Where
    the strategy gathers a piece at a time (``full_state_order``: ZeRO a chunk at a time, ZeRO
    x tp, tp and the plain layouts a parameter at a time, pipelines stage by stage), rank 0
    streams the file through checkpoint/export.py's writer, holding one piece and one write
    group, never the whole model; else the whole state is gathered and written at once."""
    order = getattr(engine.strategy, "full_state_order", lambda: None)()
    path = os.path.join(out, FINAL_WEIGHTS)
    if order is None:
        from safetensors.torch import save_file
        state = {k: v.contiguous() for k, v in engine.full_state_dict().items()}
        if main:
            os.makedirs(out, exist_ok=True)
            save_file(state, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)
        return
    groups = engine.strategy.full_state_groups()
    try:
        if main:
            from shardwise.checkpoint import export as export_io
            os.makedirs(out, exist_ok=True)
            buffer: dict = {}

            def read(keys: list[str]) -> dict:
                while any(k not in buffer for k in keys):
                    buffer.update(next(groups))
                return {k: buffer.pop(k) for k in keys}
            specs = [export_io.Spec(n, n, shape, torch.float32) for n, shape in order]
            export_io.write(path, specs, read, export_io.READ_BUFFER)
    finally:
        for _ in groups:        # every rank gathers every chunk (the collectives must match)
            pass


def _per_rank(rt: Runtime, value) -> list:
    return rt.comm.all_gather_object(value, rt.mesh.world)


def _record(step, window: Window, lr, items, flops_per_item, peak, val, rt) -> dict:
    """One metrics record: the logging window's means; per-rank figures gathered from every rank.
    ``val`` is (loss, accuracy) when evaluation ran at this step, else None (and left out)."""
    mems = _per_rank(rt, peak_memory_bytes(rt.device))
    sents = _per_rank(rt, window.sent / window.steps)
    rate = items * window.steps / window.seconds if window.seconds > 0 else float("nan")
    record = {
        "step": step + 1, "loss": window.mean_loss(), "window_steps": window.steps, "lr": lr,
        "step_seconds": window.seconds / window.steps, "items_per_second": rate,
        "mfu": (rate * flops_per_item / (peak * rt.world_size)) if (peak and flops_per_item) else None,
        "peak_memory_per_rank": mems, "bytes_sent_per_rank": sents,
    }
    if val is not None:
        record["val_loss"] = val[0]
        if val[1] is not None:
            record["val_accuracy"] = val[1]
    return record


def _summary(cfg, engine, rt, losses, step_times, val, items, flops_per_item, peak, wall,
             train_sent: int) -> dict:
    steps = len(losses)
    # the first steps pay one-time costs (allocations, lazy init, --compile's compilation:
    # compile_seconds): leave them out of the median
    steady = step_times[min(2, steps - 1):]
    rate = items / statistics.median(steady)
    meter = rt.comm.meter
    # training traffic only: start-up broadcasts and evaluation are left out
    sent_per_step = train_sent / max(1, steps)
    return {
        "strategy": cfg.parallel.strategy, "layout": describe(cfg),
        "world_size": rt.world_size, "steps": steps,
        "losses": losses, "final_loss": losses[-1], "val_loss": val[0], "val_accuracy": val[1],
        "throughput": rate, "compile_seconds": _compile_seconds(cfg, step_times),
        "throughput_unit": "samples" if cfg.data.dataset in IMAGE_SETS else "tokens",
        "mfu": (rate * flops_per_item / (peak * rt.world_size)) if (peak and flops_per_item) else None,
        "wall_seconds": wall, "cpu_allocator": rt.allocator,
        "peak_memory_per_rank": _per_rank(rt, peak_memory_bytes(rt.device)),
        "bytes_sent_per_rank": _per_rank(rt, sent_per_step),
        "comm": meter.snapshot(), "ledger": engine.strategy.memory_ledger(),
        "trainable_parameters": _trainable(engine),
        "loss_scale": engine.strategy.scaler.report(),     # fp16: scale and skipped steps
    }


def _compile_seconds(cfg: Config, step_times: list[float]) -> float | None:
    """``--compile``: what this process's first step spent compiling, estimated as its time
    minus the median of the later steps (Dynamo traces and Inductor builds, or reads from its
    cache, every block's forward and backward in the first step; the next shapes, e.g.
    evaluation's no-grad forward, compile on their first call, outside the step times). None
    without --compile, or with one step (nothing to subtract)."""
    if not cfg.memory.compile or len(step_times) < 2:
        return None
    return max(0.0, step_times[0] - statistics.median(step_times[1:]))


def _trainable(engine: Engine) -> list[int] | None:
    """(trainable, total) parameter elements this rank holds (LoRA / freeze report it)."""
    model = engine.strategy.model
    if model is None:
        return None
    params = list(model.parameters())
    return [sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)]
