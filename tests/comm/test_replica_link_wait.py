"""ReplicaLink's waits (comm/replicas.py) let a rank's SIGTERM handler run: a rank blocked in the
lane's all-reduce, in receiving a joiner's state, or in building a link, whose peer never comes
leaves within a second of the signal, not at the link's timeout (60 s here). Once torchrun's agent SIGTERMs the
survivors of a group that lost a rank it waits for them, so a blocked one held its torchrun
for the whole timeout (issue 34: about 55 s). The same run checks that the polled waits still
sum and copy state, and that a peer that never comes makes all_reduce_sum return False at the
link's timeout (a short one here) instead of raising.

Two processes on a FileStore (no port), each importing torch: about 5 s on two cores."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

LONG = 60.0        # the link timeout of the waits that are signalled: far above the deadline
SHORT = 1.0        # the link timeout of the one that must return False
DEADLINE = 3.0     # seconds from SIGTERM to the handler having run (polls every millisecond)

# argv: index, store file, folder for the markers. Index 0 waits; index 1 is the peer that
# sums and sends once, then never comes again. Links 0, 1, 2 are built by both in this order.
CHILD = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from shardwise.comm.collectives import CommMeter
from shardwise.comm.replicas import ReplicaLink
from shardwise.run import stopping

index, path, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
LONG, SHORT = float(sys.argv[4]), float(sys.argv[5])
store = dist.FileStore(path, 2)
def link(n, timeout):
    return ReplicaLink(store, n, 0, index, 2, timeout, CommMeter())
def mark(name):
    open(os.path.join(folder, name), "w").close()

a = link(0, LONG)
if index == 1:
    a.all_reduce_sum(torch.full((5,), 2.0))
    a.send_state({"w": torch.arange(4.0)}, [0])
    b, c = link(1, SHORT), link(2, LONG)     # kept: a dropped link closes at once
    mark("peer")                         # it never builds link 3
    time.sleep(300)                      # never comes again (the test kills it)
out = {}
flat = torch.ones(5)
out["summed"] = a.all_reduce_sum(flat) and flat.tolist()
out["state"] = a.recv_state(1)["w"].tolist()
b, c = link(1, SHORT), link(2, LONG)
began = time.monotonic()
out["lost"] = b.all_reduce_sum(torch.ones(5))          # the peer never joins: False, no raise
out["lost_after"] = time.monotonic() - began
for phase, wait in (("all_reduce", lambda: a.all_reduce_sum(torch.ones(5))),
                    ("recv_state", lambda: c.recv_state(1)),
                    ("build", lambda: link(3, LONG))):
    stopping.install_handlers()
    mark(phase)                          # the test signals once this exists
    try:
        wait()
        out[phase] = "returned"
    except stopping.Stopped as exc:
        out[phase] = exc.signum
    mark(phase + ".done")
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _wait_for(path: str, seconds: float, proc) -> float:
    """Seconds until ``path`` exists; fails after ``seconds`` or when ``proc`` ended."""
    began = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - began < seconds, f"{os.path.basename(path)} after {seconds} s"
        time.sleep(0.005)
    return time.monotonic() - began


def test_sigterm_reaches_a_rank_blocked_on_the_link(tmp_path):
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(i), store, str(tmp_path),
                               str(LONG), str(SHORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    waiter, peer = procs
    try:
        took = {}
        for phase in ("all_reduce", "recv_state", "build"):
            _wait_for(str(tmp_path / phase), 40, waiter)
            time.sleep(0.3)              # inside the wait by now
            waiter.send_signal(signal.SIGTERM)
            took[phase] = _wait_for(str(tmp_path / f"{phase}.done"), DEADLINE, waiter)
        stdout, stderr = waiter.communicate(timeout=10)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert waiter.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["summed"] == [3.0] * 5 and out["state"] == [0.0, 1.0, 2.0, 3.0]
    assert out["lost"] is False and SHORT * 0.9 < out["lost_after"] < SHORT + 2.0
    assert out["all_reduce"] == out["recv_state"] == out["build"] == signal.SIGTERM, out
    assert max(took.values()) < DEADLINE, took
