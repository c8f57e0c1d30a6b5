"""ZeRO stage 3: parameters, gradients and optimizer states all sharded (FSDP's "full shard").

The model is cut into units: each direct child module that has parameters (the items of a
ModuleList / ModuleDict count as children: for the GPT, tok_emb, pos_emb, each block, ln_f and
head), plus one root unit for parameters held by the model itself. Each unit is one flat, padded
chunk (shardwise/comm/flat.py); rank r keeps only slice r of it. Per unit and step:

    forward   pre-hook: all-gather the unit (wait for the prefetch, if one is in flight), start
              the next unit's all-gather; post-hook: release the whole unit (its storage is
              resized to 0, so tensors autograd saved see the refilled memory later) and hook
              the outputs so that backward re-gathers it
    backward  output-gradient hook: all-gather the unit again, start the previous unit's
              all-gather; when every parameter's gradient has arrived (post-accumulate-grad
              hooks): copy the gradients into one buffer, free them and the unit, and
              reduce-scatter into this rank's gradient shard
    step      wait for the reduce-scatters, step each unit's fp32 master shard (zero_base.py);
              nothing to gather: the next forward gathers

Memory per rank (Adam): 16P/N for both mixed precision (2 + 2 + 4 + 8 bytes per parameter) and
fp32 (4 + 4 + 8), plus transient whole units (at most the unit in use and one prefetched) and
gradient staging buffers (reported as ``comm_buffers``). Traffic per step: 3(N-1)/N K (two
all-gathers and one reduce-scatter), 1.5x DDP. With ``overlap`` off nothing is prefetched and
every collective blocks. Reference: ZeRO (SC 2020), "P_os+g+p"; Zhao et al., "PyTorch FSDP"
(VLDB 2023) for the unit / prefetch / reshard-after-forward structure.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.flat import alloc_storage, free_storage, storage_bytes
from shardwise.parallel.zero_base import Chunk, ZeroBase

FREE, INFLIGHT, HELD = "free", "inflight", "held"


def split_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters) per unit, in registration (usually forward) order."""
    units, seen = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child)
                continue
            params = [p for p in child.parameters() if p not in seen]
            if params:
                seen.update(params)
                units.append((child, params))
    root = [p for p in model.parameters(recurse=False)]
    seen.update(root)
    visit(model)
    if root:
        units.insert(0, (model, root))
    return units


class Zero3Strategy(ZeroBase):
    """ZeRO-3: everything sharded; each unit gathered just in time and freed after use.

    Partition: rank r owns slice r of every unit's flat parameters, gradients, fp32 masters and
    optimizer state. Collectives: all-gather per unit before forward and again before backward
    (prefetching the next unit), reduce-scatter per unit after its backward. Memory per rank:
    16P/N (Adam, mixed precision or fp32) + two whole units. Traffic per step: 3(N-1)/N K, 1.5x
    DDP. Reference: ZeRO (SC 2020), "P_os+g+p".
    """
    name, stage = "zero3", 3

    def wrap(self, model, optimizer_factory) -> None:
        self.model = model.to(self.device)
        self.units = split_units(self.model)
        for index, (module, params) in enumerate(self.units):
            c = self._make_chunk(params, full_sharded=True)
            free_storage(c.full)
            c.grad_shard = c.shard.new_zeros(c.shard.shape)
            c.extra.update(state=FREE, work=None, index=index, backward=False)
            module.register_forward_pre_hook(self._pre_forward_hook(c))
            module.register_forward_hook(self._post_forward_hook(c))
            self.chunks.append(c)
        self._build_optimizer(optimizer_factory)
        self._reducing: list[tuple] = []

    # -- gathering and freeing ------------------------------------------------------------
    def _start_gather(self, c: Chunk, async_op: bool) -> None:
        if c.extra["state"] != FREE:
            return
        alloc_storage(c.full)
        self._comm_alloc(storage_bytes(c.full))
        c.extra["work"] = self._all_gather(c.full, c.shard, async_op=async_op)
        c.extra["state"] = INFLIGHT

    def _gather(self, c: Chunk) -> None:
        """Make sure the whole unit is here (waiting for a prefetch if one is in flight)."""
        self._start_gather(c, async_op=False)
        if c.extra["state"] == INFLIGHT:
            c.extra["work"].wait()
            c.extra["work"], c.extra["state"] = None, HELD

    def _prefetch(self, index: int, backward: bool) -> None:
        if self.overlap and 0 <= index < len(self.chunks):
            c = self.chunks[index]
            if not backward or c.extra["backward"]:
                self._start_gather(c, async_op=True)

    def _free(self, c: Chunk) -> None:
        if c.extra["state"] == INFLIGHT:
            c.extra["work"].wait()
        if c.extra["state"] != FREE:
            self._comm_live -= storage_bytes(c.full)
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
                tensors = output if isinstance(output, (tuple, list)) else [output]
                for t in tensors:
                    if torch.is_tensor(t) and t.requires_grad:
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
        """Every gradient of the unit is in: stage them, free the unit, reduce-scatter."""
        c = self.chunks[index]
        self._stage_and_reduce(c)
        self._free(c)
        c.extra["backward"] = False
        c.grad_valid = True                # later micro-steps add into the shard

    def _after_backward(self) -> None:
        if not self._syncing:
            self._finish_reductions()

    def _finish_reductions(self) -> None:
        for c, work, temp, staging in self._reducing:
            work.wait()
            if temp is not None:
                c.grad_shard.add_(temp)
                self._comm_live -= storage_bytes(temp)
            self._comm_live -= storage_bytes(staging)
        self._reducing.clear()

    # -- ledger ---------------------------------------------------------------------------
    def _param_bytes(self) -> int:
        return sum(storage_bytes(c.shard) for c in self.chunks)

    def _grad_bytes(self) -> int:
        return sum(storage_bytes(c.grad_shard) for c in self.chunks)
