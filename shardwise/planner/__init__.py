"""The strategy planner: a cost model of distributed training and a search over layouts.

Pure Python (standard library; ``rich`` only to print a table), imports no torch and nothing
else from shardwise, so it runs anywhere instantly::

    from shardwise.planner import Batch, Hardware, Layout, PRESETS, estimate, plan
    hw = Hardware.from_catalogue("a100-80gb", nodes=128, devices_per_node=8,
                                 network="8x200gbps")
    best = plan(PRESETS["175B"], hw, Batch(global_batch=1536)).winner
    print(best.layout.describe(), best.time_to_train(300e9) / 86400, "days")

Formulas and sources: docs/planner.md. Modules: ``hardware`` / ``catalogue`` (the machine),
``model`` (the network's shape), ``layout`` (a layout, HSDP's and sequence parallelism's
axes included, and a batch), ``memory``, ``comm``, ``offload`` (the disk's bytes per step),
``kernels`` and ``compute`` (a micro-batch's GEMMs and the kernels between them) and ``cost``
(the cost model), ``search`` and ``explain`` (ranking, the strategy guide, why HSDP or
sequence parallelism, when only disk offload fits), ``report`` and ``cli`` (``shardwise plan``);
``published`` (the papers' runs, with table and row) and ``replay`` (them through the model).
"""
from shardwise.planner.cost import Estimate, estimate
from shardwise.planner.errors import PlanError
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.model import PRESETS, ModelSpec, parse_model
from shardwise.planner.search import Ranking, plan

__all__ = ["Batch", "Estimate", "Hardware", "Layout", "ModelSpec", "PRESETS", "Ranking",
           "PlanError", "estimate", "parse_model", "plan"]
