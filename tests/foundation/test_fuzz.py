"""Random command lines and config files never crash ``shardwise train`` before launch.

The property: what ``shardwise train`` does before it starts any process (``cli.check_train``:
parse the flags and the --config file, then validate against the world) either accepts the
configuration or refuses it with one line (a ConfigError naming field, value and fix, or
argparse's one-line SystemExit(2)); never any other exception. The values are drawn per field
from shardwise.config's dataclasses: right types, wrong types, and the values an adversarial
user found after launch (issue 14: nan, inf, 1e400, 2**64, negative seeds, 300-character
names, path separators, YAML lists at the top level...).

Then one targeted test per crash that was found, in-process. (A loss that turns NaN, item 7:
tests/foundation/test_cli_errors.py runs it through ``main``, exit code and stderr included.)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

from shardwise.cli import check_train, main
from shardwise.config import ConfigError, flag_of, section_fields

FIELDS = list(section_fields())

# the numbers and texts that crashed a run after launch, or nearly did
NASTY_NUMBERS = ["nan", "inf", "-inf", "1e400", "-1e400", "1e-400", "1e30", "1e18", "1.5e0",
                 "99999999999999999999", str(2**63), str(2**64), str(2**32), "-1", "0", "-0",
                 "0x10", "1_000", " 5", "5.0", "5.5", "1e6", "1e308", "", "ten"]
NASTY_TEXT = ["", "..", ".", "../x", "a/b", "/", "a" * 300, "é", "a\nb", "a\x00b", "off", "no",
              "/proc/x", "/etc/hostname/x.png", "/etc/hostname", "~", "runs", "*", "1,,3",
              "1:", ":2", "0:0", "-1", "Block,", ",", "x.foo"]
TINY = ["--strategy", "single", "--steps", "2", "--n-layer", "1", "--n-embd", "32",
        "--n-head", "2", "--block-size", "16", "--batch-size", "4", "--eval-every", "0",
        "--dataset", "synthetic"]


def plausible(f) -> st.SearchStrategy:
    """Values a person might mean: small sizes, a choice, a fraction, a short name."""
    kind, choices = type(f.default), f.metadata.get("choices")
    return {
        bool: st.booleans(),
        int: st.one_of(st.integers(0, 4), st.sampled_from([8, 16, 32, 64, f.default])),
        float: st.one_of(st.floats(0.0, 1.0), st.just(f.default)),
        str: st.sampled_from(choices) if choices else st.sampled_from(["", f.default, "1,1", "1:2",
                                                                       "Block", "*mlp*"]),
    }[kind]


def values_for(f) -> st.SearchStrategy:
    """Values of the field's own type (in and out of range), of the wrong type, and nasty ones."""
    kind = type(f.default)
    wide = {bool: st.booleans(), int: st.integers(-(2**70), 2**70),
            float: st.floats(allow_nan=True, allow_infinity=True), str: st.text(max_size=12)}[kind]
    wrong = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                      st.lists(st.integers(), max_size=3),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    nasty = st.sampled_from(NASTY_NUMBERS + NASTY_TEXT)
    return st.one_of(plausible(f), wide, nasty, wrong)


@st.composite
def field_values(draw, max_fields: int = 5) -> list:
    """(section, field, value) for a few random fields: all plausible (so that the deeper,
    per-component checks run on accepted layouts) or any mix of right, wrong and nasty."""
    picked = draw(st.lists(st.sampled_from(FIELDS), max_size=max_fields, unique_by=lambda x: x[1].name))
    clean = draw(st.booleans())
    return [(sec, f, draw(plausible(f) if clean else values_for(f))) for sec, f in picked]


def as_flags(items) -> list[str]:
    argv = []
    for _, f, value in items:
        flag = flag_of(f)
        if isinstance(f.default, bool) and isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, str) and value.startswith("-") and value != "-":
            argv.append(f"{flag}={value}")        # argparse would take '-1' for a flag
        else:
            argv += [flag, str(value).replace("\x00", "")]   # argv cannot hold a NUL
    return argv


