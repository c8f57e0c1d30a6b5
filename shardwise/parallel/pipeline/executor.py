"""Run one stage's part of a pipeline schedule for one step, recording when each action ran.

The executor walks its stage's actions (schedule.steps groups consecutive transfers into one
batch, posted together through comm/p2p.py). It holds one model chunk, or v of them in an
interleaved pipeline (stage.VirtualStages); every action names its chunk, and activations,
gradients and outputs are kept per (chunk, micro-batch). The first chunk of rank 0 reads the
token ids, the last chunk of rank p-1 computes the loss.

F i: forward of micro-batch i on the received activation (or the token ids on the first stage),
with the micro-batch's other inputs (attention mask, positions, labels: stage.split_batch), which
every rank reads from its own copy of the batch; on the last stage also the loss, scaled by ``loss_scale`` (1/m: the step's loss is the mean over
micro-batches, as in single training). B i: backward from the loss (last stage) or from the
received output gradient; the input's gradient is what SEND_B sends back. Activations of
micro-batch i are dropped after B i, and the number of micro-batches held at once is recorded
(its peak is GPipe's m or 1F1B's p - s).

Split backward (a chunk whose actions include W, ZB-H1; parallel/pipeline/split_backward.py):
B i computes only the stage input's gradient, sent upstream at once, keeping the graph and the
gradients at the junctions where the weights' branches meet the input path; W i then runs only
the weights' branches from those junctions, accumulating into ``.grad`` through each weight's
AccumulateGrad (a gradient hook sees the same calls as in an unsplit backward). Neither pass
repeats the other's work. On the first stage (token ids in, nothing to send) B does nothing
and W is the whole backward. Activations stay until W.

Sends do not block: their Works stay in flight while the stage computes the next action and
are waited at the end of the step (comm/p2p.py); receives are waited before the action that
uses them. Between the stages of one CPU host they go through shared memory (``transport``,
comm/shm_p2p.py, ``parallel.pp_transport``), with the same order and the same waits.

Records: ``(op, mb, t0, t1)`` per action with wall-clock times (time.time(), comparable between
processes of one host), and each action's chunk in ``chunks``, for timeline.py. On CUDA the
host returns before the kernels finish, so each action is bracketed by CUDA events instead
(no synchronisation between actions): the step synchronises once at its start (taking the
host time of a reference event) and once at its end, and an action's times are the reference
time plus its events' elapsed time from the reference.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm, Group
from shardwise.comm import p2p
from shardwise.data import batch as batches
from shardwise.comm.p2p import ACT, GRAD, P2POp, exchange
from shardwise.parallel.pipeline.schedule import Action, peer_of, split_chunks, steps
from shardwise.parallel.pipeline.split_backward import SplitBackward


@dataclass
class StepRecord:
    """What one stage did in one step."""
    stage: int
    records: list = field(default_factory=list)   # (op, mb, t0, t1)
    peak_in_flight: int = 0
    chunks: list = field(default_factory=list)    # the chunk of each record


class _Clock:
    """Action times: time.time() on CPU; on CUDA events resolved against a reference event."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self.host0 = time.time()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def now(self):
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, records: list) -> list:
        if not self.cuda:
            return records
        torch.cuda.synchronize()
        at = lambda e: self.host0 + self.ref.elapsed_time(e) / 1000.0
        return [(op, mb, at(t0), at(t1)) for op, mb, t0, t1 in records]


