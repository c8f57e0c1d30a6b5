"""Starting replica groups (``--ft-replicas R``): a lighthouse store, then one torchrun per group.

The launcher serves the lighthouse (comm/quorum.serve: a TCPStore on a free port, in this
process) and starts R torchruns of ``world / R`` ranks each, every one with its own standalone
rendezvous and ``--max-restarts N``, so torchrun's agent restarts only the ranks of the group
that lost one (they rejoin from a live group: parallel/replicas.py) while the other groups keep
training. Each group writes into ``<run>/replica<G>`` (metrics, summary, final.safetensors,
ft.jsonl: when it started, joined and which groups stepped with it). The environment names the
store (SHARDWISE_FT_STORE) and the group (SHARDWISE_FT_GROUP). The launcher waits for every
group, prints one line per group that failed, and exits with the worst code; Ctrl-C / SIGTERM
go to every group (SIGTERM, then SIGKILL after ``stopping.GRACE_SECONDS``); with
``--checkpoint-dir`` the groups agree on the stop in their next quorum (parallel/replicas.py), so
all leave at one step boundary and the lowest-id live group saves that step's checkpoint (the
only writer of the run's checkpoints: a resume starts every group from it). The launcher then
prints one ``stopped at step N`` line.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from shardwise.comm.quorum import serve
from shardwise.config import Config
from shardwise.launch.torchrun import _ranks_env, _StderrRelay, torchrun_command
from shardwise.parallel.replicas_checks import ENV_GROUP, ENV_STORE
from shardwise.run import stopping


def group_folder(run_dir: str, group: int) -> str:
    return os.path.join(run_dir, f"replica{group}")


def launch(cfg: Config, world: int, argv: list[str], run_dir: str, quiet: bool = False) -> int:
    """Run the R groups to the end; return the worst exit code (128 + N after signal N)."""
    groups = cfg.parallel.ft_replicas
    per = world // groups
    store = serve()
    restarts = cfg.train.max_restarts
    procs = []
    for g in range(groups):
        folder = group_folder(run_dir, g)
        os.makedirs(folder, exist_ok=True)
        cmd = torchrun_command(per, ["train", *argv, "--out-dir", run_dir, "--run-name",
                                     f"replica{g}"], restarts)
        env = {**_ranks_env(folder, restarts), ENV_GROUP: str(g),
               ENV_STORE: f"127.0.0.1:{store.port}"}
        if not quiet and g == 0:
            shown = ["torchrun", *cmd[3:]]
            print(f"launching {groups} replica groups of {per} rank(s), each: "
                  + " ".join(shlex.quote(c) for c in shown), flush=True)
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      stderr=subprocess.PIPE,
                                      preexec_fn=lambda: stopping.die_with_parent(signal.SIGKILL)))
    # each group's stderr passes through, and once a stop began goes to its launcher.log
    # (torchrun's own report on the signal, each rank's goodbye): the person reads one line
    relays = [_StderrRelay(p.stderr, os.path.join(group_folder(run_dir, g), "launcher.log"),
                           divert_on_error=False) for g, p in enumerate(procs)]
    try:
        return _wait(procs, store, [group_folder(run_dir, g) for g in range(groups)], relays)
    finally:
        for relay in relays:
            relay.join()


def _wait(procs: list[subprocess.Popen], store, folders: list[str], relays: list) -> int:
    got: list[int] = []

    def forward(signum, frame):
        if not got:
            got.append(signum)
            for p, relay in zip(procs, relays):
                relay.divert()
                _signal(p, signal.SIGTERM)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    codes: dict[int, int] = {}
    deadline = None
    try:
        while len(codes) < len(procs):
            for g, p in enumerate(procs):
                if g not in codes and p.poll() is not None:
                    codes[g] = p.returncode
                    if p.returncode and not got:
                        print(f"error: replica group {g}: torchrun exited with "
                              f"{_code(p.returncode)} (its restarts are spent, or it failed "
                              "at start); the other groups train on", file=sys.stderr, flush=True)
            if got and deadline is None:
                deadline = time.monotonic() + stopping.GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    _signal(p, signal.SIGKILL)
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
