"""--dataset text --data-path DIR where DIR is a Hugging Face dataset saved to disk.

What must hold: the tokens are the text column's rows in the dataset's order, each followed by a
blank line (nothing else of the dataset leaks in); a DatasetDict is read from its train split;
the cache is reused until the dataset is saved again; the BPE trains on the column; a run trains
on it end to end (in-process, one process); a missing or non-text column and --text-column on
plain files are refused before launch with one line naming the field (exit 2).
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardwise.cli import check_train, main
from shardwise.config import ConfigError
from shardwise.data import token_cache

import datasets   # the 'datasets' extra (the test extra installs it)

ROWS = ["def add(a, b):\n    return a + b\n" * 20, "héllo wörld ✓ " * 30, None,
        "The quick brown fox jumps over the lazy dog. " * 25]


def _saved(tmp_path, name="ds", rows=ROWS, dict_form=False):
    ds = datasets.Dataset.from_dict({"body": rows, "n": list(range(len(rows)))})
    path = tmp_path / name
    if dict_form:
        other = datasets.Dataset.from_dict({"body": ["validation only"], "n": [0]})
        datasets.DatasetDict({"train": ds, "validation": other}).save_to_disk(str(path))
    else:
        ds.save_to_disk(str(path))
    return path


def _argv(path, tmp_path, *extra):
    return ["--dataset", "text", "--data-path", str(path), "--text-column", "body",
            "--token-cache", str(tmp_path / "c"), "--strategy", "single", "--block-size", "16",
            "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "4",
            "--steps", "3", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
            "--out-dir", str(tmp_path / "runs"), *extra]


def test_the_column_is_the_corpus_and_the_cache_is_reused(tmp_path, monkeypatch):
    from shardwise.data import hf_datasets
    loads = []
    real_load = hf_datasets.load
    monkeypatch.setattr(hf_datasets, "load", lambda *a: loads.append(a) or real_load(*a))
    path = _saved(tmp_path)
    check_train(_argv(path, tmp_path))                         # tokenized before launch
    assert len(loads) == 1                                     # loaded once to tokenize
    corpus = token_cache.prepare(str(path), "bytes", str(tmp_path / "c"), text_column="body")
    assert not corpus.built and len(loads) == 1                # found: check_train built it
    expected = "".join(r + "\n\n" for r in ROWS if r is not None).encode()
    assert bytes(corpus.tokens()) == expected
    # a DatasetDict: its train split, not the validation one
    both = _saved(tmp_path, "dd", dict_form=True)
    read = token_cache.prepare(str(both), "bytes", str(tmp_path / "c"), text_column="body")
    assert bytes(read.tokens()) == expected
    # saved again with other rows: another cache folder, the new text
    _saved(tmp_path, rows=["only this row"])
    again = token_cache.prepare(str(path), "bytes", str(tmp_path / "c"), text_column="body")
    assert again.built and bytes(again.tokens()) == b"only this row\n\n"


def test_a_run_trains_on_it_with_a_bpe(tmp_path):
    path = _saved(tmp_path)
    code = main(["train", *_argv(path, tmp_path, "--tokenizer", "bpe:300", "--run-name", "hf-ds")])
    assert code == 0
    summary = json.load(open(tmp_path / "runs" / "hf-ds" / "summary.json"))
    assert summary["config"]["data"]["text_column"] == "body"
    assert summary["config"]["model"]["vocab_size"] <= 300
    assert (tmp_path / "runs" / "hf-ds" / "tokenizer.json").exists()


@pytest.mark.parametrize("column, says", [
    ("missing", "data.text_column = 'missing': is not a column of .* \\(its columns: body, n\\)"),
    ("n", "data.text_column = 'n': holds int64, not text"),
])
def test_bad_columns_are_refused_before_launch(tmp_path, column, says):
    path = _saved(tmp_path)
    args = _argv(path, tmp_path)
    args[args.index("--text-column") + 1] = column
    with pytest.raises(ConfigError, match=says):
        check_train(args)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", *args]) == 2
    assert len(err.getvalue().strip().splitlines()) == 1 and "Traceback" not in err.getvalue()


def test_a_text_column_for_plain_files_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("plain text " * 50, encoding="utf-8")
    with pytest.raises(ConfigError, match="data.text_column = 'body': only a Hugging Face dataset"):
        check_train(_argv(tmp_path / "a.txt", tmp_path))
