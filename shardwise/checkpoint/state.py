"""What a checkpoint holds, how every rank saves it, and how a run resumes from it.

One DCP checkpoint (checkpoint/dcp_io.py) per save, with three parts:

    rank<r>/state     rank r's own state, exactly as its strategy holds it, as opaque bytes
                      (torch.save in memory): ``strategy.state_dict()`` (model or shards,
                      optimizer or its shards, ZeRO masters, ps counters), the loss scaler, and
                      the rank's RNG states (torch CPU, Python ``random``, numpy, and the
                      rank's own CUDA device's on a CUDA run)
    model/...         the layout-free model (checkpoint/canonical.py), whole, written once
    optim/...         the layout-free optimizer state, where the layout has one (canonical.py)

plus ``meta.json`` (store.py): step, world size, layout, the layout key, sizes, config.

ZeRO with disk offload (``strategy.checkpoint_parts()``: the state may be larger than RAM)
gathers nothing: each rank writes its own boxes of ``model/...`` and ``optim/...``
(checkpoint/pieces.py; the same keys, read whole by every reader) and a ``rank<r>/state``
without the masters and element-wise optimizer states, which an exact resume reads back from
its boxes. Such a save is always written at once (never in the background: that would copy
the state into memory).

The data position and the learning-rate schedule are functions of the step (train.py's
``data.batch(step, ...)`` and ``lr_at(step, cfg)``), so the step is all they need.

Resume (:func:`plan_resume` before the model is wrapped, :func:`restore` after): a checkpoint
saved by the same layout at the same world size (:func:`layout_key` equal) loads each rank's
own ``rank<r>/state``, so the resumed run is bit-identical to one that never stopped (tested
on CPU for every layout). Any other layout reshards: the canonical model goes into the plain
model before ``prepare`` and the canonical optimizer state into the new layout after it
(memory: the whole model and optimizer state on every rank while loading). What can do
neither is refused before launch (checks.py).
"""
from __future__ import annotations

import math
import os
import random
import threading
from dataclasses import dataclass

import numpy as np
import torch

from shardwise.checkpoint import canonical, dcp_io, pieces, store
from shardwise.config import Config, to_dict
from shardwise.parallel.layout import describe, resolve
from shardwise.parallel.presets import DATA_MODEL, resolve_dp

# parallel and memory settings that do not change what a rank holds, so that a resume may
# change them and still load the ranks' own states
_FREE = {"nproc_per_node", "overlap", "allreduce", "grad_compression", "find_unused",
         "num_microbatches", "schedule", "ps_timeout", "on_worker_failure", "straggler",
         "grad_accum", "activation_checkpointing", "compile", "memory_report", "offload_dir"}


def layout_key(cfg: Config, world_size: int) -> dict:
    """What must be equal for a rank to load its own saved state: world size, the parallel and
    memory settings that shape the shards, the model and the optimizer. A composed layout is
    its (dp, tp, pp, zero stage), whatever name it was typed with (``--strategy pp --pp 2`` is
    ``--pp 2``; ``--zero1-over-dp`` is stage 1)."""
    cfg = resolve(cfg)
    d = to_dict(cfg)
    part = {f"{sec}.{k}": v for sec in ("parallel", "memory")
            for k, v in d[sec].items() if k not in _FREE}
    if cfg.parallel.strategy in DATA_MODEL:
        part.update({"parallel.strategy": "composed", "parallel.zero1_over_dp": None,
                     "parallel.dp": resolve_dp(cfg, world_size)})
    return {"world_size": world_size, **part, "model": d["model"],
            "optimizer": cfg.train.optimizer}


