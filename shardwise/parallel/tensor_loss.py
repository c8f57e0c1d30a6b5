"""The loss of a tensor-parallel model whose output head is split on the vocabulary
(parallel/tensor.py's ``vocab_head``): shardwise's cross-entropies run vocab-parallel, a user's
own loss sees the whole logits (see :func:`tp_loss`). Collectives: comm/autograd.py's."""
from __future__ import annotations

import torch

from shardwise.comm.autograd import gather_from_tp, shard_range, vocab_parallel_cross_entropy
from shardwise.comm.collectives import Comm, Group
from shardwise.models.build import logits_of


def tp_loss(vocab_size: int, comm: Comm, group: Group, loss_fn=None):
    """The loss of a model whose head is split on the vocabulary over tp. shardwise's own
    cross-entropies (marked ``cross_entropy = True``: the default, the GPT's, the CLI's for any
    output) become the vocab-parallel cross-entropy on this rank's logit columns (the same value;
    no rank holds the whole logits). Any other loss (a user's: label smoothing, a mask, a
    z-loss) gets the whole logits, all-gathered over tp inside autograd (comm/autograd.py
    gather_from_tp: B*T*V more memory and traffic per rank), in the output's own form: a tensor,
    a dict / ModelOutput with its ``logits`` replaced, or a tuple with them first."""
    if loss_fn is not None and not getattr(loss_fn, "cross_entropy", False):
        def user_loss(out, target):
            whole = gather_from_tp(logits_of(out), vocab_size, comm, group)
            return loss_fn(_with_logits(out, whole), target)
        return user_loss
    start = shard_range(vocab_size, group.rank, group.size)[0]

    def vocab_loss(out, target: torch.Tensor) -> torch.Tensor:
        logits = out if torch.is_tensor(out) else logits_of(out)        # (B, T, V_local)
        return vocab_parallel_cross_entropy(logits, target, start, comm, group)
    return vocab_loss


def _with_logits(out, logits: torch.Tensor):
    """``out`` with its logits replaced (the forms logits_of reads)."""
    if torch.is_tensor(out):
        return logits
    if isinstance(out, (tuple, list)):
        return type(out)((logits, *out[1:]))
    out["logits"] = logits
    return out
