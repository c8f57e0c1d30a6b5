import gc
import os
import sys
import threading

import pytest
import torch

# Tests run on 2 cores alongside forked worlds: one compute thread keeps them from fighting.
torch.set_num_threads(1)

# run_world forks this process: no helper thread may be alive then (a fork copies the locks a
# thread holds, not the thread). tqdm (Hugging Face's progress bars) starts a monitor thread
# that lives for the rest of the session; 0 turns it off.
try:
    import tqdm
    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A test that sets torch's thread count (a bench side's threads_for, run in this process)
    must not leak it: later tests compare runs bit for bit, and a sum split over 2 threads
    rounds differently from one over 1 (test_checkpoint failed so once)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_helper_thread_outlives_its_test():
    """An engine a test dropped without close() keeps its helper threads (dp's replicas, an
    offload writer) until the garbage collector frees it, and run_world may fork this process
    before then: a fork copies a lock such a thread holds, never the thread. After each test,
    a collection frees those executors (their idle workers then exit) and they are joined."""
    yield
    left = [t for t in threading.enumerate() if t.name.startswith("shardwise-")]
    if left:
        gc.collect()
        for t in left:
            t.join(timeout=10)
