"""bench/largest_model.py: the parameter count it reports, the search (doubling, then bisection to
the resolution; the first failure above the best fit), sizes, and the failure line it quotes.
The trials themselves (cgroups, minutes each) run in the benchmark, not here."""
from types import SimpleNamespace

import pytest

from shardwise.bench import largest_model as lm
from shardwise.config import ModelConfig
from shardwise.models import build_model


@pytest.mark.parametrize("n_layer,width", [(1, 128), (3, 256)])
def test_gpt_params_counts_the_model_it_trains(n_layer, width):
    model = build_model(ModelConfig(name="gpt", n_layer=n_layer, n_embd=width,
                                    n_head=width // lm.HEAD_DIM, block_size=lm.SEQ,
                                    vocab_size=lm.VOCAB), 0, init="meta")
    assert lm.gpt_params(n_layer, width) == sum(p.numel() for p in model.parameters())


def test_search_doubles_then_bisects_to_the_boundary(monkeypatch, tmp_path):
    boundary = 2880                  # the largest width that "fits"
    seen = []

    def fake_trial(side, n_layer, width, limit, seconds, scratch):
        seen.append(width)
        fits = width <= boundary
        return {"side": side, "width": width, "params": lm.gpt_params(n_layer, width),
                "fits": fits, "reason": "trained 3 steps" if fits else "out of memory"}
    monkeypatch.setattr(lm, "trial", fake_trial)
    args = SimpleNamespace(n_layer=2, limit=1, trial_seconds=1, start_width=512,
                           max_width=16384, resolution=64)
    out = lm.search("zero3", args, str(tmp_path), lambda s: None)
    assert seen[:4] == [512, 1024, 2048, 4096]             # doubling until the first failure
    assert out["best"]["width"] == boundary                 # bisection to 64 finds it exactly
    assert out["first_failure"]["width"] == boundary + 64
    assert all(w % lm.HEAD_DIM == 0 for w in seen)
    assert not out["capped"]


def test_search_says_when_nothing_failed_below_the_cap(monkeypatch, tmp_path):
    monkeypatch.setattr(lm, "trial", lambda side, n, w, *a: {
        "side": side, "width": w, "params": 1, "fits": True, "reason": "ok"})
    args = SimpleNamespace(n_layer=2, limit=1, trial_seconds=1, start_width=512,
                           max_width=2048, resolution=64)
    out = lm.search("zero3-offload-disk", args, str(tmp_path), lambda s: None)
    assert out["best"]["width"] == 2048 and out["first_failure"] is None and out["capped"]
    assert "none below the width cap" in lm.table([out], 2**30)


@pytest.mark.parametrize("text,value", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20),
                                        ("1e9", 10**9), ("3G", 3 * 2**30)])
def test_parse_bytes(text, value):
    assert lm.parse_bytes(text) == value


def test_parse_bytes_refuses_with_the_flag_and_a_fix():
    with pytest.raises(ValueError, match=r"--memory-limit 'lots'.*fix"):
        lm.parse_bytes("lots")


def test_error_line_quotes_the_first_exception_a_rank_raised(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("starting\n[rank0]: Traceback (most recent call last):\n"
                   "[rank0]: RuntimeError: Cannot access accelerator device when none is available.\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                   "exitcode  : 1 (pid: 3)\n")
    assert lm._error_line(str(log)) == ("RuntimeError: Cannot access accelerator device when "
                                        "none is available.")
