"""Pipeline point-to-point traffic: activations forward, their gradients backward, through Comm.

A pipeline step posts a *batch* of sends and receives together (Megatron's
``send_forward_recv_backward``): every operation of the batch is launched asynchronously, then
all are waited. Posting a stage's send and its receive at once is what lets 1F1B's steady state
run without deadlock: stage s sends activation k to s+1 while s+1 sends gradient j back to s.

Between two neighbouring stages each direction carries one kind of tensor (activations go
down, gradients come up), and messages in one direction are matched in the order posted, so a
schedule whose k-th send matches the peer's k-th receive (the schedule checker proves it) needs
no tags. Metered under ``pp_act`` (activations) and ``pp_grad`` (gradients).

Overlap: a stage waits for what it receives (it computes on it next) but need not wait for what
it sends; the executor leaves its sends in flight (``wait_sends=False``) and computes the next
action while they drain, waiting for them all at the end of the step.

NCCL: separate ``isend`` / ``irecv`` calls to one peer share that pair's communicator and
stream, so two stages that each post a receive before their send wait for each other forever.
On an NCCL group a batch is therefore launched as one
``torch.distributed.batch_isend_irecv`` (NCCL groups the calls: ``ncclGroupStart/End``), whose
Works complete together: every op of the batch waits on them all (on CUDA a wait only orders
the current stream after the transfer; the host does not block). Gloo keeps one isend / irecv
per op, in the order given, so its behaviour and its tests are unchanged. ``post`` is that
launcher; the ring (comm/ring.py) uses it too.
"""
from __future__ import annotations

from dataclasses import dataclass

import time

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, Group, Work

ACT, GRAD = "pp_act", "pp_grad"


@dataclass
class P2POp:
    """One half of a transfer: send ``tensor`` to, or receive into it from, pp member ``peer``."""
    kind: str             # "send" or "recv"
    tensor: torch.Tensor
    peer: int             # index in the pipeline group
    name: str = ACT       # meter name: ACT or GRAD


def grouped(group: Group, tensors: list[torch.Tensor]) -> bool:
    """Whether a batch on ``group`` must be launched as one grouped call: on NCCL. A gloo group
    posts op by op through Comm, also for CUDA tensors (which Comm stages through host memory:
    gloo aborts on device memory)."""
    return group.pg is not None and dist.get_backend(group.pg) == "nccl"


class _Batch:
    """The Works of one grouped launch; waiting for any op of the batch waits for them all."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> None:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        self.works = []


def post(comm: Comm, group: Group, ops: list[P2POp], transport=None) -> list[Work]:
    """Launch every op of the batch (contiguous tensors only: a receive fills its own tensor);
    one Work per op, in order, each metered under its op's name. ``transport``: a
    comm/shm_p2p.ShmP2P for ``group`` (shared memory between the stages of one host), which
    then carries every op."""
    for op in ops:
        if op.peer == group.rank:
            raise ValueError(f"pipeline {op.kind} to itself (member {op.peer})")
        if not op.tensor.is_contiguous():
            raise ValueError(f"p2p {op.kind}: tensor not contiguous")
    if transport is not None:
        return [transport.post(op.kind, op.tensor, op.peer, op.name) for op in ops]
    if not grouped(group, [op.tensor for op in ops]):
        return [comm.isend(op.tensor, op.peer, group, name=op.name) if op.kind == "send" else
                comm.irecv(op.tensor, op.peer, group, name=op.name) for op in ops]
    t0 = time.perf_counter()
    batch = _Batch(dist.batch_isend_irecv([
        dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor,
                   group.global_rank(op.peer), group.pg) for op in ops]))
    seconds = (time.perf_counter() - t0) / max(1, len(ops))
    works = []
    for op in ops:
        k = op.tensor.numel() * op.tensor.element_size()
        comm.meter.record(op.name, k if op.kind == "send" else 0, k if op.kind == "recv" else 0,
                          seconds)
        works.append(Work(batch, comm.meter, op.name,
                          timeout=comm.wait_timeout(group, op.tensor.device)))
    return works


def exchange(comm: Comm, group: Group, ops: list[P2POp], wait_sends: bool = True,
             transport=None) -> list:
    """Launch every op of the batch, then wait for its receives (filled on return) and, unless
    ``wait_sends`` is False, its sends. With ``wait_sends=False`` the sends' Works are returned
    still in flight: the caller computes while they drain and waits for them (keeping their
    tensors alive) before the step ends."""
    ops = [op if op.kind == "recv" or op.tensor.is_contiguous() else
           P2POp(op.kind, op.tensor.contiguous(), op.peer, op.name) for op in ops]
    launched = list(zip(ops, post(comm, group, ops, transport)))
    for op, w in launched:
        if op.kind == "recv":
            w.wait()
    sends = [(w, op.tensor) for op, w in launched if op.kind == "send"]
    if wait_sends:
        for w, _ in sends:
            w.wait()
        return []
    return sends


def send(comm: Comm, group: Group, t: torch.Tensor, peer: int, name: str = ACT,
         transport=None) -> None:
    """Blocking send of one tensor to a neighbouring stage."""
    exchange(comm, group, [P2POp("send", t, peer, name)], transport=transport)


def recv(comm: Comm, group: Group, shape, peer: int, dtype=torch.float32, device="cpu",
         name: str = ACT, transport=None) -> torch.Tensor:
    """Blocking receive of one tensor of ``shape`` from a neighbouring stage."""
    t = torch.empty(shape, dtype=dtype, device=device)
    exchange(comm, group, [P2POp("recv", t, peer, name)], transport=transport)
    return t
