"""Starting a world: how many processes, and the torchrun command that starts them.

``shardwise train`` outside any launcher decides the world size from the config and, when it is
more than one, re-runs itself under ``torch.distributed.run`` (torchrun), printing the exact
command so users learn the real thing. Under torchrun, SLURM or any launcher that sets RANK and
WORLD_SIZE, it simply joins that world.

GPUs: a CUDA run has one rank per GPU (NCCL refuses two ranks on one device). Without a setting
that fixes the process count, a CUDA run starts one process per visible GPU (a one-GPU host: a
world of one, no torchrun), a CPU run two; a count beyond the visible GPUs is refused before
launch (``check_gpus``).

Restarts (``--max-restarts N``): the command passes ``--max-restarts N`` to torchrun, whose
elastic agent stops the whole world when a rank dies and starts it again, up to N times, with
``TORCHELASTIC_RESTART_COUNT`` counting the attempts. A restarted world resumes from the newest
complete checkpoint in ``--checkpoint-dir`` (cli.py turns the restart into ``--resume``), or
starts over from step 0 when none was saved yet; rank 0 says which in one line.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from shardwise.launch import hang
from shardwise.run import stopping
from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import SINGLE_PROCESS, has_roles
from shardwise.parallel.replicas_checks import ENV_MAX_RESTARTS, ENV_RESTART


def under_launcher() -> bool:
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ)


def gpu_count() -> int:
    """CUDA devices this process sees. On a machine with no NVIDIA device node (every CPU-only
    machine) that is 0 without importing torch, so the launcher checks flags in a fraction of a
    second; elsewhere torch counts them."""
    import glob
    if not glob.glob("/dev/nvidia[0-9]*") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def local_ranks() -> int | None:
    """Ranks on this machine under a launcher (torchrun's LOCAL_WORLD_SIZE, SLURM's
    SLURM_NTASKS_PER_NODE); None otherwise (every rank we start is on this machine)."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(value) if value.isdigit() else None


def local_world_size(cfg: Config) -> int:
    """Processes to start on this machine when no launcher started us. Without a setting that
    fixes it: one per visible GPU for a CUDA run (a one-GPU host runs a world of one), 2 on
    CPU; with ``--device cpu`` the GPUs are not counted (nor is CUDA asked)."""
    p = cfg.parallel
    if p.strategy in SINGLE_PROCESS:
        return 1
    if p.nproc_per_node:
        return p.nproc_per_node
    if has_roles(cfg):
        return p.num_ps + (p.num_workers or 2)
    if p.dp:
        return p.dp * p.tp * p.pp * p.cp
    if p.tp * p.pp * p.cp > 1:
        return p.tp * p.pp * p.cp
    if cfg.train.device == "cpu":
        return 2
    return gpu_count() or 2


def _world_setting(cfg: Config) -> tuple[str, object, str]:
    """(field, value, what it means) of the setting that fixes the local process count."""
    p = cfg.parallel
    if p.nproc_per_node:
        return "parallel.nproc_per_node", p.nproc_per_node, f"{p.nproc_per_node} processes"
    if has_roles(cfg):
        return ("parallel.num_workers", p.num_workers or 2,
                f"num_ps + num_workers = {local_world_size(cfg)} processes")
    if p.dp:
        return "parallel.dp", p.dp, f"dp x tp x pp = {local_world_size(cfg)} processes"
    field = "parallel.tp" if p.tp > 1 else "parallel.pp"
    return field, p.tp if p.tp > 1 else p.pp, f"tp x pp = {local_world_size(cfg)} processes"


def check_gpus(cfg: Config) -> None:
    """One GPU per rank, before any process starts (ConfigError: one line). A CUDA run
    (``--device cuda``, or ``auto`` where a GPU is visible) whose processes on this node
    outnumber the visible GPUs is refused: NCCL refuses two ranks on one device, and the run
    would otherwise fail at its first collective. Under a launcher the node's count is its
    LOCAL_WORLD_SIZE (torchrun's; SLURM_NTASKS_PER_NODE under SLURM); without one,
    ``local_world_size``."""
    if cfg.train.device == "cpu":
        return
    gpus = gpu_count()
    if not gpus:
        return      # auto: the CPU; cuda: validate's "no CUDA device is visible"
    visible = f"{gpus} CUDA device{'s are' if gpus > 1 else ' is'} visible"
    if under_launcher():
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "")
        local = int(local) if local.isdigit() else 0
        if local > gpus:
            raise ConfigError("train.device", cfg.train.device, f"the launcher starts {local} "
                              f"ranks on this node (LOCAL_WORLD_SIZE) but {visible}, and NCCL "
                              "needs one GPU per rank", f"start at most {gpus} rank(s) per node "
                              f"(torchrun --nproc-per-node {gpus}), or --device cpu")
        return
    n = local_world_size(cfg)
    if n > gpus:
        field, value, what = _world_setting(cfg)
        fix = (f"--nproc-per-node {gpus}" if field == "parallel.nproc_per_node"
               else f"a layout of at most {gpus} process(es)")
        raise ConfigError(field, value, f"{what} on this node but {visible}, and NCCL needs "
                          "one GPU per rank", f"{fix}, or --device cpu")