class PipelineExecutor:
    """Runs schedules for one stage module (or the v chunks of a stage.VirtualStages); ``run``'s
    ``width`` is the residual stream's C, so a micro-batch's activation is (b, T, C)."""

    def __init__(self, stage: nn.Module, comm: Comm, pp_group: Group, loss_fn, device,
                 autocast=contextlib.nullcontext, transport=None):
        self.stage, self.comm, self.group = stage, comm, pp_group
        self.transport = transport  # comm/shm_p2p.ShmP2P between stages of one host, or None
        self.chunks = list(stage.chunks) if hasattr(stage, "chunks") else [stage]
        self.autocast = autocast    # mixed precision: the stage runs under it, activations go fp32
        self.loss_fn, self.device = loss_fn, device
        self.index, self.num_stages = pp_group.rank, pp_group.size
        self.is_first, self.is_last = self.index == 0, self.index == self.num_stages - 1

    def _first(self, c: int) -> bool:
        return self.is_first and c == 0

    def _last(self, c: int) -> bool:
        return self.is_last and c == len(self.chunks) - 1

    def split(self, batch) -> tuple[torch.Tensor, dict]:
        """(token ids, other inputs by name) of a micro-batch, on this stage's device."""
        ids, inputs = self.chunks[0].split_batch(batch)
        return ids.to(self.device), batches.to(inputs, self.device)

    def run(self, actions: list[Action], xs: list, ys: list, width: int,
            loss_scale: float, on_backward=None) -> tuple[torch.Tensor, StepRecord]:
        """One step of the schedule over micro-batches ``xs`` (tensors of token ids, or tuples /
        dicts of inputs) and targets ``ys`` (None with the model's own loss); returns (sum of scaled micro-batch losses, the record).
        The loss is only meaningful on the last stage (zero elsewhere). ``on_backward(mb,
        last)``, when given, runs before each action that computes weight gradients (B, or W
        where the backward is split); ``last``: this stage's final one of the step, after which
        every gradient is complete (data parallelism reduces during it). With several chunks
        no single backward completes every gradient: ``last`` is then never true."""
        self._xs = [self.split(x) for x in xs]
        self._ys = [batches.to(y, self.device) for y in ys]
        self._shape = (*self._xs[0][0].shape, width)          # (b, T, C) of every micro-batch
        self._scale = loss_scale
        self._split = split_chunks(actions)
        weights = [a for a in actions if a.op == ("W" if a.chunk in self._split else "B")]
        self._last_w = weights[-1] if weights and len(self.chunks) == 1 else None
        self._on_backward = on_backward
        self._params = {c: list(self.chunks[c].parameters()) for c in self._split}
        self._inputs: dict[tuple, torch.Tensor] = {}   # received activations (need their grad)
        self._outputs: dict[tuple, torch.Tensor] = {}  # stage outputs (or scaled losses)
        self._grads: dict[tuple, torch.Tensor] = {}    # received output gradients
        self._pending: dict[tuple, SplitBackward] = {}  # split: B done, W to come
        self._loss = torch.zeros((), device=self.device)
        self._in_flight: list = []                     # sends still draining (work, tensor)
        rec = StepRecord(self.index)
        clock = _Clock(self.device)
        for step in steps(actions):
            t0, a = clock.now(), step[0]
            if a.op in ("F", "B", "W"):
                getattr(self, "_" + a.op)(a.mb, a.chunk)
                rec.peak_in_flight = max(rec.peak_in_flight, len(self._outputs))
            else:
                self._transfer(step)
            rec.records.append(("+".join(b.op for b in step), a.mb, t0, clock.now()))
            rec.chunks.append(a.chunk)
        for work, _ in self._in_flight:                # the step's sends have all arrived
            work.wait()
        self._in_flight.clear()
        rec.records = clock.resolve(rec.records)
        return self._loss, rec

    def _hook(self, a: Action) -> None:
        if self._on_backward is not None:
            self._on_backward(a.mb, a == self._last_w)

    def _F(self, i: int, c: int) -> None:
        ids, inputs = self._xs[i]
        if self._first(c):
            x = ids                                          # (b, T) token ids
        else:
            x = self._inputs[(c, i)]                         # (b, T, C), requires grad
        with self.autocast():
            out = _fp32(self.chunks[c](x, inputs))     # fp32 on the wire and into the loss
        if self._last(c):
            out = self.loss_fn(out, self._ys[i]) * self._scale
            self._loss += out.detach()
        self._outputs[(c, i)] = out

    def _B(self, i: int, c: int) -> None:
        if c in self._split:
            self._input_grad(i, c)
            return
        self._hook(Action("B", i, c))
        out = self._outputs.pop((c, i))
        if self._last(c):
            out.backward()
        else:
            out.backward(self._grads.pop((c, i)))

    def _input_grad(self, i: int, c: int) -> None:
        """Split B: the input's gradient only (split_backward.py)."""
        grad_out = None if self._last(c) else self._grads.pop((c, i))
        stage_input = None if self._first(c) else self._inputs[(c, i)]
        split = SplitBackward(self._outputs[(c, i)], grad_out, stage_input, self._params[c])
        grad = split.input_grad()
        self._pending[(c, i)] = split
        if stage_input is not None:
            stage_input.grad = grad                          # what SEND_B sends

    def _W(self, i: int, c: int) -> None:
        """Split W: the weights' gradients from the junctions B kept (split_backward.py)."""
        self._hook(Action("W", i, c))
        self._pending.pop((c, i)).weight_grad()
        self._outputs.pop((c, i))

    def _transfer(self, batch: list[Action]) -> None:
        ops, p, v = [], self.num_stages, len(self.chunks)
        for a in batch:
            peer, _ = peer_of(self.index, p, v, a)
            key = (a.chunk, a.mb)
            if a.op == "SEND_F":
                ops.append(P2POp("send", self._outputs[key].detach(), peer, ACT))
            elif a.op == "SEND_B":
                x = self._inputs.pop(key)
                ops.append(P2POp("send", x.grad, peer, GRAD))
            elif a.op == "RECV_F":
                buf = torch.empty(self._shape, device=self.device)
                self._inputs[key] = buf
                ops.append(P2POp("recv", buf, peer, ACT))
            else:  # RECV_B
                buf = torch.empty(self._shape, device=self.device)
                self._grads[key] = buf
                ops.append(P2POp("recv", buf, peer, GRAD))
        # receives are waited (the next action computes on them); sends drain while it does
        self._in_flight += exchange(self.comm, self.group, ops, wait_sends=False,
                                    transport=self.transport)
        for a in batch:
            if a.op == "RECV_F":
                self._inputs[(a.chunk, a.mb)].requires_grad_(True)


