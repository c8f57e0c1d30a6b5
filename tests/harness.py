"""Tests import the multi-process harness from here (it lives in shardwise.launch.world so that
benchmarks and users' own tests can use it too)."""
from shardwise.launch.world import (assert_close_but_for_strays, assert_close_runs,  # noqa: F401
                                   run_world)


def assert_clipped_steps_close(r: dict, ref: dict, tag: str, max_norm: float, rtol: float,
                               atol: float, why: str) -> None:
    """A run against its reference, step by step: every clipped norm (each must exceed
    ``max_norm`` in the reference, or clipping did not bind and the check means nothing) and
    every loss within atol + rtol x the reference's, and the same parameter names."""
    for step, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
        assert b > max_norm, "clipping must bind for the test to mean anything"
        assert abs(a - b) <= atol + rtol * b, f"{tag} step {step}: norm {a} vs {b} ({why})"
    for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
        assert abs(a - b) <= atol + rtol * abs(b), f"{tag} step {step}: loss {a} vs {b} ({why})"
    assert r["params"].keys() == ref["params"].keys(), tag
