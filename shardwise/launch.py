"""Starting a world: how many processes, and the torchrun command that starts them.

``shardwise train`` outside any launcher decides the world size from the config and, when it is
more than one, re-runs itself under ``torch.distributed.run`` (torchrun), printing the exact
command so users learn the real thing. Under torchrun, SLURM or any launcher that sets RANK and
WORLD_SIZE, it simply joins that world.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from shardwise import stopping
from shardwise.config import Config
from shardwise.presets import SINGLE_PROCESS


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


def relaunch(nproc: int, argv: list[str], run_dir: str, quiet: bool = False) -> int:
    """Run ourselves under torchrun; return its exit code (128 + N after a stop by signal N).

    torchrun and the ranks run in a process group of their own, so a terminal's Ctrl-C reaches
    only this launcher, which forwards it (as SIGTERM) to the whole group and, after
    ``stopping.GRACE_SECONDS``, kills torchrun (and so, by their parent-death signal, every
    rank). The same happens after a rank ends the run with an ``error:`` line (a stalled peer,
    a non-finite loss), so a stopped rank cannot keep the job alive. Their stderr passes through this process
    live; once a stop has begun it goes to ``<run_dir>/launcher.log`` instead, so the person sees
    one line, not every rank's goodbye. stdout is not touched (the progress bar keeps its terminal).
    """
    cmd = torchrun_command(nproc, argv)
    if not quiet:
        shown = ["torchrun", *cmd[3:]]
        print("launching:", " ".join(shlex.quote(c) for c in shown), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: ranks share the cores
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["SHARDWISE_RUN_DIR"] = run_dir       # the ranks' run directory is prepared already
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=stopping.die_with_parent)
    relay = _StderrRelay(proc.stderr, os.path.join(run_dir, "launcher.log"))
    got: list[int] = []

    def forward(signum, frame):
        if not got:
            got.append(signum)
            relay.divert()
            _signal_group(proc, signal.SIGTERM)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    deadline = None
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                # a stop, or a rank that ended the run with an error line: the rest get
                # GRACE_SECONDS to leave, then torchrun is killed, and with it (parent-death
                # signal) every rank, a stopped (SIGSTOP) one too
                if deadline is None and (got or relay.error_seen):
                    deadline = time.monotonic() + stopping.GRACE_SECONDS
                if deadline is not None and time.monotonic() > deadline:
                    _signal_group(proc, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    relay.join()
    if got:
        print(stopping.stop_line(run_dir), file=sys.stderr, flush=True)
        return stopping.exit_code(got[0])
    return rc if rc >= 0 else 1        # torchrun killed after a rank's error: the run failed


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _StderrRelay:
    """Copy a child's stderr to ours as it comes; after ``divert()``, to a log file instead.

    A rank that ends the run on purpose prints one ``error: ...`` line first (a stalled peer, a
    non-finite loss): what follows it (torchrun's report on the failed worker, the other ranks'
    goodbyes) is diverted too, so that line is the last thing the person reads. A traceback
    (an unexpected crash) is not such a line and passes through whole."""

    def __init__(self, pipe, log_path: str):
        self.pipe, self.log_path, self._log = pipe, log_path, None
        self.error_seen = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def divert(self) -> None:
        try:
            self._log = open(self.log_path, "ab")
        except OSError:
            self._log = open(os.devnull, "wb")

    def _run(self) -> None:
        fd = self.pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out = self._log
            try:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.buffer.flush()
                    if (b"\n" + chunk).find(b"\nerror: ") >= 0:
                        self.error_seen = True
                        self.divert()
            except (OSError, ValueError):
                pass

    def join(self) -> None:
        self._thread.join(timeout=5)
        if self._log is not None:
            self._log.close()
