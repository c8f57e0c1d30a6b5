"""A stop that saves first: with checkpointing on, SIGINT / SIGTERM end the run at a step boundary
with a checkpoint of that step.

shardwise/run/stopping.py's handler raises :class:`~shardwise.run.stopping.Stopped` at once, wherever
the rank is (inside a collective, half-way through an optimizer step): no state to save there.
Inside :class:`DeferredStop` the signal is only recorded; after each step the ranks agree on
whether any rank was asked to stop (one scalar all-reduce over the world, on the run's
device, metered as 'metrics'), and if so every rank saves the checkpoint of that step and then
raises ``Stopped`` through the handler that was installed before (so the CLI reports the stop as
usual). A rank signalled alone (only one got Ctrl-C) stops the others with it. The save has
the launcher's grace period (stopping.GRACE_SECONDS, 6 s) to finish before what is left is
killed; a stop during a save is taken after it.
"""
from __future__ import annotations

import signal
import threading

import torch

from shardwise.run.stopping import Stopped

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredStop:
    """Record SIGINT / SIGTERM inside the ``with``; :meth:`agreed` says whether to stop now."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "DeferredStop":
        if self.enabled:
            for sig in _SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def agreed(self, comm, world) -> int | None:
        """Every rank: the signal any rank received (the largest number), or None. The flag
        lives on ``comm.device`` (the run's compute device: NCCL reduces device tensors only)."""
        if not self.enabled:
            return None
        flag = torch.tensor([float(self.signum or 0)], device=comm.device)
        comm.all_reduce(flag, world, op="max", name="metrics")
        return int(flag.item()) or None

    def stop(self, signum: int) -> None:
        """Leave as the handler installed before would have (raises Stopped)."""
        previous = self._previous.get(signum)
        self.__exit__()
        if callable(previous):
            previous(signum, None)          # stopping.StopRequest: records, then raises
        raise Stopped(signum)