def world_size(cfg: Config) -> int:
    """The world this run will have: the launcher's, or the one we are about to start."""
    if under_launcher():
        return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    return local_world_size(cfg)


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """The torchrun command that runs ``shardwise <argv>`` on ``nproc`` local processes
    (restarting the whole world up to ``max_restarts`` times when a rank dies)."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), *restarts, "-m", "shardwise.cli", *argv]


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this world (0: the first start,
    or no torchrun at all); a replica group that shardwise's launcher restarted
    (``--ft-rejoin-nproc``) counts those restarts too."""
    if not under_launcher():
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) + \
        int(os.environ.get(ENV_RESTART) or 0)


def max_restarts() -> int:
    """The most restarts this world gets: torchrun's agent's, or those of shardwise's replica
    launcher when it owns them (``--ft-rejoin-nproc``)."""
    return int(os.environ.get(ENV_MAX_RESTARTS) or os.environ.get("TORCHELASTIC_MAX_RESTARTS")
               or 0)


def restarts_left() -> int:
    """How many more times torchrun's agent (or the replica launcher) will restart this world
    after a failure."""
    if not under_launcher():
        return 0
    return max(0, max_restarts() - restart_count())


def check_restarts(cfg: Config) -> None:
    """``train.max_restarts`` refusals, before any process starts (ConfigError: one line)."""
    n = cfg.train.max_restarts
    if n < 0:
        raise ConfigError("train.max_restarts", n, "is negative",
                          "give 0 (a dead rank ends the run) or a number of restarts")
    if n and not cfg.train.checkpoint_dir and not cfg.parallel.ft_replicas:
        raise ConfigError("train.max_restarts", n, "a restarted world resumes from the last "
                          "checkpoint, and without --checkpoint-dir nothing is saved to resume "
                          "from", "add --checkpoint-dir DIR (and --checkpoint-every N)")
    agent = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    owned = os.environ.get(ENV_MAX_RESTARTS) == str(n)    # the replica launcher restarts
    if n and under_launcher() and agent != str(n) and not owned:
        raise ConfigError("train.max_restarts", n, "under a launcher that shardwise did not "
                          "start, that launcher decides about restarts "
                          f"(torchrun --max-restarts: {agent or 'not torchrun'})",
                          "pass --max-restarts to torchrun itself (a restarted world resumes "
                          "from --checkpoint-dir on its own) and drop it here")


def restart_line(step: int | None) -> str:
    """Rank 0's one line in a restarted world: from which step it continues."""
    where = f"resuming from step {step}" if step is not None else \
        "no checkpoint was saved yet; starting over from step 0"
    return f"restart {restart_count()} of {max_restarts() or '?'}: {where}"