def as_file(items, folder: str, draw_shape: str) -> str:
    """A YAML file of the fields (or, for the nasty shapes, of something that is not sections)."""
    data: object = {}
    for sec, f, value in items:
        data.setdefault(sec, {})[f.name] = value
    if draw_shape == "list":
        data = [data]
    elif draw_shape == "scalar":
        data = 3
    elif draw_shape == "int-keys":
        data = {**data, 1: 2}
    elif draw_shape == "section-scalar":
        data = {**data, "train": 5}
    elif draw_shape == "unknown-section":
        data = {**data, "trian": {"steps": 2}}
    path = os.path.join(folder, "run.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(data, fh, allow_unicode=True)
    return path


def assert_checked_or_refused_in_one_line(argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg, _, world = check_train(argv)
        for sec, f in FIELDS:        # accepted: every value of its field's type, and usable
            value = getattr(getattr(cfg, sec), f.name)
            assert type(value) is type(f.default), (f.name, value)
            assert value == value and abs(value) < float("inf") if type(value) is float else True
            assert "\x00" not in value if type(value) is str else True
        assert world >= 1
        event("accepted")
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and "; fix: " in msg and " = " in msg, msg
        event(f"refused: {exc.field_name}"[:40])
    except SystemExit as exc:
        line = err.getvalue().strip()
        assert exc.code == 2 and "\n" not in line and "fix:" in line, (exc.code, line)
        event("refused by argparse")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """One folder for every example's config file and out_dir (module-scoped: hypothesis runs
    all examples inside one call of the test)."""
    return str(tmp_path_factory.mktemp("fuzz"))


# about 30 ms an example on 2 cores; SHARDWISE_FUZZ_EXAMPLES=5000 for a longer hunt
@settings(max_examples=int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(items=field_values(), base=st.booleans(),
       via=st.sampled_from(["flags", "file", "both"]),
       shape=st.sampled_from(["sections"] * 6 + ["list", "scalar", "int-keys", "section-scalar",
                                                 "unknown-section"]))
def test_random_configs_are_accepted_or_refused_in_one_line(folder, items, base, via, shape):
    argv = [*TINY, "--out-dir", os.path.join(folder, "runs")] if base else []
    half = len(items) // 2 if via == "both" else (0 if via == "flags" else len(items))
    if via != "flags":
        argv += ["--config", as_file(items[:half], folder, shape)]
    assert_checked_or_refused_in_one_line(argv + as_flags(items[half:]))


# -- the crashes found, one by one (in-process: main() is what the console script runs) --------

def refused(argv: list[str], capsys, *parts: str) -> str:
    """``shardwise train ARGV`` stops with exit code 2 and one error line holding ``parts``."""
    code = main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("error: ") and "; fix: " in err, err
    for part in parts:
        assert part in err, (part, err)
    return err


def accepted(argv: list[str], capsys) -> dict:
    """``shardwise train ARGV --print-config`` passes every check; the resolved config."""
    code = main(["train", *TINY, *argv, "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("text,suffix,parts", [
    ("- 1\n- 2\n", ".yaml", ["--config = 'list'", "mapping of sections"]),          # a list
    ("3\n", ".yaml", ["--config = 'int'", "mapping of sections"]),                  # a scalar
    ("0\n", ".yaml", ["--config = 'int'"]),          # a falsy scalar is not an empty file
    ("1: 2\n", ".yaml", ["--config = 1", "section names must be text"]),            # int key
    ("train:\n  3: 4\n", ".yaml", ["--config = 3", "under train"]),                # int field key
    ("train: 5\n", ".yaml", ["train = 5", "a section must be a table"]),           # section value
    ("train = 5\n", ".toml", ["train = 5", "a section must be a table"]),
    ("train:\n", ".yaml", ["train = None", "a section must be a table"]),
    ('"a\\nb":\n  steps: 2\n', ".yaml", ["'a\\nb' = '...'", "unknown section"]),  # no raw newline
    ("? [1, 2]\n: 3\n", ".yaml", ["cannot be parsed (while constructing a mapping in"]),
    ("train:\n  steps: true\n", ".yaml", ["train.steps = True", "not an int"]),    # was 1 step
    ("memory:\n  mixed_precision: no\n", ".yaml", ["memory.mixed_precision = False", "quote"]),
    ("logging:\n  run_name:\n", ".yaml", ["logging.run_name = None", "has no value"]),
    ("logging:\n  out_dir: [a, b]\n", ".yaml", ["logging.out_dir = ['a', 'b']", "not text"]),
    ("logging:\n  out_dir: \"a\\0b\"\n", ".yaml", ["logging.out_dir", "NUL"]),
])
def test_1_config_files_that_are_not_mappings_of_sections_are_one_line(tmp_path, capsys, text, suffix, parts):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    refused(["--config", str(path)], capsys, *parts)


def test_1_an_empty_yaml_file_holds_no_settings(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("")
    assert accepted(["--config", str(path)], capsys)["train"]["steps"] == 2


@pytest.mark.parametrize("argv,parts", [
    (["--steps", "1e400"], ["train.steps = '1e400'", "give a number"]),     # was OverflowError
    (["--steps", "1e30"], ["train.steps = '1e30'"]),        # was 1000000000000000019884624838656
    (["--steps", "1.5e0"], ["train.steps = '1.5e0'"]),                      # was silently 1 step
    (["--steps", str(2**63)], [f"train.steps = {2**63}", "beyond 2**63"]),
    (["--steps", "nan"], ["train.steps = 'nan'"]),
    (["--lr", "nan"], ["train.lr = nan", "not a finite number"]),
    (["--lr", "inf"], ["train.lr = inf"]),
    (["--lr=-inf"], ["train.lr = -inf"]),
    (["--lr", "1e400"], ["train.lr = inf"]),
    (["--weight-decay", "nan"], ["train.weight_decay = nan"]),
    (["--grad-clip", "nan"], ["train.grad_clip = nan"]),
    (["--collective-timeout", "inf"], ["train.collective_timeout = inf"]),
    # was an OverflowError from datetime.timedelta in every rank of a multi-process run
    (["--collective-timeout", "1e300"], ["train.collective_timeout = 1e+300", "31 years"]),
    (["--dropout", "nan"], ["model.dropout = nan"]),
    (["--lora-rank", "-1"], ["memory.lora_rank = -1", ">= 0"]),
    # sizes no machine like this one holds: was an allocator traceback (or hours building)
    (["--vocab-size", str(10**12)], ["model.vocab_size = 1000000000000", "fp32 weights"]),
    (["--n-layer", str(10**8)], ["model.n_layer = 100000000", "fp32 weights"]),
    (["--batch-size", str(10**12)], ["train.batch_size = 1000000000000", "--batch-size"]),
])
def test_2_numbers_must_be_finite_whole_and_of_a_usable_size(capsys, argv, parts):
    refused([*TINY, *argv], capsys, *parts)


@pytest.mark.parametrize("argv,parts", [
    (["--lr", "-inf"], ["argument --lr: expected one argument", "--lr=VALUE"]),
    (["--run-name", "a", "b\nc"], ["unrecognized arguments: b c"]),     # one line, not two
])
def test_2_flags_argparse_refuses_are_one_line_too(capsys, argv, parts):
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, *argv])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0 and "fix:" in err, err
    assert all(part in err for part in parts), err


def test_2_whole_numbers_in_exponent_form_are_exact(capsys):
    cfg = accepted(["--steps", "5e3", "--warmup-steps", "5.0", "--max-bytes", "1_000_000"], capsys)
    assert (cfg["train"]["steps"], cfg["train"]["warmup_steps"]) == (5000, 5)
    assert cfg["data"]["max_bytes"] == 1_000_000


def test_3_seed_is_one_every_generator_takes(capsys):
    import numpy as np
    import torch
    refused([*TINY, "--seed=-1"], capsys, "train.seed = -1", "0 <= seed < 2**32")
    refused([*TINY, "--seed", str(2**32)], capsys, f"train.seed = {2**32}", "0 <= seed < 2**32")
    top = 2**32 - 1      # the largest seed accepted: numpy and torch both take it
    assert accepted(["--seed", str(top)], capsys)["train"]["seed"] == top
    np.random.RandomState(top)
    torch.manual_seed(top)
    with pytest.raises(ValueError):
        np.random.RandomState(top + 1)      # why the limit is numpy's, not torch's 2**64


def test_4_vocab_size_must_cover_the_byte_tokens(capsys):
    from shardwise.config import DataConfig, ModelConfig
    from shardwise.data.text import read_stdlib
    from shardwise.models import build_model
    d = DataConfig()
    train, _ = read_stdlib(d.max_bytes, d.val_fraction)
    assert int(train.max()) >= 200        # UTF-8 in the stdlib's source: bytes above 127
    small = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=100), 0)
    with pytest.raises(IndexError):       # what a run with --vocab-size 100 died of
        small(train[train >= 100][:8].long()[None])           # (1, 8) tokens
    argv = [*TINY[:-2], "--dataset", "stdlib", "--vocab-size", "100"]
    refused(argv, capsys, "model.vocab_size = 100", "byte tokens", "--vocab-size 256")
    # synthetic tokens are drawn below vocab_size: any positive size works
    assert accepted(["--vocab-size", "100"], capsys)["model"]["vocab_size"] == 100


