"""ZeRO stage 3: parameters, gradients and optimizer states all sharded (FSDP's "full shard").

Units, by policy (as FSDP's auto-wrap): every module of a *unit class* is one unit, wherever it
sits in the tree (the outermost one when they nest). The classes are ``parallel.zero3_units``
(comma-separated class names), or by default the class of the blocks the model's plan names
(models/plans.py: shardwise's ``Block``, HF's ``GPT2Block`` / ``LlamaDecoderLayer``, a registered
plan's), else the largest repeated module class: the class that occurs at least twice and has
the most parameters per instance. Every other child module with parameters and no unit
inside is a unit of its own (for our GPT: tok_emb, pos_emb, ln_f, head); a module's own direct
parameters form a unit on that module. Tied parameters (used by two modules, e.g. HF GPT-2's
``lm_head.weight is transformer.wte.weight``) go to the root unit, which is gathered around the
whole forward and until its gradients are in, so every user finds them gathered. Frozen
parameters are in no unit: every rank keeps them whole (zero.py).

Each unit is one flat, padded chunk (shardwise/comm/flat.py); rank r keeps only slice r of it.
Per unit and step:

    forward   pre-hook: all-gather the unit (wait for the prefetch, if one is in flight), start
              the next unit's all-gather; post-hook: release the whole unit (its storage is
              resized to 0, so tensors autograd saved see the refilled memory later) and hook
              every tensor in the (nested) outputs so that backward re-gathers it
    backward  output-gradient hook: all-gather the unit again, start the previous unit's
              all-gather; gradients accumulate into the unit's staging buffer (zero.py);
              when the last one arrives, free the unit and reduce-scatter the buffer into this
              rank's gradient shard: on CPU blocking (as FSDP2 there), then free the buffer;
              on CUDA asynchronously (``reduce_scatter_async``), waited when a third gradient
              buffer would be needed (zero.py) or before the step
    step      wait for the reduce-scatters, step each unit's fp32 master shard (zero.py);
              nothing to gather: the next forward gathers

Memory per rank (Adam): 16P/N for both mixed precision (2 + 2 + 4 + 8 bytes per parameter) and
fp32 (4 + 4 + 8), plus transient buffers (``comm_buffers``, the high-water mark): at most two
whole units gathered (the one in use and one prefetched; the root unit besides, when it holds
parameters), one whole-size gradient buffer in backward (and a 1/N temporary when it is added
to an accumulated shard; zero.py allows two buffers), and on gloo the backend's
whole-size copy of each collective in flight (zero_memory.py). Measured at 57M parameters
(shardwise/bench/memory.py): an asynchronous reduce-scatter kept its buffer and gloo's copy alive
through the next unit's backward, beside that unit, the prefetched one and its filling buffer
(peak 1.08x FSDP2's); blocking it (the prefetch still overlaps) brought it to 1.0x, so it blocks
on CPU. On CUDA a blocking reduce-scatter would make the compute stream wait for NCCL's after
every unit, serialising communication with the rest of backward; there it runs asynchronously
and costs at most the one extra whole-size buffer ``MAX_GRAD_BUFFERS`` allows. Traffic per
step: 3(N-1)/N K (two all-gathers and one reduce-scatter), 1.5x DDP. With ``overlap`` off nothing
is prefetched and every collective blocks.

Offloaded parameters (``--offload cpu|disk --offload-params``, ZeRO-Infinity): each unit's shard
lives in the offload store (memory/offload.py; in fp32 it is also the master) and is read only by
the unit's all-gathers and the step; each reduced gradient shard is reduce-scattered straight
into the store (from a GPU: into a device temporary, then copied). With disk, a shard is dropped
from memory as soon as its gather is done, a gradient as soon as it is reduced; the next unit's
shard is read by its prefetched all-gather on the backend's thread (or, with a blocking gather
or a GPU's copy, read ahead on the store's), so resident memory holds the gathered units and a
shard or two, not the 16P/N of state: that is all on disk (the ledger's ``on_disk``). Traffic is unchanged; the disk moves per step about 3 reads of the shards, 2 of the
gradients, and one read and write of masters and states (the page cache absorbs what fits). Reference: ZeRO (SC 2020), "P_os+g+p"; Zhao et al.,
"PyTorch FSDP" (VLDB 2023) for the unit / prefetch / reshard-after-forward structure.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from shardwise.comm.flat import alloc_storage, free_storage, storage_bytes
from shardwise.models.plans import CONTAINERS, block_class, block_class_names  # noqa: F401 (block_class re-exported)
from shardwise.parallel.data.zero import Chunk, ZeroStrategy

FREE, INFLIGHT, HELD = "free", "inflight", "held"


def split_units(model: nn.Module, classes: list[str] | None = None,
                trainable_only: bool = False) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters) per unit, in registration (usually forward) order; see the module
    docstring for the policy. ``classes`` None: the largest repeated class."""
    if classes is None:
        found = block_class(model)
        classes = [found] if found else []
    present = {type(m).__name__ for m in model.modules()}
    unknown = [c for c in classes if c not in present]
    if unknown:
        raise ValueError(f"parallel.zero3_units: no module of class {unknown} in the model; fix: "
                         f"use class names from {sorted(present)[:12]}")
    classes = set(classes)
    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    tied = {pid for pid, k in owners.items() if k > 1}     # one tensor, two modules
    seen = set(tied)

    def take(params):
        out = [p for p in params if id(p) not in seen and (p.requires_grad or not trainable_only)]
        seen.update(id(p) for p in out)
        return out

    def holds_unit(m):
        return any(type(s).__name__ in classes for s in m.modules())

    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in classes:
                params = take(child.parameters())
            elif isinstance(child, CONTAINERS) or holds_unit(child):
                params = take(child.parameters(recurse=False))
                if params:                  # its own direct parameters, gathered around it
                    units.append((child, params))
                visit(child)
                continue
            else:
                params = take(child.parameters())
            if params:
                units.append((child, params))
    visit(model)
    root = [p for p in model.parameters() if id(p) in tied] + take(model.parameters(recurse=False))
    root = [p for p in root if p.requires_grad or not trainable_only]
    if root:
        units.insert(0, (model, root))
    return units


