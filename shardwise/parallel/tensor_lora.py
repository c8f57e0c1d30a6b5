"""LoRA adapters under tensor parallelism: each adapter split the way its base layer is.

A LoRA layer (memory/lora.py) computes y = W x + s B (A x). Under tensor parallelism (tp ranks
r = 0..T-1) the base W is split as parallel/tensor.py splits any Linear, and the adapter follows:

  column-parallel base (qkv, mlp.fc, head; W split by output rows):
      A (rank x in) replicated, B split by output rows with W's own ShardSpec (qkv's three
      interleaved parts included). h = A x is computed on every rank from the replicated input;
      f (comm/autograd.copy_to_tp: identity forward, all-reduce backward) sits between A and B,
      so A's gradient sums every rank's slice of B^T dy: complete and identical on every rank,
      like any replicated parameter. Output: this rank's rows, as the base's.
  row-parallel base (attn.proj, mlp.proj; W split by input columns):
      A split by input columns (ShardSpec(1, in)), B (out x rank) replicated. h_r = A_r x_r is a
      partial sum; g (reduce_from_tp: all-reduce forward) completes it, then B h is replicated and
      added to the base's summed output. B's gradient dy h^T is identical on every rank.

Collectives: one extra all-reduce of (b, s, rank) per adapted layer per pass (forward for row,
backward for column): rank / hidden of the base layer's own traffic, metered under the base's
name. Memory: A or B whole on every rank (r x in or out x r), the other 1/T.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.comm.autograd import copy_to_tp, reduce_from_tp
from shardwise.comm.collectives import Comm, Group


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


class ColumnParallelLoRA(nn.Module):
    """A column-parallel base plus its adapter: A replicated, B split by output rows."""

    def __init__(self, lora, comm: Comm, group: Group, column_cls, shard, parts: int = 1,
                 name: str = "tp_bwd"):
        super().__init__()
        self.comm, self.group, self.name, self.scale = comm, group, name, lora.scale
        self.base = column_cls(lora.base, comm, group, parts=parts, name=name)
        self.spec = self.base.spec
        self.lora_A = _param(lora.lora_A.detach().clone(), lora.lora_A)           # (r, in)
        self.lora_B = _param(shard(lora.lora_B, self.spec, group.rank, group.size),
                             lora.lora_B)                                          # (out_r, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = copy_to_tp(F.linear(x, self.lora_A), self.comm, self.group, self.name)  # (B, T, r)
        return self.base(x) + F.linear(h, self.lora_B) * self.scale                # (B, T, out_r)


class RowParallelLoRA(nn.Module):
    """A row-parallel base plus its adapter: A split by input columns, B replicated."""

    def __init__(self, lora, comm: Comm, group: Group, row_cls, shard, spec_cls,
                 name: str = "tp_fwd"):
        super().__init__()
        self.comm, self.group, self.name, self.scale = comm, group, name, lora.scale
        self.base = row_cls(lora.base, comm, group, name=name)
        self.a_spec = spec_cls(1, lora.lora_A.shape[1])
        self.lora_A = _param(shard(lora.lora_A, self.a_spec, group.rank, group.size),
                             lora.lora_A)                                          # (r, in_r)
        self.lora_B = _param(lora.lora_B.detach().clone(), lora.lora_B)           # (out, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = reduce_from_tp(F.linear(x, self.lora_A), self.comm, self.group, self.name)  # (B,T,r)
        return self.base(x) + F.linear(h, self.lora_B) * self.scale                    # (B,T,out)