@pytest.mark.parametrize("name", ["a" * 300, "a/b", "..", "../up", ".", "/abs"])
def test_5_run_name_is_one_plain_folder_name(tmp_path, capsys, name):
    shown = repr(name if len(name) <= 60 else name[:57] + "...")
    refused([*TINY, "--out-dir", str(tmp_path), "--run-name", name], capsys,
            f"logging.run_name = {shown}", "plain folder name")
    assert os.listdir(tmp_path) == []       # refused before anything was written


def test_6_schedule_picture_must_be_writable(tmp_path, capsys):
    pp = ["--strategy", "pp", "--pp", "2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
          "--block-size", "16", "--batch-size", "4", "--dataset", "synthetic"]
    afile = tmp_path / "afile"
    afile.write_text("")
    refused([*pp, "--schedule-png", f"{afile}/x.png"], capsys,
            f"logging.schedule_png = '{afile}/x.png'", f"{afile} is a file")
    refused([*pp, "--schedule-png", str(tmp_path)], capsys, "is a directory, not a file name")
    refused([*pp, "--schedule-png", str(tmp_path / "x.foo")], capsys, ".foo is not a picture")
    refused([*pp, "--schedule-png", str(tmp_path / ("p" * 300 + ".png"))], capsys,
            "304 bytes long")
    refused([*pp, "--schedule-png", "/proc/x/s.png"], capsys, "no file can be made in /proc")


