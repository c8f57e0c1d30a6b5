"""Ring allreduce from point-to-point sends and receives: scatter-reduce, then allgather.

The N ranks of a group form a logical ring; each sends only to its right neighbour
(index + 1 mod N) and receives only from its left (index - 1 mod N). The tensor is cut into N
chunks of about K/N elements (``torch.tensor_split``: any size, sizes differ by at most one).

* scatter-reduce, N-1 steps: at step s rank r sends chunk (r - s - 1) mod N and receives chunk
  (r - s - 2) mod N, which it adds into its own copy. After N-1 steps rank r holds the fully
  reduced chunk r (the ownership a reduce-scatter promises).
* allgather, N-1 steps: at step s rank r sends chunk (r - s) mod N and receives chunk
  (r - s - 1) mod N, overwriting its copy. Afterwards every rank holds every reduced chunk.

Traffic per rank: 2(N-1) chunks of K/N elements each way = 2(N-1)/N * K bytes, constant in N
(the ring-allreduce bound, Patarasuk & Yuan 2009). The meter records the bytes that really
moved (isend / irecv), under the operation name given (default ``ring_all_reduce``). World
size 1: no-op.

Each step posts its receive and its send together and waits for both, so neighbours never
block on each other. They are posted through comm/p2p.py's ``post``: on NCCL as one grouped
``batch_isend_irecv`` (at N = 2 the left and the right neighbour are the same rank, and
separate isend / irecv to one peer can deadlock there), on gloo one isend / irecv each. Every rank ends with bit-identical results (the allgather copies one
reduced value), but the summation order differs from the backend's allreduce: compare with
an fp32 tolerance (rtol 1e-5), not bitwise.
"""
from __future__ import annotations

import concurrent.futures as cf

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm, Group, Work
from shardwise.comm.p2p import P2POp, post


def _exchange(comm: Comm, send: torch.Tensor, recv: torch.Tensor, group: Group, name: str) -> None:
    """Send ``send`` right and receive ``recv`` from the left, concurrently."""
    n, r = group.size, group.rank
    rw, sw = post(comm, group, [P2POp("recv", recv, (r - 1) % n, name),
                                P2POp("send", send, (r + 1) % n, name)])
    sw.wait()
    rw.wait()


def _scatter_reduce(comm: Comm, chunks: list[torch.Tensor], group: Group, name: str) -> None:
    """In place: afterwards chunks[group.rank] holds the sum over the group of that chunk.

    Each step is pipelined in ``PIECES`` pieces: all of a step's receives and sends are posted
    at once and each piece is added as soon as it lands, so the additions overlap the transfer
    of the pieces behind them. The receive scratch is the Comm's reusable buffer (fresh
    allocations are slow on CPU).
    """
    n, r = group.size, group.rank
    # chunk 0 is the largest (tensor_split puts the extra elements first)
    scratch = comm.scratch("ring", chunks[0].numel(), chunks[0].dtype, chunks[0].device)
    for s in range(n - 1):
        out_c, in_c = (r - s - 1) % n, (r - s - 2) % n
        dst = chunks[in_c]
        buf = scratch[: dst.numel()]
        into = list(zip(_pieces(buf), _pieces(dst)))
        outs = _pieces(chunks[out_c])
        works = post(comm, group, [P2POp("recv", b, (r - 1) % n, name) for b, _ in into]
                     + [P2POp("send", p, (r + 1) % n, name) for p in outs])
        recvs = [(w, b, d) for w, (b, d) in zip(works, into)]
        sends = works[len(into):]
        for work, piece, target in recvs:
            work.wait()
            target.add_(piece)
        for work in sends:
            work.wait()


PIECES = 4


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """Split a 1-D chunk into up to PIECES contiguous pieces (one piece when it is small)."""
    return list(torch.tensor_split(t, PIECES)) if t.numel() >= PIECES * 16384 else [t]


def _all_gather(comm: Comm, chunks: list[torch.Tensor], group: Group, name: str) -> None:
    """In place: afterwards every rank holds every member's chunk (rank r contributes chunks[r])."""
    n, r = group.size, group.rank
    for s in range(n - 1):
        out_c, in_c = (r - s) % n, (r - s - 1) % n
        _exchange(comm, chunks[out_c], chunks[in_c], group, name)


def ring_all_reduce(comm: Comm, t: torch.Tensor, group: Group, op: str = "sum",
                    name: str = "ring_all_reduce") -> None:
    """Sum (or average, op="avg") ``t`` in place over ``group`` with a ring. ``t`` contiguous."""
    n = group.size
    if n == 1:
        return
    flat = t.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    _scatter_reduce(comm, chunks, group, name)
    _all_gather(comm, chunks, group, name)
    if op == "avg":
        t.div_(n)


