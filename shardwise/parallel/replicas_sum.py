"""The sum across replica groups of one step's gradients, buffers and loss (``--ft-replicas``).

Partition: what the group's own reduction left on this rank (DDP's whole gradient buckets,
ZeRO's gradient shards, of its tp slice and its stage; DDP's used flags last), the model's
floating-point buffers (BatchNorm's running statistics) and this rank's loss, packed in one
flat fp32 buffer: [gradients | buffers | scalars].

Two ways (parallel/replicas.py chooses by the quorum's decision, ``Decision.even``):

- members of one size (:meth:`LaneSum.launch_even`): lane r sums rank r's flat over the
  members (the same pieces in every group), and :meth:`LaneSum.finish` divides the gradients
  and the loss by the live count L: the mean of the groups' means, each over an equal share.
- members of different sizes (``--ft-rejoin-nproc``: the same tp, pp and cp, another dp;
  :meth:`LaneSum.launch_weighted`): every rank holds its group's whole mean gradient of its
  piece of the model (ZeRO: each chunk's unpadded flat, which parallel/replicas.py has the
  strategy gather from its shards first and scatter back after), so only each piece's
  leaders (rank 0 over dp x cp) sum, each its group's mean x the group's dp size and its
  group's loss sum (one allreduce of 4 bytes over dp x cp first, divided by cp); each leader
  broadcasts the sums and whether its lane succeeded over its dp x cp peers, and
  :meth:`LaneSum.finish` divides by the live groups' total dp size D: the mean over every
  row of the step, the weighted sum of the groups' means.

Buffers are not averaged: only the first live group puts its own in (the others zeros), so
every group continues with the first live group's, as DDP gives every forward dp rank 0's.
Used flags are summed with the gradients: above 0 where any live group used the parameter.

Collectives: the lane's allreduce (comm/replicas.py); in the weighted way also an allreduce
of the loss and a broadcast of the flat over the group's own world. Memory: the flat, 4P
under DDP (4P/g under ZeRO) plus the buffers, allocated once and reused. Traffic: even,
2(L-1)/L x 4P per rank over its lane; weighted, that for each leader only, plus a broadcast
of 4P over its dp x cp peers.
"""
from __future__ import annotations

import torch


class LaneSum:
    """This rank's flat buffer and the sums over the replica groups (module docstring)."""

    def __init__(self, strategy, group: int):
        self.strategy, self.group = strategy, group
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.grads = 0
        # the model's floating-point buffers, found at the first sum: DDP gives every
        # forward dp rank 0's (torch DDP's broadcast_buffers), so every group takes the first
        # live group's after each step
        self.stats: list[torch.Tensor] | None = None

    def _fill(self, buffers: list[torch.Tensor], first: bool, extra: int,
              scale: float | None) -> None:
        """[gradient buffers (x ``scale``) | the floating-point buffers (``first``: this
        group's, else zeros) | ``extra`` scalars] into the flat."""
        if self.stats is None:
            model = getattr(self.strategy, "model", None)
            self.stats = [] if model is None else [b for b in model.buffers()
                                                   if b.is_floating_point()]
        self.grads = sum(b.numel() for b in buffers)
        total = self.grads + sum(b.numel() for b in self.stats) + extra
        if self.flat is None or self.flat.numel() != total:
            device = buffers[0].device if buffers else self.strategy.device
            self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.views, at = [], 0
        for i, b in enumerate((*buffers, *self.stats)):
            view = self.flat[at:at + b.numel()]
            if i < len(buffers) or first:
                view.copy_(b.reshape(-1))
                if scale is not None and i < len(buffers):
                    view.mul_(scale)
            else:
                view.zero_()
            self.views.append(view)
            at += b.numel()

    def launch_even(self, link, buffers: list[torch.Tensor], loss: torch.Tensor,
                    first: bool) -> bool:
        """Sum [buffers | stats | loss] over this rank's lane; False when a peer was lost."""
        self._fill(buffers, first, extra=1, scale=None)
        self.flat[-1] = loss
        return link.all_reduce_sum(self.flat)

    def launch_weighted(self, link, buffers: list[torch.Tensor], loss: torch.Tensor,
                        first: bool, dp_size: int, group, leader_only: bool = False) -> bool:
        """The leaders' weighted sum, then its broadcast over ``group`` (this rank's dp x cp
        peers, which hold the same piece of the model: module docstring); ``link`` is None
        except on the leader. ``leader_only`` (ZeRO): the gradients are the leader's alone
        (``buffers`` empty elsewhere) and stay there (the strategy scatters them), so only
        the buffers and scalars are broadcast. False (on every rank of the group) when the
        leader's lane lost a peer."""
        comm, cp = self.strategy.comm, self.strategy.mesh.cp
        # the group's sum of its dp ranks' means (under --cp each dp rank's mean is the mean
        # of its cp ranks' means over equal parts of the rows' sequences)
        total = loss.detach().float().reshape(1).clone()
        comm.all_reduce(total, group, name="ft_loss")
        if cp > 1:
            total.div_(cp)
        self._fill(buffers, first, extra=2, scale=float(dp_size))
        self.flat[-2] = total[0]
        self.flat[-1] = 0.0
        if link is not None:
            ok = link.all_reduce_sum(self.flat)
            self.flat[-1] = 1.0 if ok else 0.0
        # the leader's sums (``leader_only``: the buffers' and scalars') and its verdict
        tail = self.flat[self.grads:] if leader_only else self.flat
        comm.broadcast(tail, 0, group, name="ft_broadcast")
        return bool(self.flat[-1] > 0)

    def finish(self, buffers: list[torch.Tensor], divisor: int, weighted: bool) -> torch.Tensor:
        """After a committed vote: the gradients divided by ``divisor`` (the live count, or
        the total dp size), the flat copied back into ``buffers`` and the model's buffers;
        returns the global loss."""
        self.flat[:self.grads].div_(divisor)
        for b, v in zip((*buffers, *self.stats), self.views):
            b.copy_(v.view_as(b))
        return self.flat[-2 if weighted else -1] / divisor
