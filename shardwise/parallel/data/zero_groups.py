"""The user's parameter groups under ZeRO: the optimizer factory is called once on the original
trainable parameters (a probe, which allocates no state: torch.optim creates state lazily), and
each parameter's group, each group's options and the constructor's defaults are read from it.
zero.py lays each chunk out group by group and builds the real optimizer from this.
Partition, collectives, traffic: none (one local probe at set-up); memory: the group lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from shardwise.parallel.base import constructor_defaults


@dataclass
class ParamGroups:
    """The user's optimizer class, defaults and per-group options, and each parameter's group."""
    cls: type
    defaults: dict
    options: list[dict]
    index: dict                             # parameter -> group number

    @staticmethod
    def probe(optimizer_factory, named: list[tuple[str, nn.Parameter]]) -> "ParamGroups":
        probe = optimizer_factory([p for _, p in named])   # torch.optim allocates state lazily
        options, index = [], {}
        for g, group in enumerate(probe.param_groups):
            options.append({k: v for k, v in group.items() if k != "params"})
            index.update({p: g for p in group["params"]})
        missing = [n for n, p in named if p not in index]
        if missing:
            raise ValueError(f"ZeRO: the optimizer factory left out trainable parameters "
                             f"{missing[:5]}; fix: freeze them (requires_grad_(False)) or put "
                             "them in a parameter group")
        return ParamGroups(type(probe), constructor_defaults(probe), options, index)