def reduce_scatter_async(overlap: bool, device) -> bool:
    """Whether ZeRO-3 launches a unit's backward reduce-scatter asynchronously: with ``overlap``
    on CUDA, where a blocking NCCL call makes the compute stream wait for it (so the next unit's
    backward cannot overlap it). On CPU it blocks: measured faster there, and at 1.0x FSDP2's
    peak memory instead of 1.08x (module docstring)."""
    return overlap and torch.device(device).type == "cuda"


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside a nested output (tuples, dicts, Hugging Face ModelOutput)."""
    return [t for t in tree_flatten(obj)[0] if torch.is_tensor(t)]


class Zero3Strategy(ZeroStrategy):
    """ZeRO-3: everything sharded; each unit gathered just in time and freed after use.

    Partition: rank r owns slice r of every unit's flat parameters, gradients, fp32 masters and
    optimizer state. Collectives: all-gather per unit before forward and again before backward
    (prefetching the next unit), reduce-scatter per unit after its backward (blocking on CPU,
    asynchronous on CUDA: ``reduce_scatter_async``). Memory
    per rank: 16P/N (Adam, mixed precision or fp32) + two whole units and one gradient buffer (at
    most two), and gloo's copies of collectives in flight. Traffic
    per step: 3(N-1)/N K, 1.5x DDP. Reference: ZeRO (SC 2020), "P_os+g+p".

    What differs from :class:`~shardwise.parallel.data.zero.ZeroStrategy` (whose gradient
    staging, reduce-scatters, step phases, state and memory it runs unchanged): ``wrap`` makes
    units instead of buckets and hooks them; ``_chunk_ready`` frees a unit and reduces it at
    once; after the step nothing is gathered (``_launch_gather``: the next forward gathers);
    the ledger's parameters are the shards (``_param_bytes``).
    """
    stages = (3,)
    unit_classes = None   # a pipeline stage's: the whole model's block class (compose.py)

    def wrap(self, model, optimizer_factory) -> None:
        self._adopt(model, optimizer_factory)
        names = getattr(self.cfg.parallel, "zero3_units", "")
        classes = ([c.strip() for c in names.split(",") if c.strip()] or self.unit_classes
                   or block_class_names(model))
        self.units = split_units(self.model, classes, trainable_only=True)
        self._rs_async = reduce_scatter_async(self.overlap, self.device)
        for index, (module, params) in enumerate(self.units):
            c = self._make_chunk(params, full_sharded=True)   # a meta unit: made now, its
            # shard only (models/init.py Materializer.flat: cut from the unit, or read)
            free_storage(c.full)
            if self.grads_offloaded:          # reduced straight into the store (offload.py)
                c.grad_shard = self.store.zeros(c.layout.shard_numel, self.dtype, pin=True)
            else:
                c.grad_shard = torch.zeros(c.shard.shape, dtype=self.dtype, device=self.device)
                free_storage(c.grad_shard)    # alive from its reduce-scatter to the step
            self.store.release([c.shard, c.grad_shard])   # disk: out of RAM until gathered
            c.extra.update(state=FREE, work=None, index=index, backward=False)
            module.register_forward_pre_hook(self._pre_forward_hook(c))
            module.register_forward_hook(self._post_forward_hook(c))
            self.chunks.append(c)
        self._build_optimizer()

    # -- gathering and freeing ------------------------------------------------------------
    def _start_gather(self, c: Chunk, async_op: bool) -> None:
        if c.extra["state"] != FREE:
            return
        alloc_storage(c.full)
        self.memory.alloc("gathered", storage_bytes(c.full))
        c.extra["backend"] = self.memory.backend_bytes(storage_bytes(c.full))   # gloo's copy
        self.memory.alloc("backend", c.extra["backend"])
        src = c.shard
        if src.device != self.device:         # offloaded from a GPU: to the device first
            src = c.extra["src"] = src.to(self.device, non_blocking=True)
        elif self.params_offloaded and self.store.place == "disk":
            # the shard into its own slot of the unit, its file's pages dropped again, and the
            # gather made in place: no page of the shard is resident while the gather runs
            src = c.layout.shard(c.full, self.group.rank)
            src.copy_(c.shard)
            self.store.release([c.shard], written=False)
        c.extra["work"] = self._all_gather(c.full, src, async_op=async_op)
        c.extra["state"] = INFLIGHT

    def _gather(self, c: Chunk) -> None:
        """Make sure the whole unit is here (waiting for a prefetch if one is in flight)."""
        self._start_gather(c, async_op=False)
        if c.extra["state"] == INFLIGHT:
            self._wait_gather(c)

    def _wait_gather(self, c: Chunk) -> None:
        c.extra["work"].wait()
        self.memory.release("backend", c.extra.pop("backend"))
        c.extra["work"], c.extra["state"] = None, HELD
        if c.extra.pop("src", None) is not None:
            self.store.release([c.shard], written=False)   # gathered: may leave RAM again

    def _prefetch(self, index: int, backward: bool) -> None:
        """Start the all-gather of unit ``index`` (the next in this direction). With disk
        offload the store's reader thread reads ahead the shard gathered next: on a CPU run
        with overlap the one after ``index`` (``index``'s is copied into its unit now, on this
        thread, and the gather runs in place), into the page cache only (nothing of it
        resident in this process before its copy); else ``index``'s, mapped (a blocking gather,
        or a GPU run's copy to the device, reads it on this thread)."""
        if self.params_offloaded:
            step = -1 if backward else 1
            ahead = index + (step if self.overlap else 0)
            if 0 <= ahead < len(self.chunks):
                # a CPU run copies the shard into the unit on this thread when its gather
                # starts: into the page cache only, so the copy does not wait for the disk
                self.store.prefetch([self.chunks[ahead].shard],
                                    cache_only=self.device.type == "cpu")
        if self.overlap and 0 <= index < len(self.chunks):
            c = self.chunks[index]
            if not backward or c.extra["backward"]:
                self._start_gather(c, async_op=True)

    def _free(self, c: Chunk) -> None:
        if c.extra["state"] == INFLIGHT:
            self._wait_gather(c)
        if c.extra["state"] != FREE:
            self.memory.release("gathered", storage_bytes(c.full))
            free_storage(c.full)
            c.extra["work"], c.extra["state"] = None, FREE

    # -- hooks ----------------------------------------------------------------------------
    def _pre_forward_hook(self, c: Chunk):
        def hook(module, args):
            self._gather(c)
            self._prefetch(c.extra["index"] + 1, backward=False)
        return hook

    def _post_forward_hook(self, c: Chunk):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward_hook(c))
                        c.extra["backward"] = True
            self._free(c)
        return hook

    def _pre_backward_hook(self, c: Chunk):
        def hook(grad):
            self._gather(c)
            self._prefetch(c.extra["index"] - 1, backward=True)
        return hook

    def _chunk_ready(self, index: int) -> None:
        """Every gradient of the unit is in its staging buffer: free the unit, reduce-scatter.
        On CPU the reduce-scatter blocks (as FSDP2's does there): in flight it would keep the
        staging buffer and gloo's whole-size copy alive across the next unit's backward, beside
        that unit, the prefetched one and the next staging buffer; the overlap kept in backward
        is the prefetched all-gather, which runs during the unit's own backward. On CUDA it is
        launched asynchronously (``reduce_scatter_async``) and waited later (zero.py)."""
        c = self.chunks[index]
        self._free(c)
        c.extra["backward"] = False
        if self.accumulate_unsharded and not self._syncing:
            return                  # a pipeline's earlier micro-batch: the buffer accumulates
        self._reduce_staged(c, async_op=self._rs_async)

    # -- the step and the ledger -----------------------------------------------------------
    def _launch_gather(self, index: int) -> None:
        """Nothing to gather after a unit's step: the next forward gathers it."""

    def _param_bytes(self) -> int:
        """Parameter shards held in memory (0 on disk: the ledger's ``on_disk`` has them)."""
        if self.params_offloaded and self.store.place == "disk":
            return 0
        return sum(storage_bytes(c.shard) for c in self.chunks)
