"""Starting replica groups (``--ft-replicas R``): a lighthouse store, then one torchrun per group.

The launcher serves the lighthouse (comm/quorum.serve: a TCPStore on a free port, in this
process) and starts R torchruns of ``world / R`` ranks each, every one with its own standalone
rendezvous and ``--max-restarts N``, so torchrun's agent restarts only the ranks of the group
that lost one (they rejoin from a live group: parallel/replicas.py) while the other groups keep
training. Each group writes into ``<run>/replica<G>`` (metrics, summary, final.safetensors,
ft.jsonl: when it started, joined and which groups stepped with it). The environment names the
store (SHARDWISE_FT_STORE) and the group (SHARDWISE_FT_GROUP); on a CUDA host each group sees
its own world / R GPUs (CUDA_VISIBLE_DEVICES: :func:`group_gpus`). The launcher waits for every
group, prints one line per group that failed, and exits with the worst code; Ctrl-C / SIGTERM
go to every group (SIGTERM, then SIGKILL after ``stopping.GRACE_SECONDS``); with
``--checkpoint-dir`` the groups agree on the stop in their next quorum (parallel/replicas.py), so
all leave at one step boundary and the lowest-id live group saves that step's checkpoint (the
only writer of the run's checkpoints: a resume starts every group from it). The launcher then
prints one ``stopped at step N`` line.

Rejoining at another size (``--ft-rejoin-nproc N``): the groups' torchruns get no
``--max-restarts`` (their agent ends the group when a rank dies), and this launcher owns the
restarts instead: when a group's torchrun exits with a failure and no stop was asked for, it
prints one line and starts that group's torchrun again with N ranks, up to ``--max-restarts``
times per group (each restart at N; SHARDWISE_FT_RESTART tells the ranks which restart they
are, so they rejoin from a live group, and a checkpoint resume applies as under torchrun's
restarts). The survivors are never touched. A group whose restarts are spent leaves the run
(its failure line; the others train on, and the run's exit code is its failure's).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from shardwise.comm.quorum import serve
from shardwise.config import Config, ConfigError
from shardwise.launch.torchrun import _ranks_env, _StderrRelay, gpu_count, torchrun_command
from shardwise.parallel.replicas_checks import (ENV_GROUP, ENV_MAX_RESTARTS, ENV_RESTART,
                                                ENV_STORE)
from shardwise.run import stopping


def group_folder(run_dir: str, group: int) -> str:
    return os.path.join(run_dir, f"replica{group}")


def group_gpus(cfg: Config, group: int, per: int) -> dict[str, str]:
    """A CUDA run's group ``group`` sees its own ``per`` GPUs (CUDA_VISIBLE_DEVICES: the
    launcher's visible devices ``group x per`` to ``(group + 1) x per - 1``): each group is a
    torchrun of its own whose local ranks start at 0, so without this every group's rank r
    would take GPU r, the groups doubling up on the first GPUs and leaving the rest idle
    ({} for a CPU run, or where no GPU is visible)."""
    if cfg.train.device == "cpu":
        return {}
    gpus = gpu_count()
    if not gpus:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else \
        [str(i) for i in range(gpus)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[group * per:(group + 1) * per])}


def check_rejoin(cfg: Config, world: int) -> None:
    """``--ft-rejoin-nproc N`` before launch (ConfigError, one line): on CUDA, N at most a
    group's GPUs (:func:`group_gpus`); with ``--checkpoint-dir``, a group restarted at N
    ranks resumes the run's newest checkpoint (saved by a group of world / R ranks) before it
    takes the live state, and a ``--resume`` of the run may read one a group of N ranks
    saved: both reshard, so the layout must."""
    n, r = cfg.parallel.ft_rejoin_nproc, cfg.parallel.ft_replicas
    if n > world // r and group_gpus(cfg, 0, world // r):
        raise ConfigError("parallel.ft_rejoin_nproc", n, f"a CUDA run gives each replica group "
                          f"its own {world // r} GPU(s) (one per rank), and a group restarted "
                          f"at {n} ranks would need {n}", f"use --ft-rejoin-nproc {world // r} "
                          "or fewer, or --device cpu")
    if n <= 0 or not r or not cfg.train.checkpoint_dir or n == world // r:
        return
    from shardwise.checkpoint.canonical import why_not_reshardable
    why = why_not_reshardable(cfg)
    if why:
        raise ConfigError("parallel.ft_rejoin_nproc", n, f"with --checkpoint-dir, a group "
                          f"restarted at {n} rank(s) resumes checkpoints saved by groups of "
                          f"{world // r} (and back), resharded, and {why}",
                          f"use --ft-rejoin-nproc {world // r}, or drop --checkpoint-dir")


def launch(cfg: Config, world: int, argv: list[str], run_dir: str, quiet: bool = False) -> int:
    """Run the R groups to the end; return the worst exit code (128 + N after signal N)."""
    groups = cfg.parallel.ft_replicas
    per = world // groups
    store = serve()
    owned = bool(cfg.parallel.ft_rejoin_nproc)     # this launcher restarts the groups
    procs = []
    for g in range(groups):
        os.makedirs(group_folder(run_dir, g), exist_ok=True)
        procs.append(_Group(g, cfg, argv, run_dir, store.port, per))
        if not quiet and g == 0:
            shown = ["torchrun", *procs[0].cmd[3:]]
            print(f"launching {groups} replica groups of {per} rank(s), each: "
                  + " ".join(shlex.quote(c) for c in shown), flush=True)
    try:
        return _wait(procs, store, [group_folder(run_dir, g) for g in range(groups)], owned)
    finally:
        for p in procs:
            p.join()


class _Group:
    """One replica group's torchrun (and its stderr relay), started again by :meth:`restart`
    under ``--ft-rejoin-nproc`` (module docstring)."""

    def __init__(self, g: int, cfg: Config, argv: list[str], run_dir: str, port: int,
                 nproc: int):
        self.g, self.cfg, self.argv, self.run_dir, self.port = g, cfg, argv, run_dir, port
        self.restarts, self.relays = 0, []
        self.gpus = group_gpus(cfg, g, nproc)    # a CUDA run: this group's own GPUs
        self._start(nproc)

    def _start(self, nproc: int) -> None:
        folder = group_folder(self.run_dir, self.g)
        restarts = self.cfg.train.max_restarts
        owned = bool(self.cfg.parallel.ft_rejoin_nproc)
        self.cmd = torchrun_command(nproc, ["train", *self.argv, "--out-dir", self.run_dir,
                                            "--run-name", f"replica{self.g}"],
                                    0 if owned else restarts)
        env = {**_ranks_env(folder, restarts), ENV_GROUP: str(self.g),
               ENV_STORE: f"127.0.0.1:{self.port}", **self.gpus}
        if owned:
            env.update({ENV_RESTART: str(self.restarts), ENV_MAX_RESTARTS: str(restarts)})
        self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True,
                                     stderr=subprocess.PIPE,
                                     preexec_fn=lambda: stopping.die_with_parent(signal.SIGKILL))
        # the group's stderr passes through, and once a stop began goes to its launcher.log
        # (torchrun's own report on the signal, each rank's goodbye): the person reads one line
        self.relays.append(_StderrRelay(self.proc.stderr, os.path.join(folder, "launcher.log"),
                                        divert_on_error=False))

    def restart(self) -> bool:
        """Start the group again at --ft-rejoin-nproc ranks; False when its restarts are spent."""
        if self.restarts >= self.cfg.train.max_restarts:
            return False
        self.restarts += 1
        n = self.cfg.parallel.ft_rejoin_nproc
        print(f"replica group {self.g}: torchrun exited with {_code(self.proc.returncode)}; "
              f"restarting it with {n} rank(s) (restart {self.restarts} of "
              f"{self.cfg.train.max_restarts}); the other groups train on", file=sys.stderr,
              flush=True)
        self._start(n)      # the old relay reads on until the old group's last process is gone
        return True

    def divert(self) -> None:
        for relay in self.relays:
            relay.divert()

    def join(self) -> None:
        for relay in self.relays:
            relay.join()


def _wait(procs: list[_Group], store, folders: list[str], owned: bool) -> int:
    got: list[int] = []

    def forward(signum, frame):
        if not got:
            got.append(signum)
            for p in procs:
                p.divert()
                _signal(p.proc, signal.SIGTERM)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    codes: dict[int, int] = {}
    deadline = None
    try:
        while len(codes) < len(procs):
            for g, p in enumerate(procs):
                if g in codes or p.proc.poll() is None:
                    continue
                if p.proc.returncode and not got and owned and p.restart():
                    continue
                codes[g] = p.proc.returncode
                if p.proc.returncode and not got:
                    print(f"error: replica group {g}: torchrun exited with "
                          f"{_code(p.proc.returncode)} (its restarts are spent, or it failed "
                          "at start); the other groups train on", file=sys.stderr, flush=True)
            if got and deadline is None:
                deadline = time.monotonic() + stopping.GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    _signal(p.proc, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    del store          # the lighthouse ends with the groups
    if got:
        marked = [f for f in folders if os.path.exists(os.path.join(f, stopping.MARKER))]
        print(stopping.stop_line(marked[0] if marked else folders[0]), file=sys.stderr,
              flush=True)
        return stopping.exit_code(got[0])
    return max(_code(c) for c in codes.values())


def _code(rc: int) -> int:
    return rc if rc >= 0 else stopping.exit_code(-rc)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