def rng_state(device) -> dict:
    """This rank's RNG states: torch's CPU generator, Python's ``random``, numpy's and, only when
    the run's ``device`` is a CUDA device, that device's generator (``"cuda"``: one state, not
    every visible GPU's). A CPU run makes no CUDA call: a forked CPU world on a machine with
    GPUs cannot initialise CUDA."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device) -> None:
    """Restore :func:`rng_state`'s states. The CUDA state goes to the run's own ``device`` only,
    and only on a CUDA run: a checkpoint saved on CPU leaves the CUDA generator as it is, one
    saved on CUDA resumed on CPU makes no CUDA call. A list (every visible GPU's state, as
    checkpoints before this one saved it) gives this device's entry, if it has one: the number
    of visible GPUs may have changed."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    device, cuda = torch.device(device), state.get("cuda")
    if cuda is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):
        index = device.index if device.index is not None else 0
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def save(engine, cfg: Config, step: int, move: bool = False) -> str:
    """Every rank: save the state after ``step`` optimizer steps into
    ``train.checkpoint_dir``/step-<step>, then (rank 0) publish it (store.publish). Collective
    over the world. Returns the folder (published, or to be published once the background
    write is complete: ``train.checkpoint_async`` before the last step, see :class:`AsyncSave`).
    A background save still in flight is finished (and published) first. ``move``
    (``--checkpoint-move-last``, a layout that writes its own pieces: disk offload): the
    offload files' disk blocks are freed as their pieces are written (the spare ones, such as
    the gradients, first), so the checkpoint replaces the state on disk instead of copying it;
    the strategy cannot be used afterwards (``strategy.moved_to`` names the checkpoint)."""
    rt, strategy = engine.runtime, engine.strategy
    world, root = rt.mesh.world, cfg.train.checkpoint_dir
    pending = getattr(engine, "checkpoint_async", None)
    if pending is not None:
        pending.wait()
    if rt.is_main:
        store.begin(root, step)
    rt.comm.barrier(world)                         # the folder exists before anyone writes
    parts = _parts(strategy)
    if move and parts is None:
        raise RuntimeError("checkpoint_move_last: this layout does not write its checkpoint "
                           "from offload files (ZeRO with --offload disk, no tp / pp does)")
    if move:
        parts["discard"](parts["spare"])
    if parts is None:
        state, tensors, reshard = _state(strategy, cfg, rt)
        boxes = None
    else:
        state, boxes = _streamed_state(strategy, parts, rt)
        tensors, reshard = None, True
    tmp = store.partial_path(root, step)
    publish = None
    if rt.is_main:
        def publish() -> str:
            count = sum(t.numel() for t in tensors.values()) if tensors is not None else \
                sum(math.prod(v[0]) for k, v in dcp_io.stored(tmp).items()
                    if v is not None and k.startswith(canonical.MODEL))
            meta = {"step": step, "world_size": rt.world_size,
                    "layout": describe(resolve(cfg)), "strategy": cfg.parallel.strategy,
                    "layout_key": layout_key(cfg, rt.world_size), "reshardable": reshard,
                    "parameters": count,
                    "bytes": store.folder_bytes(tmp), "config": to_dict(cfg),
                    "files": store.checksums(tmp)}
            # replica groups: one trajectory, saved by whichever group writes; a former
            # writer's background save may finish after the current one's (run/train.py)
            return store.publish(root, step, meta, cfg.train.keep_checkpoints,
                                 newest_only=cfg.parallel.ft_replicas > 1)
    if cfg.train.checkpoint_async and step < cfg.train.steps and boxes is None:
        if pending is None:                        # once per run: a collective over the world
            pending = engine.checkpoint_async = AsyncSave(dcp_io.new_save_group(world))
        pending.start(state, tmp, publish)
        return os.path.join(root, store.step_name(step))
    # returns when every rank's file is written
    if move:
        strategy.moved_to = os.path.join(root, store.step_name(step))
    dcp_io.save(state, tmp, world, boxes, parts["release"] if parts else None,
                parts["discard"] if move else None)
    folder = publish() if publish else os.path.join(root, store.step_name(step))
    rt.comm.barrier(world)                         # published before any rank goes on
    return folder


def _state(strategy, cfg: Config, rt) -> tuple[dict, dict, bool]:
    """What this rank writes (module docstring), the canonical model tensors, and whether the
    layout-free optimizer state is in it. Collectives: the strategy's gathers."""
    state = {f"rank{rt.rank}/state": dcp_io.as_bytes({
        "strategy": strategy.state_dict(), "scaler": strategy.scaler.state_dict(),
        "rng": rng_state(rt.device)})}
    tensors = canonical.model_state(strategy, rt.comm, rt.mesh)
    state.update({canonical.MODEL + k: v for k, v in tensors.items()})
    reshard = canonical.why_not_reshardable(cfg) is None
    if reshard:
        state.update(canonical.flat_optimizer(strategy.canonical_optimizer_state()))
    state["common/scaler"] = dcp_io.as_bytes(strategy.scaler.state_dict())
    if rt.is_main:                                 # one rank's value per key (DCP dedups)
        state["common/rng"] = dcp_io.as_bytes(rng_state(rt.device))
    return state, tensors, reshard


def _parts(strategy) -> dict | None:
    """The strategy's pieces to write without gathering (disk offload: pieces.py), or None."""
    parts = getattr(strategy, "checkpoint_parts", None)
    return parts() if parts is not None else None


