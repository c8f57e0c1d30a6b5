"""The process's runtime: backend, device, process group, mesh and communication meter.

``init_runtime`` joins the world that a launcher described in the environment (torchrun, or
anything that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; SLURM's SLURM_PROCID /
SLURM_NTASKS are mapped when MASTER_ADDR is set), picks nccl where CUDA is present and gloo
otherwise, and builds the mesh. Without a launcher it is a world of one: no process group at all.
"""
from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, CommMeter
from shardwise.config import Config, ConfigError
from shardwise.mesh import Mesh
from shardwise.parallel.presets import has_roles
from shardwise.run.allocator import configure as configure_allocator


@dataclass
class Runtime:
    mesh: Mesh
    comm: Comm
    device: torch.device
    backend: str | None
    local_rank: int = 0
    allocator: str = "system"     # train.cpu_allocator as applied (run/allocator.py), in words

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0


def launcher_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment; (0, 1, 0) without one."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env.get("SLURM_NTASKS", "1")
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if "RANK" not in env:
        return 0, 1, 0
    return int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def pick_device(choice: str, local_rank: int, shared_gpus: bool = False) -> torch.device:
    """The device of the rank ``local_rank`` of this node: ``cuda:local_rank`` for
    ``train.device`` cuda (or auto where CUDA is present), else the CPU (CUDA is not touched).

    One GPU per rank: NCCL refuses two ranks on one device, so a local rank beyond the visible
    GPUs is refused (ConfigError naming the fix), never wrapped round. ``shared_gpus`` is the
    one exception, on purpose: a gloo world someone else started (a test harness whose ranks
    share a GPU and stage collectives through the host) takes GPU ``local_rank % count``."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is visible",
                              "use --device cpu (or auto)")
        count = torch.cuda.device_count()
        if local_rank >= count and not shared_gpus:
            raise ConfigError("train.device", choice, f"this is local rank {local_rank} but "
                              f"{count} CUDA device(s) are visible, and NCCL needs one GPU per "
                              "rank", f"start at most {count} rank(s) per node (torchrun "
                              f"--nproc-per-node {count}), or --device cpu")
        torch.cuda.set_device(local_rank % count)      # == local_rank unless shared_gpus
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def joined_local_rank() -> int:
    """This rank's local rank in a world someone else started: LOCAL_RANK when set; else, in
    an NCCL world, the GPU its starter bound it to (``device_id``, else the current device:
    NCCL needs one, and it is the rank's own); else 0."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        return bound.index if bound is not None and bound.index is not None \
            else torch.cuda.current_device()
    return 0


def collective_seconds(cfg: Config) -> float:
    """How long a collective may wait for the other ranks: train.collective_timeout, and for
    the parameter server at least a few ps timeouts, so its own failure handling runs first."""
    seconds = cfg.train.collective_timeout
    if has_roles(cfg):                     # the parameter server
        seconds = max(seconds, 60.0, 4 * cfg.parallel.ps_timeout)
    return seconds


def _dp_shard(cfg: Config, dp: int) -> int:
    """HSDP's shard size over a dp axis of ``dp`` (0: not HSDP), for ZeRO stages 1-3 only."""
    from shardwise.parallel.data.checks import hsdp
    from shardwise.parallel.layout import zero_stage
    if zero_stage(cfg) < 1 or has_roles(cfg):
        return 0
    replicate, shard = hsdp(cfg, dp)
    return shard if replicate > 1 else 0


def init_runtime(cfg: Config, mesh_sizes: tuple[int, int, int] | None = None) -> Runtime:
    """Join the launcher's world (if any) and build the (pp, dp, tp) mesh for ``cfg``.

    mesh_sizes: (pp, dp, tp) to use instead of the config's (the ps strategy lays the world out
    as one dp axis).
    """
    if dist.is_initialized():  # a world someone else started (a test harness, a user script)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = joined_local_rank()
    else:
        rank, world_size, local_rank = launcher_world()
    # several ranks on one GPU only in a gloo world someone else started (pick_device)
    shared_gpus = dist.is_initialized() and dist.get_backend() == "gloo"
    device = pick_device(cfg.train.device, local_rank, shared_gpus)
    backend = None
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        # a stalled or dead rank fails the others' collectives after this long, not after
        # gloo's default 30 minutes; the parameter server also waits a few ps timeouts, so
        # that its own failure handling (docs/parameter-server.md) runs first
        kwargs["timeout"] = timedelta(seconds=collective_seconds(cfg))
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    elif dist.is_initialized():
        backend = dist.get_backend()
    if mesh_sizes is None:
        from shardwise.parallel.presets import resolve_dp
        p = cfg.parallel
        mesh_sizes = ((1, world_size, 1) if has_roles(cfg)
                      else (p.pp, resolve_dp(cfg, world_size), p.tp))
    timeout = timedelta(seconds=collective_seconds(cfg)) if world_size > 1 else None
    cp = 1 if has_roles(cfg) else getattr(cfg.parallel, "cp", 1)
    mesh = Mesh.build(*mesh_sizes, timeout=timeout, dp_shard=_dp_shard(cfg, mesh_sizes[1]), cp=cp)
    # SHARDWISE_CHECK_DEVICES=1: every collective checks its tensors' devices (debug mode)
    comm = Comm(CommMeter(), timeout=timeout, spin=spins(cfg.train.comm_wait, device, world_size),
                device=device, check_devices=os.environ.get("SHARDWISE_CHECK_DEVICES") == "1")
    allocator = configure_allocator(cfg.train.cpu_allocator, device, cfg.memory.offload)
    return Runtime(mesh=mesh, comm=comm, device=device, backend=backend, local_rank=local_rank,
                   allocator=allocator)


def spins(choice: str, device: torch.device, world_size: int) -> bool:
    """Whether collectives are waited by polling (``train.comm_wait``; comm/collectives.py):
    ``auto`` polls on CPU when this host's ranks (LOCAL_WORLD_SIZE, else the world) times each
    one's threads fit in its cores, so no rank's compute loses a core to another's polling."""
    if choice != "auto":
        return choice == "spin"
    if device.type != "cpu" or world_size < 2:
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return local * torch.get_num_threads() <= len(os.sched_getaffinity(0))


def shutdown(rt: Runtime, clean: bool = True) -> None:
    """Leave the world. ``clean`` (every rank got here after a finished run): wait for every
    rank first, so none tears its connections down while another still uses them. After an
    error: no barrier (the others may be stuck in a collective this rank will not join)."""
    if dist.is_initialized():
        if clean:
            rt.comm.barrier(rt.mesh.world)
        dist.destroy_process_group()
