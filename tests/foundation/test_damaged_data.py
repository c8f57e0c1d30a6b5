"""Damaged data files end in one line, never a traceback in every rank.

IDX (MNIST-style) folders are read once before launch: a truncated, padded or non-IDX file, a
gzip stream cut short, swapped images and labels, counts that disagree or labels outside 0..9
are refused with one line naming the file and what is wrong (exit 2). A damaged token-cache
folder (tokens.bin missing or cut, meta.json cut or disagreeing) is a cache: it is said in one
line and built again, and the tokens equal a fresh build.
"""
import gzip
import json
import os
import shutil

import numpy as np
import pytest

from shardwise import cli
from shardwise.data import token_cache
from shardwise.data.images import write_idx

pytestmark = pytest.mark.timeout(120)


def _idx_dir(path):
    rng = np.random.default_rng(0)
    os.makedirs(path)
    for split, n in (("train", 64), ("t10k", 32)):
        write_idx(f"{path}/{split}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28)))
        write_idx(f"{path}/{split}-labels-idx1-ubyte", rng.integers(0, 10, (n,)))
    return path


def _cut(path, keep):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep(len(data))])


def _swap(d):
    a, b = f"{d}/train-images-idx3-ubyte", f"{d}/train-labels-idx1-ubyte"
    os.replace(a, f"{d}/tmp")
    os.replace(b, a)
    os.replace(f"{d}/tmp", b)


def _gz_cut(d):
    path = f"{d}/train-images-idx3-ubyte"
    packed = gzip.compress(open(path, "rb").read())
    os.remove(path)
    open(path + ".gz", "wb").write(packed[: len(packed) // 2])


DAMAGE = {
    "images cut short": (lambda d: _cut(f"{d}/train-images-idx3-ubyte", lambda n: n // 2),
                         "train-images-idx3-ubyte is cut short or padded: its header says 64 x "
                         "28 x 28 values"),
    "labels cut short": (lambda d: _cut(f"{d}/t10k-labels-idx1-ubyte", lambda n: n - 5),
                         "t10k-labels-idx1-ubyte is cut short or padded"),
    "header cut": (lambda d: _cut(f"{d}/train-labels-idx1-ubyte", lambda n: 6),
                   "train-labels-idx1-ubyte is cut short inside its header"),
    "not IDX": (lambda d: open(f"{d}/t10k-images-idx3-ubyte", "wb").write(b"<html>404</html>"),
                "t10k-images-idx3-ubyte is not an IDX file"),
    "gzip cut short": (_gz_cut, "train-images-idx3-ubyte.gz cannot be read"),
    "swapped": (_swap, "images and labels swapped?"),
    "count mismatch": (lambda d: write_idx(f"{d}/train-labels-idx1-ubyte", np.zeros(60)),
                       "the train split has 64 images but 60 labels"),
    "labels out of range": (lambda d: write_idx(f"{d}/train-labels-idx1-ubyte",
                                                np.full(64, 200)),
                            "the train labels run 200..200, not 0..9"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_idx_file_is_one_line_before_launch(tmp_path, capsys, case):
    damage, says = DAMAGE[case]
    folder = _idx_dir(str(tmp_path / "idx"))
    damage(folder)
    code = cli.main(["train", "--model", "lenet", "--dataset", "mnist", "--data-dir", folder,
                     "--steps", "2", "--batch-size", "8", "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: data.data_dir"), err
    assert says in err, err
    assert not os.path.exists(tmp_path / "runs"), "a run folder was made for a refused run"


def test_an_intact_idx_folder_still_trains(tmp_path):
    folder = _idx_dir(str(tmp_path / "idx"))
    assert cli.main(["train", "--model", "lenet", "--dataset", "mnist", "--data-dir", folder,
                     "--steps", "2", "--batch-size", "8", "--out-dir", str(tmp_path / "runs"),
                     "--no-progress"]) == 0


def _meta(folder):
    return os.path.join(folder, "meta.json")


def _rewrite(path, **changes):
    meta = json.load(open(path))
    open(path, "w").write(json.dumps({**meta, **changes}))


CACHE_DAMAGE = {
    "tokens cut": (lambda f: _cut(os.path.join(f, "tokens.bin"), lambda n: n // 2),
                   "tokens.bin is"),
    "tokens missing": (lambda f: os.remove(os.path.join(f, "tokens.bin")), "tokens.bin is missing"),
    "meta cut": (lambda f: _cut(_meta(f), lambda n: n // 2), "meta.json is damaged"),
    "meta count wrong": (lambda f: _rewrite(_meta(f), n_tokens=10 ** 6), "meta.json says"),
}


@pytest.mark.parametrize("case", list(CACHE_DAMAGE))
def test_a_damaged_token_cache_is_built_again(tmp_path, capsys, case):
    damage, says = CACHE_DAMAGE[case]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    fresh = token_cache.prepare(str(corpus), "bytes", str(tmp_path / "cache"))
    want = np.array(fresh.tokens())
    damage(fresh.folder)
    capsys.readouterr()
    again = token_cache.prepare(str(corpus), "bytes", str(tmp_path / "cache"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "tokenizing the corpus again" in err[0], err
    assert again.folder == fresh.folder and np.array_equal(np.array(again.tokens()), want)
    shutil.rmtree(tmp_path / "cache")
