"""The loss of a tensor-parallel model whose output head is split on the vocabulary
(parallel/tensor.py's ``vocab_head``): shardwise's cross-entropies run vocab-parallel, a user's
own loss sees the whole logits (see :func:`tp_loss`). Collectives: comm/autograd.py's."""
from __future__ import annotations

import torch

from shardwise.comm.autograd import gather_from_tp, shard_range, vocab_parallel_cross_entropy
from shardwise.comm.collectives import Comm, Group
from shardwise.models.build import logits_of, output_loss


def tp_loss(vocab_size: int, comm: Comm, group: Group, loss_fn=None):
    """The loss of a model whose head is split on the vocabulary over tp. shardwise's own
    cross-entropies (marked ``cross_entropy = True``: the default, the GPT's, the CLI's for any
    output) become the vocab-parallel cross-entropy on this rank's logit columns (the same value;
    no rank holds the whole logits). Any other loss (a user's: label smoothing, a mask, a
    z-loss) gets the whole logits, all-gathered over tp inside autograd (comm/autograd.py
    gather_from_tp: B*T*V more memory and traffic per rank), in the output's own form: a tensor,
    a dict / ModelOutput with its ``logits`` replaced, or a tuple with them first.

    The returned loss carries ``whole_output`` and ``on_whole`` (see :func:`_marked`): the
    Engine's ``engine(x)`` returns the gathered output and ``engine.loss_fn`` is ``on_whole``,
    so a user's loop sees what one process sees; train_step / engine.loss stay vocab-parallel."""
    whole = whole_output(vocab_size, comm, group)
    if loss_fn is not None and not getattr(loss_fn, "cross_entropy", False):
        def user_loss(out, target):
            return loss_fn(whole(out), target)
        return _marked(user_loss, whole, loss_fn)
    start = shard_range(vocab_size, group.rank, group.size)[0]

    def vocab_loss(out, target: torch.Tensor) -> torch.Tensor:
        logits = out if torch.is_tensor(out) else logits_of(out)        # (B, T, V_local)
        return vocab_parallel_cross_entropy(logits, target, start, comm, group)
    return _marked(vocab_loss, whole, loss_fn or output_loss)


def whole_output(vocab_size: int, comm: Comm, group: Group):
    """out -> out with its logits whole: all-gathered over tp inside autograd
    (comm/autograd.py gather_from_tp; backward hands each rank its own columns). What
    ``engine(x)`` returns under tp, so that it equals the model's output on one process."""
    def whole(out):
        return _with_logits(out, gather_from_tp(logits_of(out), vocab_size, comm, group))
    return whole


def _marked(loss, whole, on_whole):
    """The tp loss (on this rank's logit columns), carrying what the Engine needs for the
    whole-logits view: ``whole_output`` (gathers an output) and ``on_whole`` (the loss to
    apply to a gathered output: the one the user gave)."""
    loss.whole_output, loss.on_whole = whole, on_whole
    return loss


def _with_logits(out, logits: torch.Tensor):
    """``out`` with its logits replaced (the forms logits_of reads)."""
    if torch.is_tensor(out):
        return logits
    if isinstance(out, (tuple, list)):
        return type(out)((logits, *out[1:]))
    out["logits"] = logits
    return out
