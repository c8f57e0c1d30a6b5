"""The parameter server's links under NCCL (issue 31).

On NCCL a receiver thread's ``irecv().wait()`` does not block the host (it only orders a CUDA
stream), so the ps's receiver threads would post every receive at once into one buffer and read
messages that had not arrived. The links therefore always travel over gloo side groups on CPU
tensors, whatever the world's backend and the training device (ps_transport.link_plan); the
world's own collectives stay on the run's device.

No GPU here: a gloo world is told its backend is NCCL (``dist.get_backend`` answers "nccl" in
the forked ranks) and the training device is ``cuda:0`` (a torch.device only: nothing touches
CUDA). The links must still be built as gloo groups on CPU, and carry the ps protocol: a
worker's pushes reach the ps intact, step after step, and the answers come back.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_world
from shardwise.comm.collectives import Comm
from shardwise.comm.ps_transport import HEADER, Links, ServerEnd, WorkerEnd, link_plan, pack

pytestmark = pytest.mark.timeout(120)
CUDA = torch.device("cuda", 0)     # never allocated on: a name for the plan to read
STEPS, PAYLOAD = 3, 5


def test_the_links_of_a_cuda_nccl_run_are_gloo_on_cpu():
    assert link_plan(CUDA, "nccl") == ("gloo", torch.device("cpu"))
    assert link_plan(torch.device("cpu"), "gloo") == ("gloo", torch.device("cpu"))


def _ps_over_fake_nccl(rank, n):
    """1 ps + (n-1) workers; every rank believes the world is NCCL and trains on cuda:0."""
    dist.get_backend = lambda group=None: "nccl"      # this forked rank only
    made = []
    real_new_group = dist.new_group

    def spy(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return real_new_group(*args, **kwargs)

    dist.new_group = spy
    links = Links(1, n - 1, rank, servers_group=True, device=CUDA)
    dist.new_group = real_new_group
    # checked before any buffer is made: a CUDA buffer would fail on this machine
    assert links.device == torch.device("cpu"), f"ps messages on {links.device}"
    assert made and all(b == "gloo" for b in made), f"link groups made with backends {made}"
    comm, numel = Comm(), HEADER + PAYLOAD
    if rank == 0:
        end = ServerEnd(links, comm, 0, numel, STEPS, timeout=30.0)
        got, replies = [], [links.empty(numel) for _ in range(n - 1)]
        for _ in range(STEPS * (n - 1)):   # in arrival order (async: each answered at once)
            w, msg, err = end.take(30.0)
            assert err is None
            got.append((w, msg.clone()))
            pack((int(msg[0]), 0, 0, 0), [msg[HEADER:] * 2], replies[w])  # its clock, 2x
            end.reply(w, replies[w])
        for w in range(n - 1):
            end.wait_sent(w)
        return got
    w = rank - 1
    end = WorkerEnd(links, comm, w, timeout=60.0)
    push, pull, answers = links.empty(numel), links.empty(numel), []
    for step in range(STEPS):
        end.wait_pushed(0)
        end.push(0, pack((step + 1, 0, 0, 0), [torch.full((PAYLOAD,), 10.0 * w + step)], push))
        end.pull(0, pull)
        answers.append(pull.clone())
    end.close()
    return answers


@pytest.mark.parametrize("n", [2, 3])
def test_the_ps_protocol_runs_on_the_links_a_cuda_nccl_run_builds(n):
    results = run_world(_ps_over_fake_nccl, n, timeout=90)
    got = results[0]
    assert len(got) == STEPS * (n - 1)
    for w in range(n - 1):
        mine = [msg for src, msg in got if src == w]
        # every push arrived whole and in order (clock in the header, the payload it carried)
        assert [int(m[0]) for m in mine] == list(range(1, STEPS + 1))
        for step, m in enumerate(mine):
            assert torch.equal(m[HEADER:], torch.full((PAYLOAD,), 10.0 * w + step))
        for step, a in enumerate(results[w + 1]):
            assert int(a[0]) == step + 1
            assert torch.equal(a[HEADER:], torch.full((PAYLOAD,), 2 * (10.0 * w + step)))