def ring_reduce_scatter(comm: Comm, out: torch.Tensor, inp: torch.Tensor, group: Group,
                        op: str = "sum", name: str = "ring_reduce_scatter") -> None:
    """``out`` (k elements) = reduction over the group of slice ``rank`` of ``inp`` (N*k elements).

    ``inp`` is used as the workspace and is overwritten.
    """
    n = group.size
    if inp.numel() != n * out.numel():
        raise ValueError(f"ring_reduce_scatter: input has {inp.numel()} elements, expected "
                         f"{n} x {out.numel()}")
    chunks = list(inp.view(-1).view(n, -1).unbind(0))
    if n > 1:
        _scatter_reduce(comm, chunks, group, name)
    out.view(-1).copy_(chunks[group.rank])
    if op == "avg" and n > 1:
        out.div_(n)


def ring_all_gather(comm: Comm, out: torch.Tensor, inp: torch.Tensor, group: Group,
                    name: str = "ring_all_gather") -> None:
    """``out`` (N*k elements) receives every member's ``inp`` (k elements), in rank order."""
    n = group.size
    if out.numel() != n * inp.numel():
        raise ValueError(f"ring_all_gather: output has {out.numel()} elements, expected "
                         f"{n} x {inp.numel()}")
    chunks = list(out.view(-1).view(n, -1).unbind(0))
    chunks[group.rank].copy_(inp.view(-1))
    if n > 1:
        _all_gather(comm, chunks, group, name)


class _FutureWork:
    """Adapts a concurrent.futures.Future to the ``wait()`` of a torch Work."""

    def __init__(self, future: cf.Future):
        self.future = future

    def wait(self, timeout=None) -> None:
        self.future.result(timeout.total_seconds() if timeout is not None else None)


def on_calling_thread(group: Group, tensors: list[torch.Tensor]) -> bool:
    """Whether a ring call on ``group`` must run on the caller's thread: on NCCL (or CUDA data).

    NCCL requires every rank to issue the operations of one communicator in one order. A ring
    posted from a background thread while the caller goes on issuing the group's collectives
    interleaves the two streams of calls differently on each rank: a hang. (A thread would also
    launch on its own current CUDA stream, unordered with the caller's kernels that produced the
    tensor.) On the caller's thread the ring's calls take their place in the one program order
    every rank shares. Its waits order the caller's stream after each transfer (NCCL blocks the
    host too when the wait has a timeout, as the Comm's has), so it overlaps backward less than
    on gloo, but never out of order. Gloo matches sends and receives apart from its collectives:
    there the thread stays.
    """
    if any(t.is_cuda for t in tensors):
        return True
    return group.pg is not None and dist.get_backend(group.pg) == "nccl"


class RingRunner:
    """Runs ring collectives asynchronously, in launch order: on one background thread under
    gloo, on the calling thread under NCCL (``on_calling_thread`` says why).

    On gloo the ring is a sequence of steps that block the host, so to overlap it with backward
    (DDP, ZeRO) it runs on a thread of its own. One thread keeps every rank's ring calls in the
    same order, which point-to-point matching requires; gloo matches its sends and receives
    apart from its collectives, so the caller's collectives on the same group may run meanwhile.
    On NCCL every call is made, in order, by the caller; the Work it returns is already launched
    (its ``wait()`` raises what the ring raised, as a thread's would).
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        # the thread starts at the first call that needs it (never under NCCL)
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-ring")
        self._last: cf.Future | None = None   # the newest call handed to the thread

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum",
                   name: str = "ring_all_reduce") -> Work:
        return self._submit(name, on_calling_thread(group, [t]), ring_all_reduce, self.comm, t,
                            group, op, name)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group, op: str = "sum",
                       name: str = "ring_reduce_scatter") -> Work:
        return self._submit(name, on_calling_thread(group, [out, inp]), ring_reduce_scatter,
                            self.comm, out, inp, group, op, name)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Group,
                   name: str = "ring_all_gather") -> Work:
        return self._submit(name, on_calling_thread(group, [out, inp]), ring_all_gather,
                            self.comm, out, inp, group, name)

    def _submit(self, name: str, inline: bool, fn, *args) -> Work:
        if inline:
            if self._last is not None:  # the thread's earlier calls first: one order everywhere
                cf.wait([self._last])
            future: cf.Future = cf.Future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:    # raised at wait(), as the thread's would be
                future.set_exception(exc)
        else:
            future = self._last = self.pool.submit(fn, *args)
        return Work(_FutureWork(future), self.comm.meter, name, timeout=self.comm.timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
