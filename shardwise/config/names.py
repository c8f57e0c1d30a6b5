"""The names of the layouts and of the mesh axes, spelled once.

Every other file outside the components (``parallel/``) refers to a layout or an axis through
these enums: ``Strategy.ZERO3``, ``Axis.TP``. A misspelling is then an ``AttributeError`` at
import instead of a branch that never matches, and renaming a layout is one edit here (plus its
component and its CLI choice, which come from :data:`STRATEGIES`).

Both are :class:`enum.StrEnum`: a member *is* its string (``Strategy.ZERO3 == "zero3"``, a dict
key, a JSON value, an f-string piece, a command-line argument), so configs, result files and
flags keep plain strings.

Two words, two meanings kept apart:

* a **strategy** (``--strategy``) is a layout preset: how one run splits its work. ``dp`` the
  strategy is one process driving several replicas (``torch.nn.DataParallel``'s shape);
* an **axis** is a dimension of the device mesh. ``dp`` the axis is the data-parallel dimension
  that DDP and ZeRO reduce gradients over.
"""
from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """The layouts ``--strategy`` accepts (see docs/architecture.md for what each composes)."""

    SINGLE = "single"       # one process, plain training: the reference every layout equals
    DDP = "ddp"             # data parallel over processes (stage 0), torch DDP's shape
    DP = "dp"               # one process's replicas on several devices
    ZERO1 = "zero1"         # optimizer states sharded over dp
    ZERO2 = "zero2"         # + gradients
    ZERO3 = "zero3"         # + parameters (FSDP's shape)
    TP = "tp"               # tensor parallel
    PP = "pp"               # pipeline parallel
    THREE_D = "3d"          # dp x tp x pp over one mesh
    PS = "ps"               # parameter server
    AUTO = "auto"           # the planner picks one of the above


class Axis(StrEnum):
    """The device mesh's axes, outermost first in :data:`AXES`."""

    PP = "pp"               # pipeline stages
    DP = "dp"               # data parallel (gradients reduced over it)
    DP_REPLICATE = "dp_replicate"   # HSDP: the replica groups
    DP_SHARD = "dp_shard"   # HSDP: the ranks that shard inside one replica group
    CP = "cp"               # context parallel (the sequence cut over it)
    DP_CP = "dp_cp"         # dp x cp flattened: the gradient group under --cp
    TP = "tp"               # tensor parallel (innermost: the fastest links)


STRATEGIES = tuple(s.value for s in Strategy)   # plain strings: CLI choices and messages
ZERO_STRATEGIES = (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
AXES = (Axis.PP, Axis.DP, Axis.TP)   # the default mesh order, outermost first
