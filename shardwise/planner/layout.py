"""What a plan chooses (``Layout``: how devices split the work) and what it is given (``Batch``).

The device mesh follows shardwise's order: pp outermost, then dp, cp, tp innermost, so a tp group
is ``tp`` consecutive ranks (inside a node), a cp group has stride ``tp``, a dp group stride
``tp * cp``, a pp group stride ``tp * cp * dp``; gradients are averaged (and ZeRO states
sharded) over dp x cp, ``dp * cp`` ranks ``tp`` apart (shardwise's ``mesh.grad_group``). A parameter-server layout has ``num_ps`` server ranks and ``dp`` worker ranks.
HSDP splits the dp axis as ``dp_replicate`` x ``dp_shard``, replicate outermost (shardwise's
mesh): a shard group is ``dp_shard`` consecutive dp ranks (inside a node when it fits one), a
replica group has stride ``dp_shard * tp`` (it spans the nodes).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shardwise.config.names import AXES, STRATEGIES, ZERO_STRATEGIES, Axis, Strategy
from shardwise.planner.errors import PlanError

KINDS = tuple(s for s in STRATEGIES if s not in (Strategy.DP, Strategy.AUTO))
"""Layout kinds, named as ``shardwise train --strategy`` names them."""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
"""Pipeline schedules, named as ``shardwise train --schedule`` names them."""
CP_IMPLS = ("ring", "ulysses")
"""Context parallelism's attention, named as ``shardwise train --cp-impl`` names them."""
OFFLOADS = ("none", "cpu", "disk")
"""Where offloaded state lives: on the device (none), in host memory (cpu), on NVMe (disk)."""
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none; selective (Korthikanti et al. 2022: only the attention
core, softmax and dropout, is recomputed); full (each block's input kept, the block rerun)."""


def bubble_slots(schedule: str, pp: int, v: int = 1) -> float:
    """Idle time per step in micro-batch slots (a slot: one micro-batch's F + B on a stage), as
    shardwise/parallel/pipeline/schedule.bubble_formula has it for uniform stages: GPipe and
    1F1B pp - 1; interleaved 1F1B (pp - 1)/v (Narayanan et al. 2021); ZB-H1 (pp - 1)/3, Qi et
    al.'s (pp-1)(T_F + T_B - T_W) with the slot's thirds F = B = W. The step's idle fraction
    is bubble_slots / (m + bubble_slots)."""
    if pp <= 1:
        return 0.0
    if schedule == "interleaved-1f1b":
        return (pp - 1) / v
    if schedule == "zb-h1":
        return (pp - 1) / 3
    return float(pp - 1)


@dataclass(frozen=True)
class Layout:
    """One way to run a training step on ``world`` devices."""

    dp: int = 1
    """Data-parallel size (model replicas; the number of workers for ``ps``)."""
    tp: int = 1
    """Tensor-parallel size (Megatron column/row split; inside one node)."""
    pp: int = 1
    """Pipeline-parallel size (stages of consecutive layers)."""
    zero: int = 0
    """ZeRO stage over the dp axis: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters."""
    offload: str = "none"
    """Where fp32 master weights, optimizer states (and, from ZeRO-2, the fp32 gradient
    partition) live: none, cpu (ZeRO-Offload) or disk (ZeRO-Infinity); zero >= 1, as
    ``shardwise train --offload`` allows. The 16-bit parameters stay unless ``offload_params``."""
    offload_params: str = "none"
    """ZeRO-3 only: where the 16-bit parameter partition lives (none, cpu, disk; ZeRO-Infinity's
    ``offload_param``), fetched to the device for each unit. Any pairing with ``offload`` is
    allowed; ``shardwise train --offload-params`` runs it where it equals ``offload`` (the
    planner's CLI ranks every pairing)."""
    act_ckpt: bool = False
    """Full activation recomputation: keep each block's input, rerun the block in backward."""
    selective_recompute: bool = False
    """Selective recomputation (Korthikanti et al. 2022): drop and recompute only the attention
    core (the ``5 a s^2 b / t`` activations); exclusive with ``act_ckpt``. Not in
    ``shardwise train`` (the planner's CLI ranks it)."""
    micro_batch: int = 1
    """Sequences per micro-batch per replica."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, interleaved-1f1b
    (``virtual_stages`` chunks per rank) or zb-h1 (backward split into input and weight
    gradients); see :func:`bubble_slots`."""
    virtual_stages: int = 1
    """interleaved-1f1b: model chunks per pipeline rank (1 for every other schedule)."""
    num_ps: int = 0
    """Parameter-server ranks (0: no parameter server)."""
    sequence_parallel: bool = False
    """Megatron-3 sequence parallelism (tp > 1): the norm, dropout and residual activations
    outside the tp regions are split by tp too; the same traffic as tp (an all-gather and a
    reduce-scatter in place of each allreduce). ``shardwise train --sp``."""
    dp_replicate: int = 1
    """HSDP (ZeRO 1-3): replica groups the dp axis splits into, ``dp = dp_replicate x
    dp_shard``; ZeRO shards over the ``dp_shard`` ranks of a group and each reduced gradient
    shard is averaged across the groups. 1: shard over all of dp (``shardwise train
    --dp-replicate R --dp-shard S``)."""
    cp: int = 1
    """Context-parallel size (``shardwise train --cp``): every sequence cut over ``cp`` ranks,
    each holding the activations of ``seq_len / cp`` positions and computing their share of
    attention (a pipeline's boundary activations too); the cp ranks of a replica train on the
    same rows, so gradients are averaged and ZeRO states sharded over dp x cp. Not with HSDP,
    sp or parameter servers (as ``shardwise train`` refuses them)."""
    cp_impl: str = "ring"
    """ring (keys and values passed round the cp ranks, p2p) or ulysses (an all-to-all to
    head-split before attention, one back); see comm.cp_time."""
    bucket_bytes: int = 25 * 2**20
    """Gradient bucket size for DDP / ZeRO reductions (torch DDP's default, 25 MiB)."""

    def __post_init__(self) -> None:
        for name in (*AXES, "micro_batch"):
            if getattr(self, name) < 1:
                raise PlanError(name, getattr(self, name), "is below 1", f"set {name} >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError("zero", self.zero, "is not a ZeRO stage", "use 0, 1, 2 or 3")
        for name in ("offload", "offload_params"):
            if getattr(self, name) not in OFFLOADS:
                raise PlanError(name, getattr(self, name), "is unknown", "use none, cpu or disk")
        if self.act_ckpt and self.selective_recompute:
            raise PlanError("selective_recompute", True, "is exclusive with full recompute",
                            "choose one of recompute none, selective or full")
        if self.schedule not in SCHEDULES:
            raise PlanError("schedule", self.schedule, "is unknown", "use " + ", ".join(SCHEDULES))
        if self.virtual_stages < 1 or (self.virtual_stages > 1) != (self.schedule == "interleaved-1f1b"):
            raise PlanError("virtual_stages", self.virtual_stages, f"does not fit {self.schedule}",
                            "use virtual_stages >= 2 with interleaved-1f1b, else 1")
        if self.offload != "none" and self.zero < 1:
            raise PlanError("offload", self.offload, "needs a ZeRO stage (there is no shard to "
                            "move)", "offload with zero 1, 2 or 3")
        if self.offload_params != "none" and self.zero < 3:
            raise PlanError("offload_params", self.offload_params,
                            f"needs ZeRO-3 (parameters are whole under zero {self.zero})",
                            "offload parameters with zero 3 only")
        if self.zero >= 2 and (self.tp > 1 or self.pp > 1):
            raise PlanError("zero", self.zero, "is not in the planner's search with tp or pp "
                            "yet (its memory model lacks a stage's whole gradients held over "
                            "the micro-batches; shardwise train runs these layouts)",
                            "use zero 1 in a 3d layout, or zero 2/3 with tp = pp = 1")
        self._check_axes()
        if self.num_ps and (self.tp > 1 or self.pp > 1 or self.zero):
            raise PlanError("num_ps", self.num_ps, "combines only with plain workers",
                            "use tp = pp = 1, zero 0 and no offload with a parameter server")

    def _check_axes(self) -> None:
        """HSDP's split of dp and sequence parallelism's tp, as shardwise train refuses them."""
        r = self.dp_replicate
        if r < 1 or self.dp % r:
            raise PlanError("dp_replicate", r, f"does not divide dp = {self.dp}",
                            "give replica groups whose count divides the dp size")
        if r > 1 and not self.zero:
            raise PlanError("dp_replicate", r, "needs a ZeRO stage (DDP replicates everything "
                            "already)", "use HSDP with zero 1, 2 or 3")
        if r > 1 and (self.tp > 1 or self.pp > 1 or self.num_ps):
            raise PlanError("dp_replicate", r, "is not in the planner's search with tp, pp or "
                            "parameter servers yet", "use HSDP with tp = pp = 1")
        if self.sequence_parallel and self.tp < 2:
            raise PlanError("sequence_parallel", True, "needs tensor parallelism (it splits "
                            "activations by tp)", "use sequence parallelism with tp >= 2")
        if self.cp < 1 or self.cp_impl not in CP_IMPLS:
            raise PlanError(Axis.CP, f"{self.cp} {self.cp_impl}", "is not a context-parallel "
                            "size and implementation", "use cp >= 1 with ring or ulysses")
        if self.cp > 1 and (self.hsdp or self.sequence_parallel or self.num_ps):
            raise PlanError(Axis.CP, self.cp, "does not run with HSDP, sequence parallelism or "
                            "parameter servers (shardwise train refuses them)",
                            "use cp with dp, ZeRO, tp and pp only")

    @property
    def dp_shard(self) -> int:
        """Ranks one ZeRO shard group spans: dp x cp / dp_replicate (all of dp x cp without
        HSDP; cp > 1 excludes HSDP)."""
        return self.dp * self.cp // self.dp_replicate

    @property
    def hsdp(self) -> bool:
        """Whether the dp axis is split into replica groups of shard groups."""
        return self.dp_replicate > 1

    @property
    def family_name(self) -> str:
        """The kind, with ``+hsdp`` where the dp axis is hybrid (a report's 'best of' rows)."""
        return self.kind + ("+hsdp" if self.hsdp else "")

    @property
    def recompute(self) -> str:
        """The recomputation choice: none, selective or full (see ``RECOMPUTE``)."""
        return "full" if self.act_ckpt else "selective" if self.selective_recompute else "none"

    @property
    def offloaded(self) -> bool:
        """Whether anything lives off the device."""
        return self.offload != "none" or self.offload_params != "none"

    @property
    def world(self) -> int:
        """Devices used: dp * cp * tp * pp, plus the parameter servers."""
        return self.dp * self.cp * self.tp * self.pp + self.num_ps

    @property
    def kind(self) -> str:
        """The strategy name: single, ddp, zero1-3, tp, pp, 3d or ps."""
        if self.num_ps:
            return Strategy.PS
        split = [n for n in AXES if getattr(self, n) > 1]
        if split in ([Axis.TP], [Axis.PP]) and not self.zero and self.cp == 1:
            return Strategy(split[0])      # the axis alone: the tp or pp strategy
        if self.tp > 1 or self.pp > 1:
            return Strategy.THREE_D
        if self.zero:
            return ZERO_STRATEGIES[self.zero - 1]
        return Strategy.DDP if self.dp * self.cp > 1 else Strategy.SINGLE

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each replica runs per step (rounded up: the last may be short)."""
        return math.ceil(global_batch / (self.dp * self.micro_batch))

    def describe(self) -> str:
        """One line, e.g. ``3d dp=8 tp=8 pp=16 zero1 1f1b mb=1 recompute=full``; HSDP as
        ``zero3 dp=16 hsdp=2x8`` (replicas x shard group)."""
        parts = [self.kind]
        if self.num_ps:
            parts += [f"workers={self.dp}", f"servers={self.num_ps}"]
        else:
            parts += [f"{n}={getattr(self, n)}" for n in (Axis.DP, Axis.TP, Axis.PP)
                      if getattr(self, n) > 1]
        if self.hsdp:
            parts.append(f"hsdp={self.dp_replicate}x{self.dp_shard}")
        if self.zero and self.kind not in ZERO_STRATEGIES:
            parts.append(f"zero{self.zero}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.offload_params != "none":
            parts.append(f"offload_params={self.offload_params}")
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.cp > 1:
            parts.append(f"cp={self.cp} {self.cp_impl}")
        parts.append(f"mb={self.micro_batch}")
        parts.append(f"recompute={self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """All fields plus ``kind`` and ``world``, for ``--format json``."""
        return {"kind": self.kind, "world": self.world, "recompute": self.recompute,
                "dp_shard": self.dp_shard, **asdict(self)}


PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "sgd")
INITS = ("meta", "eager")
"""How ranks get their weights at start-up (``shardwise train --init``): meta, each rank builds
only what it keeps, one block at a time; eager, every rank first builds the whole fp32 model."""
CONVENTIONS = ("zero-paper", "deepspeed")
"""How model states are counted (memory.py): the ZeRO paper's ``2 + 2 + K`` (ZeRO-2 mixed Adam
``2 + 14/N``) or DeepSpeed's ``estimate_zero*_model_states_mem_needs`` (ZeRO-2 ``4 + 16/N``)."""


@dataclass(frozen=True)
class Batch:
    """The training step being planned: how many sequences, in what precision, which optimizer."""

    global_batch: int
    """Sequences per optimizer step, all replicas together."""
    precision: str = "bf16"
    """bf16 / fp16: mixed precision (16-bit weights and gradients, fp32 master copy);
    fp32: everything in fp32, no master copy."""
    optimizer: str = "adam"
    """adam (two fp32 moments) or sgd (one fp32 momentum)."""
    convention: str = "zero-paper"
    """How model states are counted: zero-paper or deepspeed (see ``CONVENTIONS``)."""
    init: str = "meta"
    """How the ranks build the model at start-up: meta or eager (see ``INITS``; memory.py's
    start-up peak)."""

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise PlanError("global_batch", self.global_batch, "is below 1",
                            "give at least one sequence per step")
        if self.precision not in PRECISIONS:
            raise PlanError("precision", self.precision, "is unknown", "use bf16, fp16 or fp32")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError("optimizer", self.optimizer, "is unknown", "use adam or sgd")
        if self.init not in INITS:
            raise PlanError("init", self.init, "is unknown", "use " + " or ".join(INITS))
        if self.convention not in CONVENTIONS:
            raise PlanError("convention", self.convention, "is unknown",
                            "use " + " or ".join(CONVENTIONS))

    @property
    def mixed(self) -> bool:
        """Whether training keeps 16-bit weights and an fp32 master copy."""
        return self.precision != "fp32"
