"""The device mesh: the world laid out as a (pp, dp, tp) grid, with one process group per axis.

Rank layout (tp innermost, pp outermost, as in Megatron and torchtitan)::

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the tp ranks that talk most (two allreduces per layer) are neighbours, on the same node when
a node holds at least tp devices; pipeline neighbours are dp*tp ranks apart. Every process builds
every group in the same order (torch.distributed requires it) and keeps the ones it belongs to.
An axis of size 1 gets the solo group (no process group is created, collectives short-circuit).

No global state: a Mesh is built once by the launcher and passed to whoever needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch.distributed as dist

from shardwise.comm.collectives import Group

AXES = ("pp", "dp", "tp")


def coords_of(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """The global rank at mesh coordinates (pp_rank, dp_rank, tp_rank)."""
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


@dataclass(frozen=True)
class Mesh:
    """This process's place in a pp x dp x tp grid, with a Group per axis and one for the world."""
    pp: int
    dp: int
    tp: int
    rank: int
    world: Group
    pp_group: Group
    dp_group: Group
    tp_group: Group

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def coords(self) -> tuple[int, int, int]:
        return coords_of(self.rank, self.dp, self.tp)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

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
        return (f"rank {self.rank}/{self.world_size} at (pp={self.pp_rank}, dp={self.dp_rank}, "
                f"tp={self.tp_rank}) of mesh pp={self.pp} x dp={self.dp} x tp={self.tp}")

    @staticmethod
    def solo() -> "Mesh":
        """The 1 x 1 x 1 mesh of a single process: every axis is the solo group."""
        g = Group.solo()
        return Mesh(1, 1, 1, 0, g, g, g, g)

    @staticmethod
    def build(pp: int = 1, dp: int = 1, tp: int = 1) -> "Mesh":
        """Build the mesh on the initialised default process group (world size = pp*dp*tp)."""
        if not dist.is_initialized():
            if pp * dp * tp != 1:
                raise RuntimeError("Mesh.build: torch.distributed is not initialised")
            return Mesh.solo()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if pp * dp * tp != world_size:
            raise ValueError(f"mesh pp x dp x tp = {pp}x{dp}x{tp} != world size {world_size}")
        world = Group(dist.group.WORLD, tuple(range(world_size)), rank) if world_size > 1 \
            else Group.solo(rank)
        groups = {}
        for axis in AXES:
            groups[axis] = _axis_group(axis, rank, pp, dp, tp)
        return Mesh(pp, dp, tp, rank, world, groups["pp"], groups["dp"], groups["tp"])


def axis_members(axis: str, pp: int, dp: int, tp: int) -> list[tuple[int, ...]]:
    """All groups along ``axis``: each a tuple of global ranks, in a fixed order."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    others = [a for a in AXES if a != axis]
    groups = []
    for fixed in product(*(range(sizes[a]) for a in others)):
        where = dict(zip(others, fixed))
        members = []
        for i in range(sizes[axis]):
            where[axis] = i
            members.append(rank_of(where["pp"], where["dp"], where["tp"], dp, tp))
        groups.append(tuple(members))
    return groups


def _axis_group(axis: str, rank: int, pp: int, dp: int, tp: int) -> Group:
    """Create every group along ``axis`` (all ranks must) and return the one holding ``rank``."""
    size = {"pp": pp, "dp": dp, "tp": tp}[axis]
    if size == 1:
        return Group.solo(rank)
    mine = None
    for members in axis_members(axis, pp, dp, tp):
        pg = dist.new_group(list(members))
        if rank in members:
            mine = Group(pg, members, members.index(rank))
    return mine
