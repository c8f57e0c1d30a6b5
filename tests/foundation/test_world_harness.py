"""run_world (shardwise.launch.world), the harness every multi-process test and benchmark uses:
a world that does not finish within its timeout is killed and the error carries each hung
rank's Python stacks, so an intermittent deadlock in CI names the collective it waited in."""
import time

import pytest
import torch

from harness import run_world

pytestmark = pytest.mark.timeout(60)


def _rank0_waits_alone(rank, n):
    import torch.distributed as dist
    if rank == 0:
        dist.all_reduce(torch.ones(1))       # rank 1 never joins
    else:
        time.sleep(120)


def test_a_hung_world_names_where_each_rank_waits():
    with pytest.raises(TimeoutError) as err:
        run_world(_rank0_waits_alone, 2, timeout=4)
    text = str(err.value)
    assert "ranks [0, 1] did not finish within 4 s" in text
    rank0, rank1 = text.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in all_reduce" in rank0 and "_rank0_waits_alone" in rank0
    assert "in all_reduce" not in rank1 and "_rank0_waits_alone" in rank1


def _sleeps(rank, n):
    time.sleep(120)


def test_an_interrupted_caller_leaves_no_rank_behind():
    """pytest-timeout (or Ctrl-C) raises inside run_world's wait: the ranks are killed on the
    way out. Left alive, multiprocessing joins them when this process exits: a CI run once
    printed its summary and never exited."""
    import multiprocessing
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_world(_sleeps, 2, timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert multiprocessing.active_children() == []
