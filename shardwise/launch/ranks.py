"""The training run itself, once ``shardwise train`` has checked everything (shardwise/cli.py,
shardwise/launch/checks.py): in this process for a world of one, or as one rank of a world a launcher
started. Each ends with one line for what a person can fix (a stop, a non-finite loss, out of
memory or disk, a peer that stalled or died) and a traceback for anything else.
"""
from __future__ import annotations

import os
import sys

from shardwise.config import Config, ConfigError
from shardwise.launch.checks import error, keep_tokenizer, restart_step, warn_emulated


NON_FINITE_EXIT = 1     # the loss turned nan / inf (train.NonFiniteLoss), as any failed run


def resource_error(exc: BaseException, cfg: Config) -> str | None:
    """The one line for a run that ran out of memory or disk (sizes validation could not rule
    out), or None for any other error (a bug: its traceback shows)."""
    import errno
    import torch
    from shardwise.comm.collectives import CollectiveError
    if isinstance(exc, CollectiveError):
        return None     # a peer stalled or died: its own line (train_rank)
    text = " ".join(str(exc).split())[:200]
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                               or "out of memory" in text)):
        return (f"out of memory ({text or type(exc).__name__}); fix: lower --batch-size or the "
                "model size (--n-layer, --n-embd), or use --grad-accum, --activation-checkpointing"
                ", --mixed-precision bf16 or --zero-stage 3")
    from shardwise.memory.offload_io import OffloadIOError
    if isinstance(exc, OffloadIOError):     # the disk tier: any errno, the file named
        return (f"{exc.strerror}: {str(exc.filename)!r}; fix: free space there, or give "
                "--offload-dir on a healthy disk with room (or use --offload cpu)")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                  errno.EACCES):
        import os
        out = os.path.abspath(cfg.logging.out_dir)
        named = exc.filename and not os.path.abspath(str(exc.filename)).startswith(out + os.sep)
        if named:           # not one of the run's own files (a data or offload file)
            return (f"writing {str(exc.filename)!r} failed ({exc.strerror or exc}); fix: free "
                    "space there, or make it writable")
        also = " (or --offload-dir: offload=disk writes there too)" if cfg.memory.offload == "disk" else ""
        return (f"logging.out_dir = {cfg.logging.out_dir!r}: writing the run's files failed "
                f"({exc.strerror or exc}); fix: free space there, or pick a writable folder "
                f"with room (--out-dir){also}")
    return None


def train_here(cfg: Config, folder: str) -> int:
    """A world of one, in this process: a stop prints one line and returns 128 + signal."""
    from shardwise.run import stopping
    from shardwise.run.runtime import init_runtime, shutdown
    from shardwise.run.train import train
    from shardwise.run.train import NonFiniteLoss
    stopping.install_handlers()
    rt = init_runtime(cfg)
    try:
        train(cfg, rt)["engine"].close()
    except stopping.Stopped as exc:
        print(stopping.stop_line(folder), file=sys.stderr, flush=True)
        return stopping.exit_code(exc.signum)
    except NonFiniteLoss as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return NON_FINITE_EXIT
    except ConfigError as exc:      # found while training (an unused parameter): one line
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (MemoryError, RuntimeError, OSError) as exc:
        line = resource_error(exc, cfg)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 1
    shutdown(rt)
    return 0


