"""The ps task's side of parameter-server training: apply the workers' gradients to the
parameters this task owns, in sync, async or bounded-staleness (ssp) order, and answer each
worker with fresh parameters.

Clocks and versions (per ps task):
    clock of worker w   gradients w has pushed so far (its push for step k carries clock k+1)
    version             updates this ps has applied so far (the parameters a worker pulls carry it)
    staleness           of an applied gradient: updates applied between the worker's pull of the
                        parameters it used and this application (version now - version pulled)

sync  every live worker's gradient for step k is summed in worker order, divided by the number of
      live workers, applied once (version += 1, staleness 0); then every worker gets the result.
async each gradient is applied on arrival with weight 1 / num_workers (version += 1 each) and its
      worker is answered at once.
ssp   as async, but the answer to a worker whose clock is more than ``staleness`` ahead of the
      slowest live worker's is held back until the slowest catches up (Ho et al., "More Effective
      Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013). With
      staleness 0 and plain SGD this is exactly sync: every worker computes on the same version
      and the N applications of g_w / N sum to one step on the mean gradient.

Buffers (ps task 0 only, ``extras``): each push carries the worker's buffers after its
gradients; the lowest live worker's are kept and every answer carries them after the parameters.
Clipping (sync, ``train.grad_clip``): the averaged gradient is scaled by torch's coefficient
min(1, max_norm / (norm + 1e-6)), the norm summed over the ps tasks' shards (``servers`` group).

fp16 (``memory.mixed_precision = "fp16"``, dynamic loss scaling; ps.py's docstring has the whole
picture): each push says whether the worker's gradients, over its whole model, hold an inf / nan
(header ``nonfinite``; every ps task of that push gets the same verdict, so none applies a part
of a bad gradient).
sync  any non-finite push among the step's skips the whole update on every ps task: no optimizer
      step, no clip, no version, no record; every worker is answered with ``skipped`` = 1 and
      the unchanged parameters. Every ps task and worker then moves its own LossScaler with the
      same verdict (halve on a skip, double after growth_interval clean steps), so all agree.
async the non-finite push is dropped (not applied, not recorded, counted in ``dropped``) and its
/ssp  worker alone is answered with ``skipped`` = 1 (it halves its scale); the other workers'
      pushes are applied as usual. The ps keeps a copy of each worker's scaler, moved by that
      worker's verdicts (``WorkerScalers``), to report the scales and the dropped pushes.

``serve(k)`` returns once every live worker's push for step k has been applied and answered, so
the training loop's collectives (evaluation, logging) meet every rank at the same step.
Failures: a worker that sends nothing for ``ps_timeout`` seconds, or whose link breaks, is named
(/job:worker/task:w); sync with on_worker_failure=stop raises, anything else drops it and goes on
with the rest (sync then averages over the survivors).
"""
from __future__ import annotations

import math
import queue
import sys
from collections import deque

import torch

from shardwise.comm.ps_transport import HEADER, ServerEnd, pack, task_name, unpack
from shardwise.memory.loss_scale import LossScaler

KEEP_RECORDS = 4096     # per-gradient records kept for stats(); the totals cover every step


class WorkerScalers:
    """async / ssp on a ps task: a copy of every worker's fp16 loss scaler, moved by the verdict
    on each of its pushes exactly as the worker moves its own (LossScaler.update is a function of
    the verdicts alone), so the ps can report them. ``report`` has the shape every strategy's
    scaler reports (train.py's summary): the lowest worker scale, and the dropped pushes."""

    enabled = True

    def __init__(self, num_workers: int):
        self.workers = [LossScaler(True) for _ in range(num_workers)]

    def update_worker(self, w: int, overflow: bool) -> None:
        self.workers[w].update(overflow)

    @property
    def scale(self) -> float:
        return min(s.scale for s in self.workers)

    @property
    def skipped_steps(self) -> int:
        """Dropped pushes, over every worker (async has no world-wide step to skip)."""
        return sum(s.skipped_steps for s in self.workers)

    def report(self) -> dict:
        return {"loss_scale": self.scale, "skipped_steps": self.skipped_steps,
                "loss_scale_per_worker": [s.scale for s in self.workers]}

    def state_dict(self) -> dict:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps,
                "workers": [s.state_dict() for s in self.workers]}


