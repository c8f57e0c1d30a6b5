"""Pipeline sends through shared memory (comm/shm_p2p.py): messages arrive whole and in order,
also when larger than the ring (streamed) and when both members send before they receive (no
deadlock); a receive whose sender never comes fails at the timeout naming it; ``auto`` takes the
rings only with polling ranks on one host, and ``exchange`` routes through them."""
import datetime

import pytest
import torch

from harness import run_world
from shardwise.comm import p2p, shm_p2p
from shardwise.comm.collectives import CollectiveError, Comm
from shardwise.comm.p2p import P2POp
from shardwise.mesh import Mesh

pytestmark = pytest.mark.timeout(180)


def _msg(src: int, k: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (k + 1) + 1000 * src


def _traffic(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=60))
    t = shm_p2p.ShmP2P(comm, group, capacity=4096, pairs=shm_p2p.neighbours(n))
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = []
    # each member first sends three messages (one 10x the ring) to the next, then receives the
    # previous member's: every send can only finish while the sender waits for its receives
    sizes = (100, 10_240, 7)
    sends = [t.post("send", _msg(rank, k, m), nxt, "pp_act") for k, m in enumerate(sizes)]
    for k, m in enumerate(sizes):
        buf = torch.empty(m)
        t.wait_for(t.post("recv", buf, prv, "pp_act"))
        got.append(torch.equal(buf, _msg(prv, k, m)))
    for s in sends:
        s.wait()
    # through exchange, as the executor posts: a send down and a receive up in one batch
    down, up = torch.full((3, 5), float(rank)), torch.empty(3, 5)
    works = p2p.exchange(comm, group, [P2POp("send", down, nxt), P2POp("recv", up, prv)],
                         wait_sends=False, transport=t)
    for w, _ in works:
        w.wait()
    got.append(torch.equal(up, torch.full((3, 5), float(prv))))
    return got, comm.meter.snapshot()["pp_act"]


@pytest.mark.parametrize("world", [2, 3])
def test_messages_arrive_whole_in_order_also_larger_than_the_ring(world):
    for got, meter in run_world(_traffic, world, timeout=120):
        assert got == [True] * 4
        k = (100 + 10_240 + 7 + 15) * 4
        assert meter["bytes_sent"] == k and meter["bytes_recv"] == k


def _sender_never_comes(rank, n):
    group = Mesh.build(1, n, 1).world
    comm = Comm(timeout=datetime.timedelta(seconds=2))
    t = shm_p2p.ShmP2P(comm, group)
    if rank == 0:
        return "stayed away"
    try:
        p2p.recv(comm, group, (4,), 0, name="pp_grad", transport=t)
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_a_receive_whose_sender_never_comes_fails_at_the_timeout():
    msg = run_world(_sender_never_comes, 2, timeout=60)[1]
    assert msg.startswith("pp_grad:") and "pipeline member 0" in msg and "2 s" in msg


def _choices(rank, n):
    group = Mesh.build(1, n, 1).world
    out = {}
    for kind, spin in (("auto", True), ("auto", False), ("native", True), ("shm", False)):
        t = shm_p2p.transport_for(Comm(spin=spin), group, torch.device("cpu"), kind)
        out[(kind, spin)] = t is not None
    return out


def test_auto_takes_the_rings_only_with_polling_ranks():
    out = run_world(_choices, 2, timeout=60)[0]
    assert out == {("auto", True): True, ("auto", False): False, ("native", True): False,
                   ("shm", False): True}
    with pytest.raises(ValueError, match="pp_transport 'fast'"):
        shm_p2p.transport_for(Comm(), Mesh.build(1, 1, 1).world, torch.device("cpu"), "fast")


def test_neighbours_are_the_pipeline_pairs():
    assert shm_p2p.neighbours(2) == [(0, 1), (1, 0)]
    assert shm_p2p.neighbours(3) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert shm_p2p.neighbours(4) == [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (2, 3), (3, 0),
                                     (3, 2)]


def test_the_pipeline_sizes_its_rings_to_two_activations():
    """ring_bytes: two messages (a send need not wait for the one before to be taken), at least
    64 KiB, at most CAPACITY (larger messages stream: the test above), whole pages; the bench
    pipeline's 256 KiB activations get 512 KiB rings instead of 4 MiB ones."""
    assert shm_p2p.ring_bytes(256 << 10) == 512 << 10
    assert shm_p2p.ring_bytes(1) == 64 << 10
    assert shm_p2p.ring_bytes(100 << 20) == shm_p2p.CAPACITY
    assert shm_p2p.ring_bytes(100_001) % 4096 == 0 and shm_p2p.ring_bytes(100_001) >= 200_002
