"""The device mesh: the world laid out as a grid of named axes, with one process group per axis.

The axes are a name -> size mapping, outermost first; the default is (pp, dp, tp), and a later
axis (context parallel, HSDP's dp_replicate / dp_shard) is one more entry, not a new constructor
argument everywhere. Rank layout: row-major, the last axis innermost (tp innermost, pp
outermost, as in Megatron and torchtitan)::

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the tp ranks that talk most (two allreduces per layer) are neighbours, on the same node when
a node holds at least tp devices; pipeline neighbours are dp*tp ranks apart. Every process builds
every group in the same order (torch.distributed requires it) and keeps the ones it belongs to.
An axis of size 1 gets the solo group (no process group is created, collectives short-circuit).

No global state: a Mesh is built once by the launcher and passed to whoever needs it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from math import prod

import torch.distributed as dist

from shardwise.comm.collectives import Group
from shardwise.config.names import AXES, Axis



def _check(sizes: Mapping[str, int]) -> None:
    if not sizes or any(not isinstance(v, int) or v < 1 for v in sizes.values()):
        raise ValueError(f"mesh axis sizes must be positive integers, got {dict(sizes)}")


def coords_in(rank: int, sizes: Mapping[str, int]) -> dict[str, int]:
    """Mesh coordinates of a global rank: row-major over the axes in order (last innermost)."""
    out, stride = {}, 1
    for name in reversed(list(sizes)):
        out[name] = (rank // stride) % sizes[name]
        stride *= sizes[name]
    return {name: out[name] for name in sizes}


def rank_in(coords: Mapping[str, int], sizes: Mapping[str, int]) -> int:
    """The global rank at ``coords`` (every axis of ``sizes`` given)."""
    rank = 0
    for name in sizes:
        rank = rank * sizes[name] + coords[name]
    return rank


def groups_along(axis: str, sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """All groups along ``axis``: each a tuple of global ranks, in a fixed order."""
    others = [a for a in sizes if a != axis]
    groups = []
    for fixed in product(*(range(sizes[a]) for a in others)):
        where = dict(zip(others, fixed))
        groups.append(tuple(rank_in({**where, axis: i}, sizes) for i in range(sizes[axis])))
    return groups


# The (pp, dp, tp) forms, kept for callers that name the three classic axes.
def coords_of(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    c = coords_in(rank, {Axis.PP: rank // (dp * tp) + 1, Axis.DP: dp, Axis.TP: tp})
    return c[Axis.PP], c[Axis.DP], c[Axis.TP]


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """The global rank at mesh coordinates (pp_rank, dp_rank, tp_rank)."""
    return rank_in({Axis.PP: pp_rank, Axis.DP: dp_rank, Axis.TP: tp_rank},
                   {Axis.PP: pp_rank + 1, Axis.DP: dp, Axis.TP: tp})


def axis_members(axis: str, pp: int, dp: int, tp: int) -> list[tuple[int, ...]]:
    return groups_along(axis, {Axis.PP: pp, Axis.DP: dp, Axis.TP: tp})


@dataclass(frozen=True)
class Mesh:
    """This process's place in a grid of named axes, with a Group per axis and one for the world.

    ``sizes`` maps axis name -> size, outermost first (default pp, dp, tp). An axis the mesh
    does not have has size 1, coordinate 0 and the solo group, so code that asks for ``cp`` on a
    mesh without one takes the size-1 path. ``pp`` / ``dp`` / ``tp`` (and ``*_rank``,
    ``*_group``) are shorthands for the classic axes.
    """
    sizes: tuple[tuple[str, int], ...]
    rank: int
    world: Group
    groups: tuple[tuple[str, Group], ...]
    flattened: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Axes made of adjacent axes (HSDP: dp = dp_replicate x dp_shard), with a group each."""

    # -- any axis ---------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        return dict(self.sizes)

    def size(self, axis: str) -> int:
        parts = dict(self.flattened).get(axis)
        return prod(self.size(a) for a in parts) if parts else self.shape.get(axis, 1)

    def coord(self, axis: str) -> int:
        parts = dict(self.flattened).get(axis)
        if parts:                             # row-major over the parts, the last innermost
            index = 0
            for a in parts:
                index = index * self.size(a) + self.coord(a)
            return index
        return coords_in(self.rank, self.shape).get(axis, 0)

    def group(self, axis: str) -> Group:
        return dict(self.groups).get(axis) or Group.solo(self.rank)

    @property
    def world_size(self) -> int:
        return prod(self.shape.values())

    # -- the classic axes ---------------------------------------------------------------------
    pp = property(lambda self: self.size(Axis.PP))
    dp = property(lambda self: self.size(Axis.DP))
    tp = property(lambda self: self.size(Axis.TP))
    pp_rank = property(lambda self: self.coord(Axis.PP))
    dp_rank = property(lambda self: self.coord(Axis.DP))
    tp_rank = property(lambda self: self.coord(Axis.TP))
    pp_group = property(lambda self: self.group(Axis.PP))
    dp_group = property(lambda self: self.group(Axis.DP))
    tp_group = property(lambda self: self.group(Axis.TP))
    cp = property(lambda self: self.size(Axis.CP))
    cp_group = property(lambda self: self.group(Axis.CP))

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.pp_rank, self.dp_rank, self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage(self) -> int | None:
        """Index in pp_group of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.pp_rank - 1

    @property
    def next_stage(self) -> int | None:
        """Index in pp_group of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.pp_rank + 1

    def describe(self) -> str:
        where = ", ".join(f"{a}={self.coord(a)}" for a in self.shape)
        grid = " x ".join(f"{a}={n}" for a, n in self.sizes)
        return f"rank {self.rank}/{self.world_size} at ({where}) of mesh {grid}"

    @staticmethod
    def solo() -> "Mesh":
        """The mesh of a single process: every axis is the solo group."""
        return Mesh(tuple((a, 1) for a in AXES), 0, Group.solo(), ())

    @property
    def grad_group(self) -> Group:
        """The ranks that hold the same parameters and average their gradients: dp, and with
        context parallelism dp x cp (each cp rank's gradient covers its part of every
        sequence; the average over both is the whole batch's: parallel/context.py)."""
        return self.group(Axis.DP_CP) if Axis.DP_CP in dict(self.flattened) else self.dp_group

    @staticmethod
    def build(pp: int = 1, dp: int = 1, tp: int = 1, timeout=None, dp_shard: int = 0,
              cp: int = 1) -> "Mesh":
        """The classic pp x dp x tp mesh (tp innermost) on the initialised process group. With
        ``0 < dp_shard < dp`` (HSDP) the dp axis is two, dp_replicate x dp_shard (shard inner:
        a shard group is dp_shard consecutive dp ranks, on one node when a node holds them;
        a replica group spans the shard groups), and ``dp`` is their flattened product. With
        ``cp > 1`` (context parallelism) a cp axis sits between dp and tp (pp, dp, cp, tp: a
        cp group is cp neighbours once tp's are placed), and ``dp_cp`` flattens dp x cp for
        the gradient sync (``grad_group``)."""
        if cp > 1:
            if 0 < dp_shard < dp:
                raise ValueError("context parallelism with HSDP is not built; use one of them")
            mesh = Mesh.from_sizes({Axis.PP: pp, Axis.DP: dp, Axis.CP: cp, Axis.TP: tp}, timeout)
            return mesh.flatten(Axis.DP_CP, (Axis.DP, Axis.CP), timeout)
        if 0 < dp_shard < dp:
            sizes = {Axis.PP: pp, Axis.DP_REPLICATE: dp // dp_shard, Axis.DP_SHARD: dp_shard,
                     Axis.TP: tp}
            return Mesh.from_sizes(sizes, timeout).flatten(
                Axis.DP, (Axis.DP_REPLICATE, Axis.DP_SHARD), timeout)
        return Mesh.from_sizes({Axis.PP: pp, Axis.DP: dp, Axis.TP: tp}, timeout)

    def flatten(self, name: str, parts: tuple[str, ...], timeout=None) -> "Mesh":
        """This mesh with one more axis group, ``name``, over the adjacent axes ``parts``
        (every rank that shares the other axes' coordinates). Collective: every rank builds
        every such group, in the same order."""
        shape = self.shape
        others = [a for a in shape if a not in parts]
        mine = Group.solo(self.rank)
        if prod(shape[a] for a in parts) > 1:
            for fixed in product(*(range(shape[a]) for a in others)):
                where = dict(zip(others, fixed))
                members = tuple(rank_in({**where, **dict(zip(parts, idx))}, shape)
                                for idx in product(*(range(shape[a]) for a in parts)))
                pg = dist.new_group(list(members), timeout=timeout)
                if self.rank in members:
                    mine = Group(pg, members, members.index(self.rank))
        return Mesh(self.sizes, self.rank, self.world, (*self.groups, (name, mine)),
                    (*self.flattened, (name, parts)))

    @staticmethod
    def from_sizes(sizes: Mapping[str, int], timeout=None) -> "Mesh":
        """Build the mesh of named axes (outermost first) on the initialised default process
        group; the product of the sizes must be the world size. ``timeout`` (a timedelta):
        each axis group's, as the world's (torch gives a new group its backend's default,
        30 minutes for gloo, not the world's: a stalled peer would hold a ZeRO all-gather
        on the dp group that long)."""
        _check(sizes)
        sizes = dict(sizes)
        total = prod(sizes.values())
        if not dist.is_initialized():
            if total != 1:
                raise RuntimeError("Mesh.from_sizes: torch.distributed is not initialised")
            return Mesh(tuple(sizes.items()), 0, Group.solo(), ())
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if total != world_size:
            grid = " x ".join(f"{a}={n}" for a, n in sizes.items())
            raise ValueError(f"mesh {grid} = {total} != world size {world_size}")
        world = Group(dist.group.WORLD, tuple(range(world_size)), rank) if world_size > 1 \
            else Group.solo(rank)
        groups = tuple((axis, _axis_group(axis, rank, sizes, timeout)) for axis in sizes)
        return Mesh(tuple(sizes.items()), rank, world, groups)


def _axis_group(axis: str, rank: int, sizes: dict[str, int], timeout=None) -> Group:
    """Create every group along ``axis`` (all ranks must, in the same order) and return the one
    holding ``rank``."""
    if sizes[axis] == 1:
        return Group.solo(rank)
    mine = None
    for members in groups_along(axis, sizes):
        pg = dist.new_group(list(members), timeout=timeout)
        if rank in members:
            mine = Group(pg, members, members.index(rank))
    return mine
