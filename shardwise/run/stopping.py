"""Stopping a run on purpose: SIGINT / SIGTERM, a dead launcher, and the one line a person sees.

What a stop looks like from outside (``kill``, ``timeout``, a scheduler, an IDE's stop button,
Ctrl-C): the ``shardwise`` launcher forwards the signal to torchrun and every rank (one process
group), every rank leaves within seconds without a traceback, and the launcher prints one line:
``stopped at step N; metrics so far in DIR``. The launcher waits ``GRACE_SECONDS`` for the ranks
and then kills what is left, so nothing outlives it.

In a rank, :func:`install_handlers` turns SIGINT / SIGTERM into :class:`Stopped`, raised in the
main thread at the next Python instruction: the training loop's ``finally`` blocks close the
progress bar and flush the metrics files, and the rank exits without waiting for the others (they
may be inside a collective this rank will never join). Rank 0 leaves ``stopped.json`` in the run
directory with the step it reached, which the launcher reads for its line.

If the launcher itself is killed with SIGKILL (no handler can run), the kernel tells its children:
torchrun asks for SIGTERM when the launcher dies (and stops its ranks as usual), each rank asks
for SIGKILL when torchrun dies (Linux ``PR_SET_PDEATHSIG``), so no rank is left training with
nobody to report to.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

GRACE_SECONDS = 6.0            # launcher: SIGTERM, then SIGKILL what is left after this long
MARKER = "stopped.json"        # in the run directory, written by rank 0 when it stops
_PR_SET_PDEATHSIG = 1


class Stopped(BaseException):
    """SIGINT / SIGTERM arrived: leave the run (a BaseException, like KeyboardInterrupt, so that
    ``except Exception`` in user code does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    """The signal this process was asked to stop by (None until one arrives). One per process,
    because signals are per process: :func:`install_handlers` returns it."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum, frame) -> None:
        # a second signal while stopping changes nothing: we are already on the way out
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.signum = signum
        raise Stopped(signum)


def install_handlers() -> StopRequest:
    """In a training process: SIGINT / SIGTERM raise :class:`Stopped` in the main thread. The
    returned request also tells an error that surfaced first (a peer that already left made a
    collective fail) from a real one: after a stop request, neither is reported."""
    request = StopRequest()
    signal.signal(signal.SIGINT, request)
    signal.signal(signal.SIGTERM, request)
    return request


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only; a no-op
    elsewhere). Safe in a ``preexec_fn``: no allocation beyond the ctypes call."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return


def watch_parent() -> None:
    """In a rank: die with the launcher (torchrun's agent); leave now if it is already gone.

    SIGKILL, not SIGTERM: a live torchrun stops its ranks with SIGTERM itself and waits for
    them, so this fires only when the agent died abruptly (killed by our launcher after its
    grace period), and it must also end a rank that is stopped (SIGSTOP), which no other signal
    reaches."""
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:           # the parent died before the request took effect
        os._exit(143)


def write_marker(run_dir: str, step: int, signum: int) -> None:
    """Rank 0: record where the run stopped (best effort: a full disk must not mask the stop)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, MARKER), "w") as fh:
            json.dump({"step": step, "signal": signal.Signals(signum).name}, fh)
    except OSError:
        pass


def stop_line(run_dir: str) -> str:
    """The one line the launcher prints after a stop."""
    try:
        with open(os.path.join(run_dir, MARKER)) as fh:
            step = json.load(fh)["step"]
    except (OSError, ValueError, KeyError):
        return f"stopped before the first step; run directory {run_dir}"
    return f"stopped at step {step}; metrics so far in {run_dir}"


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)
