"""The flat ZeRO-1 of a pipeline (3d with ``--zero-stage 1``): a mixin of parallel/hybrid.py's
HybridStrategy, over this stage's (tensor-parallel) parameters.

Parameters and gradients are views of one flat buffer per optimizer parameter group (padded to a
multiple of dp). After the step's last micro-batch, each group's gradient is reduce-scattered over
dp in place (through the shared reducer, native or ring: meter ``zero1_grad``): this rank's 1/dp
slice of the flat gradient receives the average, so no second gradient buffer exists (the rest
of the flat holds this rank's own gradients, or the ring's partial sums, until zero_grad); each
dp rank updates its 1/dp slice of the flat parameters in place (fp32: the slice is the master, no
copy), then the slices are all-gathered (``zero1_params``). The user's parameter groups are kept: the factory is
called once on the parameters (a probe) to learn each one's group. Frozen parameters stay out.

Clipping: the squared norm is summed once over the world (meter ``grad_norm``): each rank counts
its dp shard's entries, tp-split parameters on every tp rank, tp-replicated ones (norms,
row-parallel biases, pos_emb) on tp rank 0 only, each stage its own layers.
A user's ``optimizer.zero_grad`` zeroes the flat gradients in place (torch's default
set_to_none=True would drop the views), and step pre / post hooks reduce before and gather after
any ``optimizer.step()``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.flat import FlatLayout
from shardwise.parallel.base import grad_sq, optimizer_like, optimizer_state_bytes, \
    probe_groups, tensor_bytes


class FlatBuffers:
    """Parameters and gradients as views of two flat buffers (comm/flat.py's layout, padded to a
    multiple of ``shards``), so the dp traffic is one collective and ZeRO-1's shards are
    contiguous ranges."""

    def __init__(self, params: list[nn.Parameter], shards: int):
        self.layout = FlatLayout.of(params, shards)
        self.params = self.layout.new_flat(params, params[0].dtype, params[0].device)
        self.grads = torch.zeros_like(self.params)
        self.members, self.grad_views = params, self.layout.views(self.grads)
        for p, pv, gv in zip(params, self.layout.views(self.params), self.grad_views):
            p.data, p.grad = pv, gv                                # backward accumulates into gv

    def shard(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return self.layout.shard(flat, index)

    @torch.no_grad()
    def reattach(self) -> None:
        """A ``.grad`` set to None (or replaced) goes back on its view (zero, or copied in)."""
        for p, view in zip(self.members, self.grad_views):
            if p.grad is not view:
                view.zero_() if p.grad is None else view.copy_(p.grad)
                p.grad = view



class PipelineZero1:
    """ZeRO-1 over dp for HybridStrategy (see the module docstring)."""

    def _build_optimizer(self, optimizer_factory) -> None:
        mesh = self.mesh
        named = [(self._full_name(n), q) for n, q in self.model.named_parameters() if q.requires_grad]
        params = [q for _, q in named]
        # fp32 training needs no master copy: the optimizer updates this rank's slice of each
        # group's flat parameters in place (a view), then the slices are all-gathered.
        probe, groups = probe_groups(optimizer_factory, params)
        self.flats = [FlatBuffers(members, mesh.dp) for _, members in groups]
        self.masters = [nn.Parameter(f.shard(f.params, mesh.dp_rank)) for f in self.flats]
        # this rank's slice of each flat gradient: where the in-place reduce-scatter lands
        self.grad_shards = [f.shard(f.grads, mesh.dp_rank) for f in self.flats]
        self.optimizer = optimizer_like(probe, [(options, [m]) for (options, _), m
                                                in zip(groups, self.masters)])
        name_of = {id(q): n for n, q in named}
        self._counted = [self._counted_ranges(f, [name_of[id(q)] for q in f.members])
                         for f in self.flats]

    def _counted_ranges(self, flat: FlatBuffers, names: list[str]) -> list[tuple[int, int]]:
        """[a, b) ranges of this rank's gradient (ZeRO-1: its shard; else the whole flat) whose
        squares it adds to the global norm, so that every entry is counted once in the world."""
        mesh, layout = self.mesh, flat.layout
        lo, hi = layout.shard_range(mesh.dp_rank)
        ranges = []
        for name, offset, shape in zip(names, layout.offsets, layout.shapes):
            if name not in self.tp_specs and mesh.tp_rank != 0:
                continue                               # tp-replicated: tp rank 0 counts
            if name in self._uncounted:
                continue                               # a tied copy: the first stage counts it
            a, b = max(offset, lo), min(offset + shape.numel(), hi)
            if a >= b:
                continue
            if ranges and ranges[-1][1] == a - lo:
                ranges[-1] = (ranges[-1][0], b - lo)   # merge neighbours: fewer norms
            else:
                ranges.append((a - lo, b - lo))
        return ranges

    def _finish_grad_sync(self) -> None:
        """Average gradients over dp (allreduce, or ZeRO-1's reduce-scatter per group), once."""
        if self._synced:
            return
        for f in self.flats:
            f.reattach()
        for f, g in zip(self.flats, self.grad_shards):
            self.reducer.reduce_scatter(g, f.grads, async_op=False, name="zero1_grad")
        self._synced = True

    def _before_optimizer_step(self) -> None:
        """Every optimizer.step(), a user's own call included: gradients reduced first."""
        self._finish_grad_sync()
        for m, g in zip(self.masters, self.grad_shards):
            m.grad = g

    def _after_optimizer_step(self) -> None:
        for f, m in zip(self.flats, self.masters):
            # the input is this rank's slice of the output: an in-place gather
            self.comm.all_gather(f.params, m.detach(), self.mesh.dp_group, name="zero1_params")
        self._synced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad here: zero the flat gradients in place (the views stay)."""
        for f in self.flats:
            f.reattach()
            f.grads.zero_()
        self._synced = False

    # -- clipping (module docstring): each entry counted once over the world ---------------
    def _owned_grads(self) -> list[torch.Tensor]:
        return self.grad_shards

    def _local_grad_sq(self) -> torch.Tensor:
        return grad_sq([g[a:b] for g, ranges in zip(self._owned_grads(), self._counted)
                        for a, b in ranges], self.device)

    def _sum_grad_sq(self, sq: torch.Tensor) -> torch.Tensor:
        t = sq.reshape(1).clone()
        self.comm.all_reduce(t, self.mesh.world, name="grad_norm")
        return t[0]

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self._owned_grads():
            g.mul_(coef.to(g.dtype))

    def _zero1_ledger(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": tensor_bytes([f.grads for f in self.flats]),   # shards: views of these
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "master_weights": 0,          # ZeRO-1's optimizer works on a view of the parameters
            "comm_buffers": 0,
        }
