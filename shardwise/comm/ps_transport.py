"""Parameter-server transport: task names, the byte-balanced parameter split, and point-to-point
links between each ps task and each worker, over torch.distributed gloo groups (in a CUDA /
NCCL run too: see "Backend and device of the links" below).

Why point-to-point and not ``torch.distributed.rpc``: the RPC package has had no real development
for years (TensorPipe is archived) and does not run on every build; the ps protocol needs only
"push a flat gradient, get flat parameters back", which is two send/recv pairs per (ps, worker).

Why one 2-rank process group per (ps task, worker, direction): measured on gloo (torch 2.13),
``Work.is_completed()`` of an ``irecv`` never turns true until ``wait()`` is called, and a
``wait(timeout)`` that times out closes that group's connection for good. So a ps cannot poll
several workers on one group, nor retry after a timeout. With its own group per link, one
receiver thread per worker blocks on that worker's link only; a dead or hung worker poisons its
own link and nothing else; the ps main thread takes messages from a queue with a Python deadline
(a worker that dies is seen at once, when its connection closes; one that hangs, at the deadline).
Each direction has its own group so a thread's receive and the main thread's send never share one.

Messages are flat fp32 tensors ``[header | payload]``:
    push (worker -> ps j)  header = (clock, version pulled, loss, nonfinite)
                           payload = grads of j's params (unscaled: already divided by the
                           worker's fp16 loss scale); nonfinite = 1.0 when any of the worker's
                           gradients, over the whole model, is inf / nan (fp16 only; else 0)
    pull (ps j -> worker)  header = (version, mean loss of the step, skipped, 0)
                           payload = j's params; skipped = 1.0 when the ps did not apply this
                           worker's push (fp16 overflow: the worker halves its loss scale)
Metered under the op names ``ps_push`` and ``ps_pull`` (exact bytes, both ends).

Backend and device of the links (``link_plan``): always gloo, on CPU tensors, whatever the
world's backend and the training device. Under NCCL (a CUDA run) each link is a gloo side group
created collectively like the rest (every rank, one order); the messages are packed from the
GPU into host buffers and unpacked back (``pack`` / ``unpack`` copy across devices), and the
world's own collectives (start-up broadcast, evaluation, gathers) stay on NCCL. Why not the
links on NCCL: a receiver thread's NCCL ``irecv().wait()`` does not block the host (it only
orders a CUDA stream), so the thread would post every receive of the run at once into one
buffer and hand the ps messages not yet arrived; 2PW communicators driven from several
threads, in a different order on each rank, is the concurrent use NCCL's documentation warns can
deadlock the GPU; and a hung or dead peer on NCCL takes the process down (the watchdog) instead
of failing one link. Gloo's receive blocks the
host until the bytes are there, which is what the receiver threads and the failure handling
above are built on (the CPU path, tested). Cost under CUDA: one device-to-host copy per message
sent and one host-to-device copy per message received, and the traffic goes through host memory
and TCP instead of NVLink: the ps moves about K bytes per worker per step either way.
"""
from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, Group

HEADER = 4


LINK_BACKEND = "gloo"
"""The backend of every ps link (and of the ps tasks' own group): see the module docstring."""


def link_plan(device: torch.device, world_backend: str) -> tuple[str, torch.device]:
    """(backend of the ps links, device of their messages) for a rank training on ``device`` in
    a world on ``world_backend``: gloo on CPU in every case, NCCL / CUDA included (module
    docstring: a receive must complete on the host before its buffer is read and reused)."""
    return LINK_BACKEND, torch.device("cpu")


def task_name(rank: int, num_ps: int) -> str:
    """TensorFlow-style task name of a global rank: /job:ps/task:i or /job:worker/task:j."""
    return f"/job:ps/task:{rank}" if rank < num_ps else f"/job:worker/task:{rank - num_ps}"


def partition_by_bytes(sizes: list[int], num_ps: int) -> list[list[int]]:
    """Greedy by tensor: largest first, each to the least-loaded ps. Returns indices per ps,
    each list in the original (model) order, so every rank packs tensors identically."""
    loads, owned = [0] * num_ps, [[] for _ in range(num_ps)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(num_ps), key=lambda j: (loads[j], j))
        loads[j] += sizes[i]
        owned[j].append(i)
    return [sorted(o) for o in owned]


@torch.no_grad()
def pack(header: tuple[float, ...], tensors, out: torch.Tensor) -> torch.Tensor:
    """Write ``header`` then every tensor (flattened, None = zeros) into the flat ``out``.

    Without autograd: a ps task packs its parameters (leaves that require grad) into a reused
    reply buffer, and an in-place copy under autograd would chain a new CopySlices node onto
    that buffer's history every step, keeping each step's copy alive (the soak's ps leak, about
    one message per worker per step)."""
    out[:HEADER] = torch.tensor(header, dtype=out.dtype)
    pos = HEADER
    for t in tensors:
        n = t.numel()
        out[pos:pos + n].copy_(t.reshape(-1))
        pos += n
    return out


@torch.no_grad()
def unpack(flat: torch.Tensor, tensors, offset: int = HEADER) -> None:
    """Copy ``flat`` from ``offset`` on back into ``tensors`` (in place, same order as pack)."""
    pos = offset
    for t in tensors:
        n = t.numel()
        t.copy_(flat[pos:pos + n].view_as(t))
        pos += n


