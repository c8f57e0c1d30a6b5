"""Tests import the multi-process harness from here (it lives in shardwise.testing so that
benchmarks and users' own tests can use it too)."""
from shardwise.testing import assert_close_runs, run_world  # noqa: F401
