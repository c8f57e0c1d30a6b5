"""``--memory-report``: each technique's "saved" figure against a run without the technique.

The report computes its figures from one run (ledger rates, and an extra forward with the
technique off); here each one is checked against a second, real run of the same config without
that technique: its ledger must hold exactly (or, for activations, within the distinct-storage
accounting of one forward) what the report said would be saved.
"""
from dataclasses import replace

import pytest

from reference import tiny_config
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train


def _cfg(**memory):
    cfg = tiny_config("single", steps=2)
    return replace(cfg, memory=replace(cfg.memory, **memory))


def _run(cfg):
    s = train(cfg, init_runtime(cfg), quiet=True)
    rows = s.get("memory_report", {"ranks": [{"rows": []}]})["ranks"][0]["rows"]
    return s["ledger"], {name: saved for name, saved, _ in rows}


def _held(ledger):
    return ledger["gradients"] + ledger["optimizer_states"] + ledger["master_weights"]


def test_each_saving_matches_a_run_without_the_technique():
    with_all = _cfg(freeze="blocks.0.*", activation_checkpointing=True, memory_report=True)
    ledger, saved = _run(with_all)
    plain, _ = _run(_cfg())
    assert saved["frozen parameters"] == _held(plain) - _held(ledger) > 0
    no_ckpt, _ = _run(_cfg(freeze="blocks.0.*"))
    assert saved["activation checkpointing"] == \
        no_ckpt["activations_peak"] - ledger["activations_peak"] > 0


def test_8bit_saving_matches_the_fp32_optimizer_state():
    cfg = _cfg(memory_report=True)
    ledger, saved = _run(replace(cfg, train=replace(cfg.train, optimizer="adamw8bit")))
    fp32, _ = _run(_cfg())
    assert saved["8-bit optimizer"] == fp32["optimizer_states"] - ledger["optimizer_states"]
    assert ledger["optimizer_states"] <= 0.3 * fp32["optimizer_states"]


def test_no_technique_reports_no_rows():
    _, saved = _run(_cfg(memory_report=True))
    assert saved == {}


@pytest.mark.parametrize("argv,field", [
    (["--freeze", "blk.*"], "memory.freeze"),                       # matches nothing
    (["--freeze", "*"], "memory.freeze"),                           # nothing left to train
    (["--lora-targets", "*qkv"], "memory.lora_targets"),            # LoRA off: ignored
    (["--lora-rank", "4"], "memory.lora_targets"),                  # no layers named
    (["--lora-rank", "4", "--lora-targets", "*ln_1"], "memory.lora_targets"),   # a LayerNorm
    (["--lora-rank", "4", "--lora-targets", "*qkv", "--lora-alpha", "0"], "memory.lora_alpha"),
])
def test_bad_technique_settings_are_refused_before_launch(argv, field):
    from shardwise.cli import check_train
    from shardwise.config import ConfigError
    with pytest.raises(ConfigError) as exc:
        check_train(["--steps", "2", *argv])
    assert exc.value.field_name == field and "\n" not in str(exc.value)
