"""bench/cp_memory.py: the ratios and the table it reports (on made-up runs whose answers are
computed here), the verdict of a caged run, the command of each side, and one real run of the
one-process side and of the caged runs (one killed by its limit, one cp 2 rank per cgroup) at
a tiny sequence. The long runs themselves (minutes) belong to the benchmark."""
import math
import os

import pytest

from shardwise.bench import cp_memory as cm

MiB = cm.MiB


def fake_side(name: str, peaks_mib: list[int], acts_mib: int | None, step_s: float) -> dict:
    cp, impl = cm.SIDES[name]
    return {"side": name, "cp": cp, "impl": impl or None, "seq": 1024, "returncode": 0,
            "peak_rss_per_rank": [p * MiB for p in peaks_mib],
            "ledger": None if acts_mib is None else {"activations_peak": acts_mib * MiB},
            "losses": [5.5, 5.4, 5.3], "seconds_per_step": step_s, "tokens_per_s": 1024 / step_s}


def test_summarize_takes_the_worst_rank_less_the_idle_rank_over_one_process():
    sides = {"one process": fake_side("one process", [1500], 1000, 2.0),
             "cp 4 ring": fake_side("cp 4 ring", [600, 700, 650, 640], 250, 4.0),
             "cp 2 ring": fake_side("cp 2 ring", [900, 880], None, 3.0)}
    idle = {"idle": 400 * MiB, "imports": 200 * MiB, "states": 80 * MiB}
    fig = cm.summarize(sides, idle)
    assert fig["one process"]["ratio"] == 1.0
    assert fig["cp 4 ring"]["peak"] == 700 * MiB                   # the largest rank, not rank 0
    assert fig["cp 4 ring"]["above_idle"] == 300 * MiB
    assert fig["cp 4 ring"]["ratio"] == pytest.approx((700 - 400) / (1500 - 400))
    assert fig["cp 4 ring"]["activations_ratio"] == pytest.approx(250 / 1000)
    assert fig["cp 2 ring"]["activations_ratio"] is None           # no ledger: no ratio
    res = {"sides": sides, "idle": idle, "figures": fig, "seq": 1024, "long_seq": 2048,
           "limit": 3 * 2 ** 29, "caged": [
               {"side": "one process", "returncode": -9, "oom_kills": 1,
                "peak_rss_per_rank": [], "losses": [], "fits": False, "reason": "out of memory"},
               {"side": "cp 4 ring", "returncode": 0, "oom_kills": 0,
                "peak_rss_per_rank": [800 * MiB] * 4, "losses": [5.5, 5.4], "fits": True,
                "reason": "trained 2 steps"}]}
    text = cm.table(res)
    assert "| cp 4 ring | 700 | 300 | 0.273 | 250 | 0.250 | 4.0 | 256 |" in text
    assert "| cp 2 ring | 900 | 500 | 0.455 | - | - | 3.0 | 341 |" in text
    assert "limit 1.50 GiB per process" in text
    assert "| one process | -9 | 1 | - | - | does not fit: out of memory |" in text
    assert "| cp 4 ring | 0 | 0 | 800 / 800 / 800 / 800 | 5.500, 5.400 | fits: " in text


@pytest.mark.parametrize("run,fits,says", [
    ({"oom_kills": 1, "returncode": -9, "losses": []}, False, "out of memory"),
    ({"oom_kills": 0, "returncode": None, "losses": []}, False, "too slow"),
    ({"oom_kills": 0, "returncode": 1, "losses": []}, False, "exit 1: boom"),
    ({"oom_kills": 0, "returncode": 0, "losses": [5.0]}, False, "1 of 2 steps"),
    ({"oom_kills": 0, "returncode": 0, "losses": [5.0, math.nan]}, False, "losses"),
    ({"oom_kills": 0, "returncode": 0, "losses": [5.0, 4.9]}, True, "trained 2 steps"),
])
def test_verdict_names_why_a_caged_run_did_not_fit(run, fits, says):
    v = cm.verdict(run, 2, 60.0, "boom")
    assert v["fits"] is fits and says in v["reason"]


def test_each_side_is_the_command_a_user_types():
    one = cm.train_args(1, "", 4096, 3, "o")
    assert one[0] == "train" and one[-2:] == ["--strategy", "single"] and "--cp" not in one
    assert one[one.index("--block-size") + 1] == "4096"
    four = cm.train_args(4, "ulysses", 4096, 3, "o")
    for flag, value in (("--nproc-per-node", "4"), ("--cp", "4"), ("--cp-impl", "ulysses"),
                        ("--strategy", "ddp"), ("--dataset", "synthetic")):
        assert four[four.index(flag) + 1] == value
    env = cm.run_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == cm.ROOT       # ranks import this checkout


@pytest.mark.timeout(120)
def test_one_process_at_a_tiny_sequence_reports_its_run(tmp_path):
    r = cm.measure("one process", 256, 2, 100, str(tmp_path))
    assert r["returncode"] == 0 and len(r["losses"]) == 2
    assert len(r["peak_rss_per_rank"]) == 1 and r["peak_rss_per_rank"][0] > 100 * MiB
    assert r["ledger"]["activations_peak"] > 0
    assert r["tokens_per_s"] == pytest.approx(256 / r["step_seconds"][1])


def _cgroups() -> bool:
    from shardwise.bench.largest_model import MemoryCage
    try:
        MemoryCage(2 ** 30, f"shardwise-cpmem-probe-{os.getpid()}").close()
        return True
    except PermissionError:
        return False


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _cgroups(), reason="needs a writable memory cgroup (root)")
def test_caged_runs_kill_what_exceeds_the_limit_and_cage_each_rank(tmp_path):
    # 150 MiB: below torch's own import (about 220 MiB resident here), so it must be killed
    killed = cm.caged("one process", 256, 2, 150 * MiB, 100, str(tmp_path))
    assert not killed["fits"] and killed["oom_kills"] >= 1, killed["reason"]
    ok = cm.caged("cp 2 ring", 256, 2, 2 ** 30, 100, str(tmp_path))
    assert ok["fits"], ok["reason"]
    assert len(ok["cgroup_peak_per_process"]) == 2                 # each rank in its own cgroup
    assert all(p > 50 * MiB for p in ok["cgroup_peak_per_process"]), ok["cgroup_peak_per_process"]
    assert len(ok["peak_rss_per_rank"]) == 2
