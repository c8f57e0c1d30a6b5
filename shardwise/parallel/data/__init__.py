"""Data parallelism as one component, the stage a value (``parallel.zero_stage``):

    stage 0   replicate everything; bucketed allreduce overlapped with backward   ddp.py (DDP)
    stage 1   + shard optimizer states (and fp32 masters)                         zero.py
    stage 2   + shard gradients (staging buffers freed at each reduce-scatter)    zero.py
    stage 3   + shard parameters (units gathered just in time)                    zero_stage3.py

Classes: stage 0 is ``DDPStrategy``; stages 1 and 2 are one class, ``zero.ZeroStrategy``, whose
stage is a value read from the config (presets.zero_stage); stage 3 is
``zero_stage3.Zero3Strategy``, a ZeroStrategy whose chunks are units gathered just in time.
ZeroStrategy reads top to bottom: chunks and optimizer, backward (gradient hooks, staging,
reduce-scatter), the step's three phases (finish reductions, clip, step each chunk and launch
its gather, wait), then state and memory. It owns its pieces rather than inheriting them:
zero_memory.ZeroMemory (transient buffers and their peaks, ``strategy.memory``), zero_state.py
(state dicts, functions of the strategy), zero_groups.ParamGroups (the user's parameter groups).
All stages share one flat layout (shardwise/comm/flat.FlatLayout) and one native-or-ring
reducer (shardwise/comm/reducer.Reducer); stages 0-2 one bucket planner
(shardwise/comm/buckets.plan_buckets; stage 3 groups parameters by units instead). The component
runs over the mesh's ``dp`` axis on whatever model the earlier steps of
shardwise/parallel/compose.py produced (the whole model, or its tensor-parallel slice).
"""
from __future__ import annotations

import importlib

ZERO_STAGES = {
    0: "shardwise.parallel.data.ddp:DDPStrategy",
    1: "shardwise.parallel.data.zero:ZeroStrategy",      # the stage: cfg (presets.zero_stage)
    2: "shardwise.parallel.data.zero:ZeroStrategy",
    3: "shardwise.parallel.data.zero_stage3:Zero3Strategy",
}


def stage_class(stage: int):
    """The data-parallel Strategy class of ZeRO ``stage`` (0 = DDP)."""
    module, cls = ZERO_STAGES[stage].split(":")
    return getattr(importlib.import_module(module), cls)