def train_rank(cfg: Config) -> int:
    """One rank of a world a launcher started (ours, torchrun, SLURM). Never returns: the rank
    leaves with os._exit so that the backend's teardown at interpreter exit (gloo in torch 2.13
    aborts in about 1 of 8 worlds) cannot turn a finished run into a failure."""
    import os
    from shardwise.launch import torchrun as launch
    from shardwise.config import rundir
    from shardwise.run import stopping
    from shardwise.run.runtime import init_runtime, shutdown
    from shardwise.comm.collectives import CollectiveError
    from shardwise.run.train import NonFiniteLoss, train
    from shardwise.comm.quorum import RunFinished
    request = stopping.install_handlers()
    stopping.watch_parent()
    ours = os.environ.get("SHARDWISE_RUN_DIR")   # set by our launcher: the folder is made
    code, rt = 0, None
    try:
        rt = init_runtime(cfg)
        if not ours:
            cfg = agree_on_run(cfg, rt)
        record_flight(rt, rundir.path(cfg))
        if rt.is_main and launch.restart_count():    # --max-restarts: a restarted world
            launch.keep_attempt_metrics(rundir.path(cfg))
            print(restarted_line(cfg), flush=True)
        train(cfg, rt)["engine"].close()
        shutdown(rt)
    except ConfigError as exc:
        code = error(str(exc))
    except RunFinished as exc:          # --ft-replicas: nothing left to rejoin
        if rt is not None and rt.is_main:
            print(f"replica group: {exc} before this one rejoined", flush=True)
    except NonFiniteLoss as exc:
        if rt is not None and rt.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        code = NON_FINITE_EXIT
    except CollectiveError as exc:
        if request.signum is not None:      # a peer left because we are all stopping
            code = stopping.exit_code(request.signum)
        else:
            from shardwise.launch import hang
            if rt is not None:
                hang.mark_failed(rundir.path(cfg), rt.rank, exc.op, exc.step)
            print(collective_line(exc, rt, cfg, launch.restarts_left()), file=sys.stderr,
                  flush=True)
            code = 1
    except BaseException as exc:
        stopped = request.signum is not None or isinstance(exc, stopping.Stopped)
        line = None if stopped else resource_error(exc, cfg)
        if line is not None:     # out of memory or disk: one line; the launcher stops the rest
            print(f"error: rank {rt.rank if rt else '?'}: {line}", file=sys.stderr, flush=True)
            code = 1
        elif not stopped:
            raise   # a real error: let the traceback show; torchrun stops the others
        else:
            signum = request.signum or exc.signum
            if not ours and rt is not None and rt.is_main:
                print(stopping.stop_line(rundir.path(cfg)), file=sys.stderr, flush=True)
            code = stopping.exit_code(signum)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def restarted_line(cfg: Config) -> str:
    """Rank 0's one line in a world torchrun restarted: from which step it continues (with
    --ft-replicas: its group rejoins the live ones, from their state)."""
    from shardwise.launch import torchrun as launch
    from shardwise.parallel.replicas_checks import in_group
    group = in_group()
    if cfg.parallel.ft_replicas and group is not None:
        total = launch.max_restarts() or "?"
        return (f"restart {launch.restart_count()} of {total}: replica group {group} rejoins "
                f"the live groups at their next step, with their state "
                f"({launch.world_size(cfg)} rank(s))")
    return launch.restart_line(restart_step(cfg))


def record_flight(rt, run_dir: str) -> None:
    """This rank's flight recorder (comm/flight.py) in ``run_dir``/flight, for the hang report
    (launch/hang.py); none in a world of one. SHARDWISE_SKIP_COLLECTIVE=RANK:SEQ (a test hook)
    makes rank RANK skip its collective number SEQ, as a buggy program would."""
    if rt.world_size == 1:
        return
    from shardwise.comm.flight import FlightRecorder, path_for
    rt.comm.flight = FlightRecorder(path_for(run_dir, rt.rank), rt.rank)
    hook = os.environ.get("SHARDWISE_SKIP_COLLECTIVE", "")
    if hook.partition(":")[0] == str(rt.rank):
        rt.comm.flight.skip_seq = int(hook.partition(":")[2])


def collective_line(exc, rt, cfg: Config, left: int) -> str:
    """The one line a rank prints when a collective failed: a peer stalled or died."""
    where = f" at step {exc.step}" if exc.step else " before the first step"
    then = f"torchrun restarts the world ({left} restarts left)" if left else "the run stops"
    return (f"error: rank {rt.rank if rt else '?'}: {exc.op}{where} failed ({exc}); another "
            f"rank stalled or died (timeout {cfg.train.collective_timeout:g} s); {then}; "
            "fix: look at that rank's output above, or raise --collective-timeout "
            "if a step can take that long")


def agree_on_run(cfg: Config, rt) -> Config:
    """Under someone else's launcher: rank 0 names and makes the run directory, all ranks use it."""
    from shardwise.config import rundir
    fixed = None
    if rt.is_main:
        try:
            from shardwise.launch.torchrun import restart_count
            # a restarted world keeps its first attempt's --run-name folder (metrics: launch.py)
            fixed = cfg if restart_count() and cfg.logging.run_name else rundir.name_run(cfg)
            keep_tokenizer(fixed, rundir.create(fixed))
            warn_emulated(fixed)
        except ConfigError as exc:
            fixed = exc
    fixed = rt.comm.all_gather_object(fixed, rt.mesh.world)[0]
    if isinstance(fixed, ConfigError):
        raise fixed
    return fixed
