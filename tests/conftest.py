import os
import sys

import pytest
import torch

# Tests run on 2 cores alongside forked worlds: one compute thread keeps them from fighting.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A test that sets torch's thread count (a bench side's threads_for, run in this process)
    must not leak it: later tests compare runs bit for bit, and a sum split over 2 threads
    rounds differently from one over 1 (test_checkpoint failed so once)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
