"""``--compile``: torch.compile (TorchInductor) on each of a rank's transformer blocks, in place.

What is compiled: the ``forward`` of each block given (parallel/compose.py passes this rank's
blocks, as the model's plan names them, after activation checkpointing), with
``torch.compile(..., dynamic=False)`` (every micro-batch of a run has one shape; a new shape
or grad mode, e.g. evaluation's no-grad forward, compiles once more on its first call). The
block keeps its forward as it was (the class's, or activation checkpointing's wrapper) as
``eager_forward``, and its ``forward`` becomes one compiled function bound to the block that
calls ``block.eager_forward``: the module, its parameters and its state dict stay as they
are, so the gradient-sync component's hooks, its flat views, the optimizer and the checkpoint
code all see the same tensors; every block runs through one compiled code object, so Dynamo
compiles it once for all of them (no recompile per block); and a copy of the model
(``copy.deepcopy``: the ``dp`` strategy's replicas) runs its own blocks, as a bound method is
copied with its block. A checkpointed block is compiled around its checkpoint: Dynamo traces
``torch.utils.checkpoint`` as one higher-order op (no graph break) and the partitioner
recomputes in backward what it did not save.

Why ``forward`` and not ``nn.Module.compile``: that compiles the module's ``_call_impl``,
which runs the module's forward hooks inside the compiled region. ZeRO-3 hooks each block
(its unit) to gather, prefetch and free the parameters: collectives, storage resizes, timers.
Traced, they broke the graph at every collective and recompiled per unit (a guard on the
unit's index), which passes Dynamo's recompile limit (8) on a model of more blocks. Compiling
``forward`` leaves every module hook eager, around the compiled block. Collectives inside a
block (tensor and sequence parallelism's f / g, context parallelism's ring) still break its
graph there: the pieces between them are compiled, the collectives run eagerly.

What is not compiled: the embedding, the final norm and head, the loss, the optimizer step,
and every collective (gradient buckets, ZeRO reduce-scatters / gathers, tensor- and
pipeline-parallel sends): they run eagerly between the compiled blocks.

The cache: TorchInductor's FX graph cache and AOTAutograd's cache are on by default in torch
2.13 (``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.
enable_autograd_cache``) and live on disk in ``TORCHINDUCTOR_CACHE_DIR`` (default
``<tmp>/torchinductor_<user>``), so a second run of the same blocks (every rank, and every
later run on this machine) reads the compiled kernels instead of building them; Dynamo's own
tracing is still paid per process. Nothing here changes those settings.

Inductor on a CPU builds C++ kernels: :func:`check_compiler` says in one line when no C++
compiler is found.
"""
from __future__ import annotations

import shutil
import types

import torch
import torch.nn as nn


def check_compiler(device_type: str) -> str | None:
    """Why ``--compile`` cannot run on ``device_type`` here (None: it can). On a CPU, Inductor
    builds C++ with the compiler its config names: ``$CXX``, else g++ (clang++ on macOS)."""
    if device_type != "cpu":
        return None
    from torch._inductor import config as inductor_config
    names = [c for c in inductor_config.cpp.cxx if c]
    if any(shutil.which(name) for name in names):
        return None
    return (f"TorchInductor builds C++ kernels for the CPU and the C++ compiler it uses "
            f"({' / '.join(names)}) was not found")


def compile_blocks(blocks) -> int:
    """Compile the ``forward`` of every module of ``blocks`` in place (module docstring);
    returns how many were compiled."""
    if blocks is None:
        raise ValueError("--compile compiles the model's blocks (a model plan, or a 'blocks' "
                         "ModuleList); fix: shardwise.register_plan(...) for this model, or "
                         "drop --compile")
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_forward, dynamic=False)
    for block in blocks:
        block.eager_forward = block.forward       # bound to the block (or checkpointing's)
        block.forward = types.MethodType(_compiled, block)
    return len(blocks)


_compiled = None     # torch.compile(_forward): one for every block, made on first use


def _forward(block: nn.Module, *args, **kwargs):
    """What a compiled block runs: its forward from before :func:`compile_blocks`."""
    return block.eager_forward(*args, **kwargs)
