"""shardwise/bench/allreduce_sizes.py end to end at world 2 on the sizes both fits use: each fit
goes through its own points (the calibration's 1 KiB and 32 MiB, the old line's 1 KiB and 4
MiB), the JSON carries what docs/planner.md reads, and a bad --worlds is refused."""
import json
import os

import pytest

from shardwise.bench import allreduce_sizes as bench, validate_planner
from shardwise.launch.calibrate_links import LARGE, SMALL, XLARGE


@pytest.mark.timeout(120)
def test_fits_graded_on_every_size(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "SIZES", (SMALL, LARGE, XLARGE))
    monkeypatch.setattr(validate_planner, "RESULTS", str(tmp_path))
    assert bench.main(["--worlds", "2", "--save"]) == 0
    doc = json.load(open(os.path.join(tmp_path, "allreduce-sizes.json")))
    assert {"commit", "dirty", "date"} <= set(doc["machine"])
    (world,) = doc["worlds"]
    assert world["world"] == 2
    for kind in ("gloo", "reducer"):
        rows = {r["bytes"]: r for r in world["kinds"][kind]["rows"]}
        assert set(rows) == {SMALL * 4, LARGE * 4, XLARGE * 4}
        # the ring model through its own points: the 1 KiB time is all latency (2 steps of
        # alpha), and the line goes through 32 MiB (to SMALL / XLARGE of its bandwidth term)
        small, large, xl = rows[SMALL * 4], rows[LARGE * 4], rows[XLARGE * 4]
        fit = world["kinds"][kind]["fits"]["calibration"]
        assert fit["alpha"] * 2 == pytest.approx(small["measured_s"])
        assert xl["calibration_s"] == pytest.approx(xl["measured_s"], rel=1e-4)
        assert fit["bus_bw"] > 0
        # the old line's slope is the one between 1 KiB and 4 MiB (when 4 MiB took longer:
        # otherwise its bandwidth is unbounded, what the calibration no longer risks)
        if large["measured_s"] > small["measured_s"]:
            assert large["line_1k_4m_s"] - small["line_1k_4m_s"] == pytest.approx(
                large["measured_s"] - small["measured_s"])
    table = open(os.path.join(tmp_path, "allreduce-sizes.md")).read()
    assert table == bench.markdown(doc) and table.count("| 2 |") == 6


def test_bad_worlds_refused(capsys):
    assert bench.main(["--worlds", "1"]) == 2
    assert "--worlds '1'" in capsys.readouterr().out
