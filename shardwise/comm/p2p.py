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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm.collectives import Comm, Group

ACT, GRAD = "pp_act", "pp_grad"


@dataclass
class P2POp:
    """One half of a transfer: send ``tensor`` to, or receive into it from, pp member ``peer``."""
    kind: str             # "send" or "recv"
    tensor: torch.Tensor
    peer: int             # index in the pipeline group
    name: str = ACT       # meter name: ACT or GRAD


def exchange(comm: Comm, group: Group, ops: list[P2POp], wait_sends: bool = True) -> list:
    """Launch every op of the batch, then wait for its receives (filled on return) and, unless
    ``wait_sends`` is False, its sends. With ``wait_sends=False`` the sends' Works are returned
    still in flight: the caller computes while they drain and waits for them (keeping their
    tensors alive) before the step ends."""
    works, sends = [], []
    for op in ops:
        if op.peer == group.rank:
            raise ValueError(f"pipeline {op.kind} to itself (member {op.peer})")
        t = op.tensor if op.tensor.is_contiguous() else op.tensor.contiguous()
        if op.kind == "send":
            sends.append((comm.isend(t, op.peer, group, name=op.name), t))
        else:
            works.append(comm.irecv(t, op.peer, group, name=op.name))
    for w in works:
        w.wait()
    if wait_sends:
        for w, _ in sends:
            w.wait()
        return []
    return sends


def send(comm: Comm, group: Group, t: torch.Tensor, peer: int, name: str = ACT) -> None:
    """Blocking send of one tensor to a neighbouring stage."""
    exchange(comm, group, [P2POp("send", t, peer, name)])


def recv(comm: Comm, group: Group, shape, peer: int, dtype=torch.float32, device="cpu",
         name: str = ACT) -> torch.Tensor:
    """Blocking receive of one tensor of ``shape`` from a neighbouring stage."""
    t = torch.empty(shape, dtype=dtype, device=device)
    exchange(comm, group, [P2POp("recv", t, peer, name)])
    return t
