"""Data: deterministic global batches, disjoint shards, the stdlib corpus, IDX files, digits."""
import numpy as np
import pytest
import torch

from shardwise.data import load_digits_data, load_idx_dir, read_idx, stdlib_corpus, write_idx
from shardwise.data.sampler import finite_indices, shard_rows


def test_token_shards_are_disjoint_and_union_is_the_global_batch():
    data = stdlib_corpus(block_size=16, seed=3, max_bytes=100_000, val_fraction=0.1)
    full_x, full_y = data.batch(step=5, global_batch=8)
    parts = [data.batch(5, 8, r, 4) for r in range(4)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), full_x)
    torch.testing.assert_close(full_y[:, :-1], full_x[:, 1:])        # next-token targets
    assert not torch.equal(data.batch(6, 8)[0], full_x)               # steps differ
    again = stdlib_corpus(16, 3, 100_000, 0.1).batch(5, 8)[0]
    torch.testing.assert_close(again, full_x)                         # deterministic


def test_stdlib_split_is_disjoint_files_and_bytes():
    data = stdlib_corpus(16, 0, 200_000, 0.05)
    train, val = data.splits["train"], data.splits["val"]
    assert len(train) == 200_000 and 0 < len(val) <= 10_001
    assert train.dtype == torch.uint8


def test_finite_indices_cover_each_epoch_once_and_reshuffle():
    n, b = 10, 4
    seen = torch.cat([finite_indices(n, 0, s, b) for s in range(5)])   # 20 = two epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert seen[:10].tolist() != seen[10:].tolist()
    assert shard_rows(8, 1, 4) == slice(2, 4)
    with pytest.raises(ValueError):
        shard_rows(7, 0, 2)


def test_idx_round_trip_raw_and_gz(tmp_path):
    rng = np.random.default_rng(0)
    for split, (img, lab) in {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                              "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}.items():
        n = 20 if split == "train" else 8
        write_idx(str(tmp_path / (img + ".gz")), rng.integers(0, 255, (n, 28, 28)))
        write_idx(str(tmp_path / lab), rng.integers(0, 10, n))
    arr = read_idx(str(tmp_path / "train-images-idx3-ubyte.gz"))
    assert arr.shape == (20, 28, 28) and arr.dtype == np.uint8
    data = load_idx_dir(str(tmp_path), seed=0)
    x, y = data.batch(0, 4)
    assert x.shape == (4, 1, 28, 28) and y.shape == (4,)
    assert data.size("val") == 8
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="magic"):
        read_idx(str(tmp_path / "bad"))


def test_digits_ship_with_scikit_learn():
    data = load_digits_data(seed=0)
    x, y = data.batch(0, 16, dp_rank=1, dp_size=2)
    assert x.shape == (8, 1, 28, 28) and int(y.max()) <= 9
    assert data.size("train") + data.size("val") == 1797
