"""--dataset text: a person's files, tokenized once into a memory-mapped cache.

What must hold: the token file is written once (a second build finds it, an edited file makes
a new one); the split is the stated one (validation = the last val_fraction of the tokens),
deterministic and disjoint; batches are a pure function of the step across two builds; the
trained BPE decodes the cached tokens back to the corpus exactly and is reused, not retrained;
the model's vocabulary follows the tokenizer's (set when not given, refused when too small);
every bad corpus stops before launch with one line (exit 2). All in-process, no model trained.
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch

from shardwise.cli import check_train, main
from shardwise.config import ConfigError
from shardwise.data import build_data, split_sizes, token_cache, tokenize

TEXT_A = "def add(a, b):\n    return a + b\n\nprint('héllo, wörld ✓')\n" * 40
TEXT_B = "The quick brown fox jumps over the lazy dog; 日本語も少し。\n" * 40


@pytest.fixture()
def corpus(tmp_path):
    """Two UTF-8 files in a folder (plus a hidden one the folder form leaves out)."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.py").write_text(TEXT_A, encoding="utf-8")
    (root / "b.txt").write_text(TEXT_B, encoding="utf-8")
    (root / ".hidden").write_text("never read", encoding="utf-8")
    return root


def argv(corpus, tmp_path, *extra) -> list[str]:
    return ["--dataset", "text", "--data-path", str(corpus), "--token-cache", str(tmp_path / "c"),
            "--strategy", "single", "--block-size", "16", "--n-layer", "1", "--n-embd", "32",
            "--n-head", "2", "--batch-size", "4", "--steps", "2", "--out-dir",
            str(tmp_path / "runs"), *extra]


def test_cache_is_written_once_and_batches_are_a_function_of_the_step(corpus, tmp_path):
    cfg, _, _ = check_train(argv(corpus, tmp_path))
    first = token_cache.prepare(str(corpus), "bytes", str(tmp_path / "c"))
    assert not first.built                     # check_train already tokenized it, before launch
    stamp = os.stat(first.tokens_path).st_mtime_ns
    expected = (TEXT_A + TEXT_B).encode()      # sorted paths: a.py then b.txt; .hidden left out
    assert first.n_tokens == len(expected) and first.dtype == "uint8"
    assert bytes(first.tokens()) == expected
    one, two = build_data(cfg), build_data(cfg)
    assert os.stat(first.tokens_path).st_mtime_ns == stamp          # not written again
    for step in (0, 1, 7):
        for split in ("train", "val"):
            x1, y1 = one.batch(step, 4, split=split)
            x2, y2 = two.batch(step, 4, split=split)
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert torch.equal(x1[:, 1:], y1[:, :-1])                 # y is x shifted by one
    # the data-parallel shards are rows of the same global batch
    whole = one.batch(3, 4)[0]
    assert torch.equal(torch.cat([one.batch(3, 4, r, 2)[0] for r in (0, 1)]), whole)
    os.utime(corpus / "b.txt", ns=(stamp + 10**9, stamp + 10**9))   # an edited file: a new key
    again = token_cache.prepare(str(corpus), "bytes", str(tmp_path / "c"))
    assert again.built and again.folder != first.folder


