"""bench/profile_limit.py: the profile of DDP against one process names the allreduce and the
optimizer in the trace, and refuses bad input in one line."""
import json

import pytest

from shardwise.bench import profile_limit


def test_difference_orders_operators_by_what_ddp_spends_more_or_less():
    rows = profile_limit.difference({"mm": 1.0, "shm:x": 0.3, "add": 0.05},
                                    {"mm": 1.5, "add": 0.04, "copy": 0.2}, top=3)
    assert [r["op"] for r in rows] == ["mm", "shm:x", "copy"]
    assert rows[0]["extra_s"] == pytest.approx(-0.5)
    assert rows[1]["one_s"] == 0.0


@pytest.mark.timeout(180)
def test_both_sides_profiled_at_world_two(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert profile_limit.main(["--size", "3m", "--steps", "1", "--rounds", "1",
                               "--trace", str(tmp_path / "trace")]) == 0
    out = json.loads((tmp_path / "profile-limit-3m.json").read_text())
    ddp, one = out["ddp"], out["one"]
    assert (ddp["threads"], one["threads"]) == (max(1, out["cores"] // 2), out["cores"])
    assert ddp["logits_dtype"] == one["logits_dtype"] == "torch.float32"
    assert ddp["weight_casts_s_per_step"] > 0       # DDP copies each gradient into its bucket
    assert ddp["rows_per_rank"] * 2 == one["rows_per_rank"]
    # the allreduce shows on DDP's side only (shared memory or gloo), the optimizer on both
    assert any(k.startswith(("shm:", "gloo:")) for k in ddp["ranges_s_per_step"])
    assert not any(k.startswith(("shm:", "gloo:")) for k in one["ranges_s_per_step"])
    assert any(k.startswith("Optimizer.step#") for k in one["ranges_s_per_step"])
    for side in (ddp, one):
        p = side["phases"]
        assert p["total"] == pytest.approx(p["forward"] + p["backward"] + p["step"], rel=1e-6)
    assert out["machine"]["commit"] is None or len(out["machine"]["commit"]) >= 7
    assert (tmp_path / "trace" / "ddp-3m.json").exists() and (tmp_path / "trace" / "one-3m.json").exists()
    assert "| operator (self time)" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_bf16_profiles_both_sides_in_autocast_into_their_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert profile_limit.main(["--size", "3m", "--steps", "1", "--rounds", "1",
                               "--mixed-precision", "bf16"]) == 0
    assert not (tmp_path / "profile-limit-3m.json").exists()
    out = json.loads((tmp_path / "profile-limit-3m-bf16.json").read_text())
    assert out["mixed_precision"] == "bf16"
    assert out["ddp"]["logits_dtype"] == out["one"]["logits_dtype"] == "torch.bfloat16"
    for side in (out["ddp"], out["one"]):   # autocast casts every weight: copies of their shapes
        assert 0 < side["weight_casts_s_per_step"] <= side["ops_s_per_step"]["aten::copy_"]


@pytest.mark.parametrize("argv", [["--world", "1"], ["--steps", "0"], ["--size", "9b"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        code = profile_limit.main(argv)
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if argv[0] == "--size":           # argparse: its usage, then one line naming the field
        assert "argument --size: invalid choice: '9b'" in err[-1]
    else:
        assert len(err) == 1 and argv[0] in err[0] and "must be at least" in err[0]