class ParamServer:
    """Parameters, optimizer and update bookkeeping of one ps task."""

    def __init__(self, params: list, optimizer, end: ServerEnd, num_workers: int, cfg,
                 extras: list | None = None, servers=None, scaler=None):
        p = cfg.parallel
        # fp16: sync moves one LossScaler per step, async / ssp a WorkerScalers per push
        self.scaler = scaler if cfg.memory.mixed_precision == "fp16" else None
        self.params, self.optimizer, self.end = params, optimizer, end
        self.extras, self.servers = extras or [], servers
        self.clip = cfg.train.grad_clip
        self.num_workers, self.mode, self.staleness = num_workers, p.ps_mode, p.staleness
        self.stop_on_failure = p.ps_mode == "sync" and p.on_worker_failure == "stop"
        self.timeout, self.num_ps = p.ps_timeout, p.num_ps
        self.version, self.clocks = 0, [0] * num_workers
        self.live, self.failed = set(range(num_workers)), {}
        self.applied = [0] * num_workers        # gradients applied, per worker
        self.dropped = [0] * num_workers        # fp16: pushes received and not applied
        self.skip_flags = [0.0] * num_workers   # the ``skipped`` of each worker's next answer
        # the newest KEEP_RECORDS of each (a long run's memory stays flat), with totals of all
        self.records: deque = deque(maxlen=KEEP_RECORDS)    # one per applied gradient
        self.releases: deque = deque(maxlen=KEEP_RECORDS)   # one per answer (ssp bound evidence)
        self.staleness_max, self.staleness_sum, self.bound_max = 0, 0, 0
        self.losses: dict[int, list[float]] = {}  # clock -> losses the workers sent with it
        self.deferred: set[int] = set()
        numel = self.numel = sum(t.numel() for t in params)
        extra = sum(t.numel() for t in self.extras)
        self.reply_bufs = [end.links.empty(HEADER + numel + extra) for _ in range(num_workers)]
        self.grad_sum = torch.zeros(numel, device=end.links.device)
        for t in params:
            t.grad = torch.zeros_like(t)

    # -- one training-loop step -------------------------------------------------------------
    def serve(self, step: int, last: bool) -> float:
        """Serve until every live worker's push for ``step`` is applied and answered."""
        target = step + 1
        if self.mode == "sync":
            loss = self._serve_sync(target)
        else:
            while self.live and self._min_clock() < target:
                self._take_one(target, self._apply_async)
            loss = _mean(self.losses.pop(target, []))
        if last:
            for w in list(self.live):
                self.end.wait_sent(w)
        return loss

    def _serve_sync(self, target: int) -> float:
        arrived: dict[int, torch.Tensor] = {}
        while self.live - set(arrived):
            self._take_one(target, lambda w, msg: arrived.__setitem__(w, msg))
        ws = sorted(w for w in arrived if w in self.live)
        self._keep_extras(ws[0], arrived[ws[0]])
        losses = [float(arrived[w][2]) for w in ws]
        loss = _mean(losses)
        skip = any(_nonfinite(arrived[w]) for w in ws)   # the same verdict on every ps task
        if self.scaler is not None:
            self.scaler.update(skip)
        if skip:  # fp16 overflow on some worker: no update anywhere (module docstring)
            for w in ws:
                self.dropped[w] += 1
                self.skip_flags[w] = 1.0
                self._answer(w, loss)
            return loss
        self.grad_sum.zero_()
        for w in ws:  # fixed order: the sum is the same whatever order the pushes came in
            self.grad_sum += self._grad_of(arrived[w])
        self.grad_sum /= len(ws)
        if self.clip > 0:
            self._clip(self.grad_sum)
        for w in ws:
            self._record(w, int(arrived[w][0]), int(arrived[w][1]))
        self._step(self.grad_sum)
        for w in ws:
            self.skip_flags[w] = 0.0
            self._answer(w, loss)
        return loss

    # -- messages -----------------------------------------------------------------------------
    def _take_one(self, target: int, handle) -> None:
        """Wait for the next push (or failure) and hand a push to ``handle(w, msg)``."""
        try:
            w, msg, err = self.end.take(self.timeout)
        except queue.Empty:
            waiting = [w for w in sorted(self.live) if self.clocks[w] < target]
            self._fail(waiting, f"no gradient for step {target - 1} within {self.timeout:.0f} s")
            return
        if err is not None:
            self._fail([w], f"link broke ({err})")
        elif w in self.live:
            self.clocks[w] = int(msg[0])
            handle(w, msg)

    def _apply_async(self, w: int, msg: torch.Tensor) -> None:
        clock, pulled, loss = int(msg[0]), int(msg[1]), float(msg[2])
        self.losses.setdefault(clock, []).append(loss)
        bad = _nonfinite(msg)
        if self.scaler is not None:
            self.scaler.update_worker(w, bad)
        self.skip_flags[w] = float(bad)
        if bad:  # fp16 overflow: drop the whole push (gradients and buffers); w halves its scale
            self.dropped[w] += 1
        else:
            self._record(w, clock, pulled)
            self._keep_extras(w, msg)
            self.grad_sum.copy_(self._grad_of(msg)).div_(self.num_workers)
            self._step(self.grad_sum)
        self.deferred.add(w)
        self._release()

    def _release(self) -> None:
        """Answer every held worker the ssp bound allows (async: all of them)."""
        if not self.live:
            return
        low = self._min_clock()
        bound = math.inf if self.mode == "async" else self.staleness
        for w in sorted(self.deferred):
            if self.clocks[w] - low <= bound:
                self.deferred.discard(w)
                self._answer(w, math.nan)

    def _answer(self, w: int, loss: float) -> None:
        self.end.wait_sent(w)  # the reply buffer is free again
        buf = pack((self.version, loss, self.skip_flags[w], 0.0), self.params + self.extras,
                   self.reply_bufs[w])
        self.end.reply(w, buf)
        low = self._min_clock()
        self.releases.append({"worker": w, "clock": self.clocks[w], "min_clock": low,
                              "version": self.version})
        self.bound_max = max(self.bound_max, self.clocks[w] - low)

    def _record(self, w: int, clock: int, pulled: int) -> None:
        self.applied[w] += 1
        stale = self.version - pulled
        self.records.append({"worker": w, "clock": clock, "pulled": pulled,
                             "staleness": stale, "min_clock": self._min_clock()})
        self.staleness_max = max(self.staleness_max, stale)
        self.staleness_sum += stale

    def _grad_of(self, msg: torch.Tensor) -> torch.Tensor:
        return msg[HEADER:HEADER + self.numel]

    @torch.no_grad()
    def _keep_extras(self, w: int, msg: torch.Tensor) -> None:
        """ps 0: keep the buffers of the lowest live worker (worker 0 while it lives)."""
        if self.extras and w == min(self.live):
            unpack(msg, self.extras, offset=HEADER + self.numel)

    def _clip(self, grad: torch.Tensor) -> None:
        """Scale the averaged gradient to global L2 norm <= clip (norm over every ps's shard)."""
        sq = torch.linalg.vector_norm(grad, 2, dtype=torch.float32).square().reshape(1)
        if self.servers is not None:
            self.end.comm.all_reduce(sq, self.servers, name="ps_grad_norm")
        coef = torch.clamp(self.clip / (sq[0].sqrt() + 1e-6), max=1.0)
        grad.mul_(coef)

    def _step(self, flat_grad: torch.Tensor) -> None:
        """One optimizer step on this task's parameters with ``flat_grad`` as their gradient."""
        unpack(flat_grad, [t.grad for t in self.params], offset=0)
        self.optimizer.step()
        self.version += 1

    def _min_clock(self) -> int:
        return min((self.clocks[w] for w in self.live), default=0)

    # -- failures -----------------------------------------------------------------------------
    def _fail(self, workers: list[int], why: str) -> None:
        names = ", ".join(task_name(self.num_ps + w, self.num_ps) for w in workers)
        me = task_name(self.end.j, self.num_ps)
        if self.stop_on_failure:
            raise RuntimeError(f"{me}: worker {names} failed: {why}; stopping the job "
                               "(parallel.on_worker_failure=stop; 'continue' goes on without it)")
        for w in workers:
            self.live.discard(w)
            self.deferred.discard(w)
            self.failed[w] = why
        print(f"[shardwise {me}] worker {names} failed: {why}; continuing with "
              f"{len(self.live)} worker(s)", file=sys.stderr, flush=True)
        if not self.live:
            raise RuntimeError(f"{me}: every worker has failed (last: {names}: {why})")
        self._release()

    def stats(self) -> dict:
        """What happened on this ps task: per-gradient records and answers (the newest
        KEEP_RECORDS), counts, staleness over the whole run, failures."""
        applied = sum(self.applied)
        return {"task": task_name(self.end.j, self.num_ps), "version": self.version,
                "applied": list(self.applied), "dropped": list(self.dropped),
                "clocks": list(self.clocks),
                "records": list(self.records), "releases": list(self.releases),
                "staleness_max": self.staleness_max,
                "staleness_mean": self.staleness_sum / applied if applied else 0.0,
                "clock_lead_max": self.bound_max,
                "failed": {task_name(self.num_ps + w, self.num_ps): why
                           for w, why in self.failed.items()}}


def _nonfinite(msg: torch.Tensor) -> bool:
    """The push header's verdict: the worker saw an inf / nan in its gradients (fp16)."""
    return bool(msg[3] != 0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