def _streamed_state(strategy, parts: dict, rt) -> tuple[dict, list]:
    """:func:`_state` for a layout that writes its own pieces (pieces.py): this rank's state
    without the masters and element-wise optimizer states, the whole tensors (frozen
    parameters, buffers, scalar states), and the pieces of the layout-free tensors."""
    pieces_, whole = pieces.of_parts(parts)
    state = {f"rank{rt.rank}/state": dcp_io.as_bytes({
        "strategy": parts["state"], "scaler": strategy.scaler.state_dict(),
        "rng": rng_state(rt.device), "streamed": True}), **whole}
    state["common/scaler"] = dcp_io.as_bytes(strategy.scaler.state_dict())
    if rt.is_main:
        state["common/rng"] = dcp_io.as_bytes(rng_state(rt.device))
    return state, pieces_


class AsyncSave:
    """The background save of one run (``train.checkpoint_async``), kept on the engine as
    ``engine.checkpoint_async``: at most one in flight.

    DCP's ``async_save`` stages (copies) the state before it returns and writes it in its
    writer thread; DCP's collectives there run over a gloo group of their own (made once per
    run), never the training's. Rank 0's future is done only when every rank's file and the
    .metadata are written, and then (in the writer thread) rank 0 publishes as a synchronous
    save does: meta.json, rename, ``latest``. So ``latest`` names only complete checkpoints,
    as before; a crash or kill during the write leaves the ``.partial`` folder unpublished.
    ``wait`` (the next save does it first; so does the last step's save, written at once)
    returns once this rank's write is done and, on rank 0, published; it raises what the
    writer raised. Memory: the staged copy of this rank's checkpoint state while it is written."""

    def __init__(self, group):
        self.group, self.future, self.error = group, None, None
        self.published = threading.Event()

    def start(self, state: dict, folder: str, publish) -> None:
        self.published.clear()
        self.error = None
        future = dcp_io.save_async(state, folder, self.group)
        self.future = getattr(future, "upload_completion", future)

        def done(f) -> None:
            try:
                f.result()
                if publish is not None:
                    publish()
            except BaseException as exc:   # re-raised by wait, in the training thread
                self.error = exc
            finally:
                self.published.set()
        self.future.add_done_callback(done)

    def wait(self) -> None:
        if self.future is None:
            return
        self.published.wait()
        self.future = None
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class ResumePlan:
    folder: str
    step: int
    exact: bool      # the same layout and world: each rank loads its own state
    skipped: str = ""    # the damaged checkpoints passed over (store.Found.note), or ""

    def line(self) -> str:
        """What the run prints once as it resumes."""
        how = "exactly" if self.exact else "resharded into this layout"
        tail = f"; {self.skipped}" if self.skipped else ""
        return f"resuming from step {self.step} ({self.folder}, {how}){tail}"


def plan_resume(cfg: Config, world_size: int, found: store.Found | None = None) -> ResumePlan | None:
    """``train.resume``: the newest intact checkpoint (``latest``'s unless it is damaged:
    store.newest_intact; ``found`` when the caller has looked already) and how to load it
    (checks.py has refused, before launch, what cannot load)."""
    if not cfg.train.resume:
        return None
    found = found or store.newest_intact(cfg.train.checkpoint_dir)
    if found.folder is None:
        raise FileNotFoundError(f"no intact checkpoint in {cfg.train.checkpoint_dir}")
    meta = store.read_meta(found.folder)
    exact = meta["layout_key"] == layout_key(cfg, world_size)
    return ResumePlan(found.folder, int(meta["step"]), exact, found.note())


def restore_model(model, plan: ResumePlan | None) -> None:
    """Before ``prepare``: a reshard puts the canonical model into the plain model."""
    if plan is not None and not plan.exact:
        canonical.load_model(model, dcp_io.read_tensors(plan.folder, canonical.MODEL))


def restore(engine, plan: ResumePlan | None) -> int:
    """After ``prepare``: load the optimizer (and, exactly, everything else) and the RNG
    states; returns the step to continue from (0 without a plan)."""
    if plan is None:
        return 0
    rt, strategy = engine.runtime, engine.strategy
    if plan.exact:
        own = dcp_io.read_object(plan.folder, f"rank{rt.rank}/state", rt.mesh.world)
        if own.get("streamed"):                    # the masters and states: this rank's pieces
            def read(parts: dict) -> None:
                dcp_io.load_pieces(pieces.of_parts(parts)[0], plan.folder, rt.mesh.world,
                                   parts["release"])
            strategy.load_state_dict(own["strategy"], read)
        else:
            strategy.load_state_dict(own["strategy"])
        strategy.scaler.load_state_dict(own["scaler"])
        set_rng_state(own["rng"], rt.device)
        return plan.step
    optim = dcp_io.read_tensors(plan.folder, canonical.OPTIM)
    strategy.load_canonical_optimizer_state(canonical.nested_optimizer(optim))
    strategy.scaler.load_state_dict(dcp_io.read_object(plan.folder, "common/scaler", None))
    set_rng_state(dcp_io.read_object(plan.folder, "common/rng", None), rt.device)
    return plan.step
