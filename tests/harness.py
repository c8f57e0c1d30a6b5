"""Tests import the multi-process harness from here (it lives in shardwise.launch.world so that
benchmarks and users' own tests can use it too)."""
from shardwise.launch.world import (assert_close_but_for_strays, assert_close_runs,  # noqa: F401
                                   run_world)