class LinkLost(RuntimeError):
    """A peer did not answer within its deadline, or its connection broke."""


class Links:
    """The (ps j, worker w) push and pull groups; every rank builds all of them, in one order."""

    def __init__(self, num_ps: int, num_workers: int, rank: int, servers_group: bool = False,
                 device: torch.device = torch.device("cpu")):
        self.num_ps, self.num_workers, self.rank = num_ps, num_workers, rank
        # gloo groups, CPU messages, whatever the world's backend (link_plan)
        backend, self.device = link_plan(device, dist.get_backend())
        self.push, self.pull = {}, {}
        for j in range(num_ps):
            for w in range(num_workers):
                members = [j, num_ps + w]
                for table in (self.push, self.pull):
                    # collective over the world: all ranks call it, in this order
                    pg = dist.new_group(members, backend=backend)
                    if rank in members:
                        table[(j, w)] = pg
        # the ps tasks among themselves (global gradient norm, summed from the CPU messages);
        # None on workers
        self.servers = None
        if servers_group and num_ps > 1:
            pg = dist.new_group(list(range(num_ps)), backend=backend)
            if rank < num_ps:
                self.servers = Group(pg, tuple(range(num_ps)), rank)
        elif servers_group and rank == 0:
            self.servers = Group.solo(0)

    def empty(self, numel: int) -> torch.Tensor:
        """A flat fp32 message buffer on the links' device (CPU)."""
        return torch.empty(numel, device=self.device)

    def peer(self, j: int, w: int) -> int:
        """Global rank at the other end of link (j, w) from this rank."""
        return self.num_ps + w if self.rank == j else j


def _wait(work, seconds: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:
        raise LinkLost(f"{what}: {exc}") from None


class WorkerEnd:
    """A worker's side: push to every ps, then wait for every ps's parameters."""

    def __init__(self, links: Links, comm: Comm, w: int, timeout: float):
        self.links, self.comm, self.w, self.timeout = links, comm, w, timeout
        self.sends = {}

    def push(self, j: int, msg: torch.Tensor) -> None:
        self.wait_pushed(j)
        self.sends[j] = dist.isend(msg, j, group=self.links.push[(j, self.w)])
        self.comm.meter.record("ps_push", msg.numel() * 4, 0)

    def wait_pushed(self, j: int) -> None:
        """Block until the previous push to ps j has left (its buffer may then be rewritten)."""
        if j in self.sends:
            _wait(self.sends.pop(j), self.timeout, f"push to {task_name(j, self.links.num_ps)}")

    def pull(self, j: int, buf: torch.Tensor) -> None:
        work = dist.irecv(buf, j, group=self.links.pull[(j, self.w)])
        _wait(work, self.timeout, f"no parameters from {task_name(j, self.links.num_ps)} "
              f"within {self.timeout:.0f} s")
        self.comm.meter.record("ps_pull", 0, buf.numel() * 4)

    def close(self) -> None:
        for j, work in self.sends.items():
            _wait(work, self.timeout, f"push to {task_name(j, self.links.num_ps)}")
        self.sends.clear()


class ServerEnd:
    """A ps task's side: one receiver thread per worker feeding a queue; replies from the caller.

    Each worker has one push buffer: it sends its next gradient only after the ps has replied to
    the previous one, and the ps replies only after applying it, so the buffer is never reused
    while still needed.
    """

    def __init__(self, links: Links, comm: Comm, j: int, msg_numel: int, messages: int,
                 timeout: float):
        self.links, self.comm, self.j, self.timeout = links, comm, j, timeout
        self.inbox: queue.Queue = queue.Queue()
        self.bufs = [links.empty(msg_numel) for _ in range(links.num_workers)]
        self.sends = {}
        for w in range(links.num_workers):
            threading.Thread(target=self._receive, args=(w, messages), daemon=True).start()

    def _receive(self, w: int, messages: int) -> None:
        pg, src = self.links.push[(self.j, w)], self.links.num_ps + w
        try:
            for _ in range(messages):
                # no deadline here: the worker may be held legitimately (sync, ssp) for as long
                # as the ps waits on someone else; the ps main thread owns the deadlines
                dist.irecv(self.bufs[w], src, group=pg).wait()
                self.inbox.put((w, self.bufs[w], None))
        except Exception as exc:  # a dead worker's link breaks: report it, end this link only
            self.inbox.put((w, None, exc))

    def take(self, seconds: float):
        """(worker, message, error) of the next arrival; raises queue.Empty after ``seconds``."""
        w, msg, err = self.inbox.get(timeout=seconds)
        if msg is not None:
            self.comm.meter.record("ps_push", 0, msg.numel() * 4)
        return w, msg, err

    def reply(self, w: int, msg: torch.Tensor) -> None:
        """Send ``msg`` to worker w (the caller must not touch ``msg`` until the next reply)."""
        self.wait_sent(w)
        self.sends[w] = dist.isend(msg, self.links.num_ps + w, group=self.links.pull[(self.j, w)])
        self.comm.meter.record("ps_pull", msg.numel() * 4, 0)

    def wait_sent(self, w: int) -> None:
        if w in self.sends:
            _wait(self.sends.pop(w), self.timeout, f"reply to /job:worker/task:{w}")
