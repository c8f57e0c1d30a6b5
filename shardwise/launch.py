"""Starting a world: how many processes, and the torchrun command that starts them.

``shardwise train`` outside any launcher decides the world size from the config and, when it is
more than one, re-runs itself under ``torch.distributed.run`` (torchrun), printing the exact
command so users learn the real thing. Under torchrun, SLURM or any launcher that sets RANK and
WORLD_SIZE, it simply joins that world.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

from shardwise.config import Config
from shardwise.validate import SINGLE_PROCESS


def under_launcher() -> bool:
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ)


def gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def local_world_size(cfg: Config) -> int:
    """Processes to start on this machine when no launcher started us."""
    p = cfg.parallel
    if p.strategy in SINGLE_PROCESS:
        return 1
    if p.nproc_per_node:
        return p.nproc_per_node
    if p.strategy == "ps":
        return p.num_ps + (p.num_workers or 2)
    if p.dp:
        return p.dp * p.tp * p.pp
    if p.tp * p.pp > 1:
        return p.tp * p.pp
    return gpu_count() or 2


def world_size(cfg: Config) -> int:
    """The world this run will have: the launcher's, or the one we are about to start."""
    if under_launcher():
        return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    return local_world_size(cfg)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun command that runs ``shardwise <argv>`` on ``nproc`` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "-m", "shardwise.cli", *argv]


def relaunch(nproc: int, argv: list[str], quiet: bool = False) -> int:
    """Run ourselves under torchrun; return its exit code."""
    cmd = torchrun_command(nproc, argv)
    if not quiet:
        shown = ["torchrun", *cmd[3:]]
        print("launching:", " ".join(shlex.quote(c) for c in shown), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: ranks share the cores
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.call(cmd, env=env)