def test_split_is_the_tail_deterministic_and_disjoint(corpus, tmp_path):
    cfg, _, _ = check_train(argv(corpus, tmp_path, "--val-fraction", "0.1"))
    data, tokens = build_data(cfg), token_cache.prepare(str(corpus), "bytes", str(tmp_path / "c")).tokens()
    n_train, n_val = split_sizes(len(tokens), 16, 0.1)
    assert n_val == -(-len(tokens) // 10) and n_train + n_val == len(tokens)
    assert np.array_equal(data.splits["train"], tokens[:n_train])
    assert np.array_equal(data.splits["val"], tokens[n_train:])
    # every training window (x and its target) ends before the first validation token
    starts = torch.cat([data.global_indices(s, 64) for s in range(20)])
    assert int(starts.max()) + 16 + 1 <= n_train
    # a tiny corpus still gets one whole window of validation
    assert split_sizes(100, 16, 0.05) == (82, 18)


def test_bpe_round_trips_is_reused_and_sets_the_vocabulary(corpus, tmp_path):
    cfg, _, _ = check_train(argv(corpus, tmp_path, "--tokenizer", "bpe:300"))
    c = token_cache.prepare(str(corpus), "bpe:300", str(tmp_path / "c"))
    assert cfg.model.vocab_size == c.vocab_size <= 300 and c.dtype == "uint16"
    tok = tokenize.load(c.tokenizer_path)
    assert tok.decode(c.tokens()) == TEXT_A + TEXT_B                 # the cache decodes exactly
    sample = "naïve café — ✓ 日本 \t\n  x"
    assert tok.decode(tok.encode(sample)) == sample                  # unseen text too
    assert c.n_tokens < len((TEXT_A + TEXT_B).encode())              # merges were learned
    stamp = os.stat(c.tokenizer_path).st_mtime_ns
    check_train(argv(corpus, tmp_path, "--tokenizer", "bpe:300"))
    assert os.stat(c.tokenizer_path).st_mtime_ns == stamp            # not trained again
    # the saved tokenizer as a local Hugging Face tokenizer path: same tokens, no training
    local = tmp_path / "tok"
    local.mkdir()
    (local / "tokenizer.json").write_bytes(open(c.tokenizer_path, "rb").read())
    cfg2, _, _ = check_train(argv(corpus, tmp_path, "--tokenizer", str(local)))
    c2 = token_cache.prepare(str(corpus), str(local), str(tmp_path / "c"))
    assert cfg2.model.vocab_size == c.vocab_size and np.array_equal(c2.tokens(), c.tokens())
    # a given vocabulary: kept when it covers the tokenizer, refused when it does not
    big, _, _ = check_train(argv(corpus, tmp_path, "--tokenizer", "bpe:300", "--vocab-size", "512"))
    assert big.model.vocab_size == 512
    with pytest.raises(ConfigError, match=r"model\.vocab_size = 260: smaller than the "
                                          rf"tokenizer's vocabulary \({c.vocab_size}"):
        check_train(argv(corpus, tmp_path, "--tokenizer", "bpe:300", "--vocab-size", "260"))
    # on a corpus not tokenized yet, the refusal comes once the BPE is trained, before the
    # (long) tokenization: the BPE is kept for the next run, no token file is written
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match=r"model\.vocab_size = 260: smaller"):
        check_train(argv(corpus, tmp_path, "--tokenizer", "bpe:300", "--vocab-size", "260",
                         "--token-cache", str(fresh)))
    assert list(fresh.glob("*/tokenizer.json")) and not list(fresh.glob("*/tokens.bin*"))
    auto, _, _ = check_train(argv(corpus, tmp_path))
    assert auto.model.vocab_size == 256                              # bytes


def _refusal(args) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *args])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, err.getvalue()
    return lines[0]


def test_bad_corpora_stop_before_launch_in_one_line(corpus, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "short.txt").write_text("too short")
    base = lambda path, *more: argv(path, tmp_path, *more)
    assert "data.data_path" in _refusal(base(tmp_path / "nothing-*.txt")) and "matches no file" \
        in _refusal(base(tmp_path / "nothing-*.txt"))
    assert "corpus is empty" in _refusal(base(tmp_path / "empty.txt"))
    line = _refusal(base(tmp_path / "latin1.txt"))
    assert "latin1.txt is not UTF-8" in line and "offset 6" in line
    assert "too short for block_size 16" in _refusal(base(tmp_path / "short.txt"))
    assert "data.tokenizer" in _refusal(base(corpus, "--tokenizer", str(tmp_path / "no-tok")))
    assert "data.tokenizer" in _refusal(base(corpus, "--tokenizer", "bpe:12"))
    assert "only --dataset text reads it" in _refusal(["--data-path", str(corpus)])
    assert not list((tmp_path / "c").glob("*/tokens.bin.tmp-*"))    # nothing half-written left


def test_other_ranks_wait_and_rank_zero_shows_progress(corpus, tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "c")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")             # not the builder: waits for local rank 0
    with pytest.raises(ConfigError, match="did not finish tokenizing"):
        token_cache.prepare(str(corpus), "bytes", cache, timeout=0.3)
    monkeypatch.setattr(token_cache, "PROGRESS_BYTES", 1)     # show progress for this corpus
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    built = token_cache.prepare(str(corpus), "bytes", cache)
    err = capsys.readouterr().err
    assert built.built and "tokenizing 2 file(s)" in err and "100%" in err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    found = token_cache.prepare(str(corpus), "bytes", cache, timeout=0.3)
    assert not found.built and found.folder == built.folder and not capsys.readouterr().err
    meta = json.load(open(os.path.join(built.folder, "meta.json")))
    assert meta["n_tokens"] == built.n_tokens and len(meta["files"]) == 2
