"""bench/malloc_cost.py: what MALLOC_MMAP_THRESHOLD_=131072 costs a step, and what
--cpu-allocator cache saves. The variable must reach its run (its large tensors then fault their
pages in every step) and stay out of the others; bad input is one line and exit 2."""
import json

import pytest

from shardwise.bench import malloc_cost

pytestmark = pytest.mark.timeout(180)


def test_the_variable_makes_every_step_fault_its_tensors_in(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")    # must not leak into "without"
    assert malloc_cost.main(["--size", "3m", "--rounds", "1", "--steps", "3"]) == 0
    out = json.loads((tmp_path / "malloc-cost-3m.json").read_text())
    for precision in ("no", "bf16"):
        r = out[precision]
        # 3.3M GPT, batch 8 x 128: its activations and gradients are 128 KiB to 1 MiB each
        # every step with it faults its tensors in; without it, some step reuses the heap
        assert r["with"]["faults_fewest_step"] > 3 * r["without"]["faults_fewest_step"]
        assert r["slowdown"] == pytest.approx(r["with"]["step_s"] / r["without"]["step_s"])
        # --cpu-allocator cache (the default here): the heap keeps what a step frees
        assert {run["cpu_allocator"] for run in r["runs"]["cache"]} == {"cache"}
        assert {run["cpu_allocator"] for run in r["runs"]["without"]} == {"system (asked for)"}
        assert r["cache"]["faults_fewest_step"] <= r["without"]["faults_fewest_step"]
        assert r["cache"]["faults_last_step"] * 3 < r["with"]["faults_last_step"]
        assert r["cache_speedup"] == pytest.approx(r["without"]["step_s"] / r["cache"]["step_s"])
    assert out["machine"]["commit"] is None or len(out["machine"]["commit"]) >= 7
    lines = out["table"].splitlines()             # the docs' table: 3 sides x 2 precisions
    assert len(lines) == 2 + 6 and "--cpu-allocator cache" in out["table"]


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "0"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert malloc_cost.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and argv[0] in err[0] and "must be at least 1" in err[0]


def test_every_result_records_the_allocator_settings(monkeypatch):
    """A result's machine says which MALLOC_* variables its run had (none: an empty dict)."""
    from shardwise.bench.run import machine
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in machine()["malloc"]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert machine()["malloc"]["MALLOC_MMAP_THRESHOLD_"] == "131072"