def _fp32(out):
    """A stage's output in fp32: the residual stream, the logits, or a Hugging Face model's
    ModelOutput (its plan's last stage) with fp32 logits."""
    if torch.is_tensor(out):
        return out.float()
    out["logits"] = out["logits"].float()
    if out.get("loss") is not None:
        out["loss"] = out["loss"].float()
    return out


@torch.no_grad()
def evaluate_stages(ex: PipelineExecutor, x, width: int):
    """A whole batch (token ids, or a tuple / dict of inputs) forward through the pipeline, no
    schedule: each of this rank's chunks in virtual-stage order, receiving the (B, T, width)
    residual stream from the previous rank and sending to the next (meter ``pp_eval``).
    Returns the last chunk's output: the logits (or ModelOutput) on the last rank. Runs under
    the executor's mixed-precision context, as training does (a ZeRO stage's bf16 working
    weights need it); what crosses stages is fp32."""
    p, out = ex.num_stages, None
    ids, inputs = ex.split(x)
    for c, chunk in enumerate(ex.chunks):
        h = ids if ex._first(c) else p2p.recv(ex.comm, ex.group, (*ids.shape, width),
                                              (ex.index - 1) % p, device=ex.device,
                                              name="pp_eval", transport=ex.transport)
        with ex.autocast():
            out = _fp32(chunk(h, inputs))
        if not ex._last(c):
            p2p.send(ex.comm, ex.group, out, (ex.index + 1) % p, name="pp_eval",
                     transport=ex.transport)
    return out
