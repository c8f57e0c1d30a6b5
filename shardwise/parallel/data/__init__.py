"""Data parallelism as one component, the stage a value (``parallel.zero_stage``):

    stage 0   replicate everything; bucketed allreduce overlapped with backward   ddp.py (DDP)
    stage 1   + shard optimizer states (and fp32 masters)                         zero.py
    stage 2   + shard gradients (staging buffers freed at each reduce-scatter)    zero.py
    stage 3   + shard parameters (units gathered just in time)                    zero_stage3.py

All stages share one flat layout (shardwise/comm/flat.FlatLayout) and one native-or-ring
reducer (shardwise/comm/reducer.Reducer); stages 0-2 one bucket planner
(shardwise/comm/buckets.plan_buckets; stage 3 groups parameters by units instead);
stages 1-3 share zero_base.py (chunks, the chunked optimizer step, parameter groups, frozen
parameters, buffers), zero_grads.py (gradient staging, reduction, clipping) and zero_state.py
(state dicts). The component runs over the mesh's ``dp`` axis on whatever model the earlier
steps of shardwise/parallel/compose.py produced (the whole model, or its tensor-parallel slice).
"""
from __future__ import annotations

import importlib

ZERO_STAGES = {
    0: "shardwise.parallel.data.ddp:DDPStrategy",
    1: "shardwise.parallel.data.zero:Zero1Strategy",
    2: "shardwise.parallel.data.zero:Zero2Strategy",
    3: "shardwise.parallel.data.zero_stage3:Zero3Strategy",
}


def stage_class(stage: int):
    """The data-parallel Strategy class of ZeRO ``stage`` (0 = DDP)."""
    module, cls = ZERO_STAGES[stage].split(":")
    return getattr(importlib.import_module(module), cls)
