"""Tests import the multi-process harness from here (it lives in shardwise.launch.world so that
benchmarks and users' own tests can use it too)."""
from shardwise.launch.world import assert_close_runs, run_world  # noqa: F401
