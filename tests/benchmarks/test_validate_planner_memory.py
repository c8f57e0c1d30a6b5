"""shardwise/bench/validate_planner_memory.py without the 57M runs: the cases' micro-batches, the
role the measured rank is taken from, the gap and goal, and the table."""
import pytest

from shardwise.bench import validate_planner_memory as vpm
from shardwise.bench.validate_planner import CASES

MiB = 2 ** 20


def test_every_case_runs_the_layouts_micro_batch():
    for name in CASES:
        world, par, layout = vpm.case(name, 4)
        replicas = max(layout.dp, par.get("replicas", 1))
        m = par.get("num_microbatches", 1)
        assert layout.micro_batch * replicas * m == 4, name
        assert world == CASES[name][0]
    assert vpm.case("3d", 4)[2].micro_batch == 1 and vpm.case("pp", 4)[2].micro_batch == 2


def _rank(rank, used, **role):
    return {"rank": rank, "used": used, "baseline": 100 * MiB, "peak": used + 100 * MiB,
            "ledger": {"parameters": 1}, "ledger_at_peak": {"parameters": used, "on_disk": 7},
            "pp_rank": role.get("pp", 0), "last_stage": role.get("last", True),
            "server": role.get("server", False)}


def _pred(role, peak, total):
    return {"role": role, "peak": peak, "total": total, "categories": {}}


def test_compare_takes_the_fullest_rank_of_the_planners_role():
    ranks = [_rank(0, 500 * MiB, server=True), _rank(1, 900 * MiB), _rank(2, 950 * MiB)]
    row = vpm.compare("ps", _pred("server", 540 * MiB, 560 * MiB), ranks)
    assert row["rank"] == 0 and row["measured_used"] == 500 * MiB
    assert row["gap_peak"] == pytest.approx(0.08) and row["goal_met"]
    assert row["gap_total"] == pytest.approx(0.12)
    assert row["ledger_at_peak"] == 500 * MiB            # on_disk is not resident
    stage0 = [_rank(0, 400 * MiB, pp=0, last=False), _rank(1, 600 * MiB, pp=1)]
    row = vpm.compare("pp", _pred("stage 0", 500 * MiB, 500 * MiB), stage0)
    assert row["rank"] == 0 and row["gap_peak"] == pytest.approx(0.25) and not row["goal_met"]


def test_goal_is_ten_percent_either_way():
    ranks = [_rank(0, 1000 * MiB)]
    assert vpm.compare("ddp", _pred("rank", 900 * MiB, 0), ranks)["goal_met"]
    assert not vpm.compare("ddp", _pred("rank", 899 * MiB, 0), ranks)["goal_met"]
    assert not vpm.compare("ddp", _pred("rank", 1101 * MiB, 0), ranks)["goal_met"]


def test_markdown_reports_rows_and_failures():
    row = {**vpm.compare("ddp", {**_pred("rank", 975 * MiB, 1025 * MiB), "categories":
                                 {k: MiB for k in vpm.SHOWN}}, [_rank(0, 1000 * MiB)]),
           "world": 2, "layout": "ddp dp=2 mb=2 recompute=none"}
    meta = {"model": vpm.MODEL, "batch": 4, "steps": 3, "load": (1.0, 1.0, 1.0)}
    text = vpm.markdown([row, {"strategy": "tp", "error": "RuntimeError: boom"}], meta)
    assert "| ddp | 2 | ddp dp=2 mb=2 recompute=none | rank (0) | 975 | 1,025 | 1,000 |" in text
    assert "-2% | +2% | yes |" in text
    assert "failed: RuntimeError: boom" in text
