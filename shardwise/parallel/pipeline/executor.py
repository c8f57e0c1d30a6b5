"""Run one stage's part of a pipeline schedule for one step, recording when each action ran.

The executor walks its stage's actions (schedule.steps groups consecutive transfers into one
batch, posted together through comm/p2p.py). F i: forward of micro-batch i on the received
activation (or the token ids on the first stage); on the last stage also the loss, scaled by
``loss_scale`` (1/m: the step's loss is the mean over micro-batches, as in single training).
B i: backward from the loss (last stage) or from the received output gradient; the input's
gradient is what SEND_B sends back. Activations of micro-batch i are dropped after B i, and the
number of micro-batches held at once is recorded (its peak is GPipe's m or 1F1B's p - s).

Sends do not block: their Works stay in flight while the stage computes the next action and
are waited at the end of the step (comm/p2p.py); receives are waited before the action that
uses them.

Records: ``(op, mb, t0, t1)`` per action with wall-clock times (time.time(), comparable between
processes of one host), for timeline.py.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm, Group
from shardwise.comm.p2p import ACT, GRAD, P2POp, exchange
from shardwise.parallel.pipeline.schedule import Action, steps


@dataclass
class StepRecord:
    """What one stage did in one step."""
    stage: int
    records: list = field(default_factory=list)   # (op, mb, t0, t1)
    peak_in_flight: int = 0


class PipelineExecutor:
    """Runs schedules for one stage module; ``act_shape`` is a micro-batch's (b, T, C)."""

    def __init__(self, stage: nn.Module, comm: Comm, pp_group: Group, loss_fn, device,
                 autocast=contextlib.nullcontext):
        self.stage, self.comm, self.group = stage, comm, pp_group
        self.autocast = autocast    # mixed precision: the stage runs under it, activations go fp32
        self.loss_fn, self.device = loss_fn, device
        self.index, self.num_stages = pp_group.rank, pp_group.size
        self.is_first, self.is_last = self.index == 0, self.index == self.num_stages - 1

    def run(self, actions: list[Action], xs: list[torch.Tensor], ys: list[torch.Tensor],
            act_shape: tuple, loss_scale: float, on_backward=None) -> tuple[torch.Tensor, StepRecord]:
        """One step of the schedule; returns (sum of scaled micro-batch losses, the record).
        The loss is only meaningful on the last stage (zero elsewhere). ``on_backward(mb,
        last)``, when given, runs before each micro-batch's backward (``last``: this stage's
        final backward of the step; data parallelism reduces during that one)."""
        self._xs, self._ys, self._shape, self._scale = xs, ys, act_shape, loss_scale
        backwards = [a.mb for a in actions if a.op == "B"]
        self._last_b = backwards[-1] if backwards else None
        self._on_backward = on_backward
        self._inputs: dict[int, torch.Tensor] = {}     # received activations (need their grad)
        self._outputs: dict[int, torch.Tensor] = {}    # stage outputs (or scaled losses)
        self._grads: dict[int, torch.Tensor] = {}      # received output gradients
        self._loss = torch.zeros((), device=self.device)
        self._in_flight: list = []                     # sends still draining (work, tensor)
        rec = StepRecord(self.index)
        for step in steps(actions):
            t0 = time.time()
            if step[0].op in ("F", "B"):
                getattr(self, "_" + step[0].op)(step[0].mb)
                rec.peak_in_flight = max(rec.peak_in_flight, len(self._outputs))
            else:
                self._transfer(step)
            rec.records.append(("+".join(a.op for a in step), step[0].mb, t0, time.time()))
        for work, _ in self._in_flight:                # the step's sends have all arrived
            work.wait()
        self._in_flight.clear()
        return self._loss, rec

    def _F(self, i: int) -> None:
        if self.is_first:
            x = self._xs[i].to(self.device)                 # (b, T) token ids
        else:
            x = self._inputs[i]                              # (b, T, C), requires grad
        with self.autocast():
            out = self.stage(x).float()                      # fp32 on the wire and into the loss
        if self.is_last:
            out = self.loss_fn(out, self._ys[i].to(self.device)) * self._scale
            self._loss += out.detach()
        self._outputs[i] = out

    def _B(self, i: int) -> None:
        if self._on_backward is not None:
            self._on_backward(i, i == self._last_b)
        out = self._outputs.pop(i)
        if self.is_last:
            out.backward()
        else:
            out.backward(self._grads.pop(i))

    def _transfer(self, batch: list[Action]) -> None:
        ops = []
        for a in batch:
            if a.op == "SEND_F":
                ops.append(P2POp("send", self._outputs[a.mb].detach(), self.index + 1, ACT))
            elif a.op == "SEND_B":
                x = self._inputs.pop(a.mb)
                ops.append(P2POp("send", x.grad, self.index - 1, GRAD))
            elif a.op == "RECV_F":
                buf = torch.empty(self._shape, device=self.device)
                self._inputs[a.mb] = buf
                ops.append(P2POp("recv", buf, self.index - 1, ACT))
            else:  # RECV_B
                buf = torch.empty(self._shape, device=self.device)
                self._grads[a.mb] = buf
                ops.append(P2POp("recv", buf, self.index + 1, GRAD))
        # receives are waited (the next action computes on them); sends drain while it does
        self._in_flight += exchange(self.comm, self.group, ops, wait_sends=False)
        for a in batch:
            if a.op == "RECV_F":
                self._inputs[a.mb].requires_grad_(True)