def test_8_out_dir_that_cannot_be_written_is_refused_before_launch(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    refused([*TINY, "--out-dir", "/proc/x"], capsys, "logging.out_dir = '/proc/x'",
            "no file can be made in /proc")      # root too: os.access said yes here
    refused([*TINY, "--out-dir", f"{afile}/runs"], capsys, f"{afile} is a file")
    refused([*TINY, "--out-dir", str(tmp_path / ("d" * 256))], capsys, "256 bytes long")
    with pytest.raises(ConfigError, match="logging.out_dir"):
        check_train([*TINY, "--out-dir", "/proc/x"])     # the check the fuzz above runs


def test_8_a_full_disk_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    from shardwise.config import writable
    monkeypatch.setattr(writable, "MIN_FREE_BYTES", 1 << 62)    # this disk, seen as full
    refused([*TINY, "--out-dir", str(tmp_path)], capsys, f"logging.out_dir = '{tmp_path}'",
            "is full", "free some space")


def test_8_a_disk_that_fills_up_during_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    """After the checks passed, a write of the run's files fails with ENOSPC (what writing
    metrics.jsonl onto /dev/full gives; the loop itself is stubbed out here: building a real
    optimizer imports torch._dynamo, ~8 s). What the person sees: one line naming --out-dir."""
    import errno
    from shardwise.run import train as train_module

    def fill_up(cfg, rt, **kw):
        with open("/dev/full" if os.path.exists("/dev/full") else os.devnull, "w") as fh:
            fh.write("{}\n")
            fh.flush()                         # ENOSPC from the kernel on Linux
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))    # elsewhere
    monkeypatch.setattr(train_module, "train", fill_up)
    code = main(["train", *TINY, "--no-progress", "--out-dir", str(tmp_path), "--run-name", "r"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.count("\n") == 0, err
    assert err.startswith(f"error: logging.out_dir = '{tmp_path}'") and "No space left" in err
