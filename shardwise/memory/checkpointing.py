"""Activation checkpointing: keep only each block's input in forward, recompute inside backward.

Memory: activations drop from O(layers x per-layer activations) to O(layers x block input) plus
one block's activations at a time; compute: one extra forward per block (about +33% FLOPs).
Uses torch.utils.checkpoint (non-reentrant). Knows no strategy: it wraps the ``forward`` of every
block it is given (the model's plan names them: parallel/compose.py passes them; by default
``model.blocks``, shardwise's GPT), so it composes with tensor and pipeline splits.
"""
from __future__ import annotations

import contextlib
import types

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module, blocks=None) -> int:
    """Checkpoint every module of ``blocks`` (default ``model.blocks``); returns how many blocks
    were wrapped."""
    blocks = getattr(model, "blocks", None) if blocks is None else blocks
    if blocks is None:
        raise ValueError("activation checkpointing needs the model's blocks (a model plan, or a "
                         "'blocks' ModuleList); fix: shardwise.register_plan(...) for this model,"
                         " or drop --activation-checkpointing")
    for block in blocks:
        block.unchecked_forward = block.forward     # bound to the block
        block.checkpointed = True
        # a method bound to the block, not a closure over it: a copy of the model
        # (copy.deepcopy: the dp strategy's replicas) then runs its own blocks
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    """A checkpointed block's forward: its own forward under torch.utils.checkpoint (or as it
    is inside :func:`checkpointing_off`)."""
    if block.checkpointed:
        return checkpoint(block.unchecked_forward, *args, use_reentrant=False, **kwargs)
    return block.unchecked_forward(*args, **kwargs)


@contextlib.contextmanager
def checkpointing_off(model: nn.Module):
    """Run the blocks without recomputation inside (the memory report's counterfactual)."""
    blocks = [b for b in model.modules() if getattr(b, "checkpointed", False)]
    for b in blocks:
        b.checkpointed = False
    try:
        yield
    finally:
        for b in blocks:
            b.checkpointed = True