def keep_attempt_metrics(run_dir: str) -> None:
    """Rank 0 of a restarted world: the earlier attempt's metrics files are renamed
    (``metrics-attempt0.jsonl``) so that the new attempt's do not write over them."""
    earlier = restart_count() - 1
    for name in ("metrics.jsonl", "metrics.csv"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            stem, ext = os.path.splitext(name)
            os.replace(path, os.path.join(run_dir, f"{stem}-attempt{earlier}{ext}"))


def relaunch(nproc: int, argv: list[str], run_dir: str, quiet: bool = False,
             max_restarts: int = 0) -> int:
    """Run ourselves under torchrun; return its exit code (128 + N after a stop by signal N).

    torchrun and the ranks run in a process group of their own, so a terminal's Ctrl-C reaches
    only this launcher, which forwards it (as SIGTERM) to the whole group and, after
    ``stopping.GRACE_SECONDS``, kills torchrun (and so, by their parent-death signal, every
    rank). The same happens after a rank ends the run with an ``error:`` line (a stalled peer,
    a non-finite loss), so a stopped rank cannot keep the job alive. Their stderr passes through this process
    live; once a stop has begun it goes to ``<run_dir>/launcher.log`` instead, so the person sees
    one line, not every rank's goodbye. stdout is not touched (the progress bar keeps its terminal).

    With ``max_restarts``, a rank's ``error:`` line (its peer died) does not end the job:
    torchrun's agent restarts the world, or fails it once the restarts are spent, and stderr
    keeps passing through, so the person sees each failure and the agent's restart notice.
    """
    cmd = torchrun_command(nproc, argv, max_restarts)
    if not quiet:
        shown = ["torchrun", *cmd[3:]]
        print("launching:", " ".join(shlex.quote(c) for c in shown), flush=True)
    # torchrun dies with this launcher, by SIGKILL: this launcher ends before torchrun only when
    # it was killed itself (every stop it handles waits for torchrun), and torchrun's own
    # SIGTERM path waits up to 30 s for ranks that a busy machine is slow to end; by SIGKILL,
    # its ranks follow at once (their own parent-death signal, stopping.watch_parent)
    proc = subprocess.Popen(cmd, env=_ranks_env(run_dir, max_restarts), stderr=subprocess.PIPE,
                            start_new_session=True,
                            preexec_fn=lambda: stopping.die_with_parent(signal.SIGKILL))
    relay = _StderrRelay(proc.stderr, os.path.join(run_dir, "launcher.log"),
                         divert_on_error=not max_restarts)
    got: list[int] = []

    def forward(signum, frame):
        if not got:
            got.append(signum)
            relay.divert()
            _signal_group(proc, signal.SIGTERM)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    report: list[str] = []

    def ending() -> bool:
        if relay.error_seen and not report and hang.failed(run_dir):
            report.append(hang.snapshot(run_dir))   # while the ranks are still there
        return bool(got) or (relay.error_seen and not max_restarts)
    try:
        rc = _wait(proc, ending)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    relay.join()
    if report:                           # a collective timed out: who was behind, and where
        print(report[0], file=sys.stderr, flush=True)
    if got:
        print(stopping.stop_line(run_dir), file=sys.stderr, flush=True)
        return stopping.exit_code(got[0])
    if rc < 0 and not relay.error_seen:   # killed from outside, not by this launcher
        print(f"error: torchrun (pid {proc.pid}) was killed by {signal.Signals(-rc).name} from "
              f"outside this launcher, and its ranks with it; metrics so far in {run_dir}",
              file=sys.stderr, flush=True)
        return stopping.exit_code(-rc)
    return rc if rc >= 0 else 1        # torchrun killed after a rank's error: the run failed


def _ranks_env(run_dir: str, max_restarts: int) -> dict:
    """The environment torchrun and the ranks start with."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: ranks share the cores
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["SHARDWISE_RUN_DIR"] = run_dir       # the ranks' run directory is prepared already
    if max_restarts:
        # torchrun shares its rendezvous store with the ranks by default, and a restarted
        # world then reads the dead world's addresses from it: gloo's connectFullMesh dials a
        # closed port and the restart hangs or fails (pytorch/pytorch#135712; seen here about
        # one restart in two). With sharing off, each attempt's rank 0 serves a fresh store.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def _wait(proc: subprocess.Popen, ending) -> int:
    """Wait for torchrun. Once ``ending()`` (a stop, or a rank that ended the run with an error
    line) the rest get GRACE_SECONDS to leave, then torchrun is killed, and with it (parent-death
    signal) every rank, a stopped (SIGSTOP) one too."""
    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            if deadline is None and ending():
                deadline = time.monotonic() + stopping.GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                _signal_group(proc, signal.SIGKILL)


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

    def __init__(self, pipe, log_path: str, divert_on_error: bool = True):
        self.pipe, self.log_path, self._log = pipe, log_path, None
        self.divert_on_error = divert_on_error
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
                        if self.divert_on_error:
                            if not chunk.endswith(b"\n"):   # print's newline may come later
                                sys.stderr.buffer.write(b"\n")
                                sys.stderr.buffer.flush()
                            self.divert()
            except (OSError, ValueError):
                pass

    def join(self) -> None:
        self._thread.join(timeout=5)
        if self._log is not None:
            self._log.close()
