"""Image classification sets: scikit-learn's handwritten digits, and MNIST / Fashion-MNIST IDX files.

Images come out as float tensors (N, 1, 28, 28) normalised to mean 0, std 1 over the training
split; labels as int64. The 8x8 digits are upsampled to 28x28 (bilinear) so that LeNet
(LeCun et al. 1998) applies unchanged.
"""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

from shardwise.data.sampler import finite_indices, shard_rows

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (raw or .gz): magic 0x00 0x00 dtype ndim, then big-endian dims, data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtype = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.get(raw[2])
    if dtype is None:
        raise ValueError(f"{path}: unknown IDX data type 0x{raw[2]:02x}")
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4: 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(dims)


def write_idx(path: str, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (.gz when the path says so); used by tests and tools."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(header + array.tobytes())


def _find(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{data_dir}: missing {stem} (or {stem}.gz)")


class ImageData:
    """A finite labelled image set with deterministic, epoch-permuted global batches."""
    kind = "images"

    def __init__(self, splits: dict, seed: int):
        self.splits, self.seed = splits, seed

    def size(self, split: str) -> int:
        return len(self.splits[split][1])

    def batch(self, step, global_batch, dp_rank=0, dp_size=1, split="train"):
        idx = finite_indices(self.size(split), self.seed + (split != "train"), step, global_batch)
        idx = idx[shard_rows(global_batch, dp_rank, dp_size)]
        x, y = self.splits[split]
        return x[idx], y[idx]


def _normalise(train_x: torch.Tensor, val_x: torch.Tensor):
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, (val_x - mean) / std


def load_digits_data(seed: int, val_fraction: float = 0.2) -> ImageData:
    """scikit-learn's 1,797 8x8 handwritten digits (shipped inside the package), as 28x28."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None]            # (N, 1, 8, 8)
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_val = int(len(y) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    tx, vx = _normalise(x[train], x[val])
    return ImageData({"train": (tx, y[train]), "val": (vx, y[val])}, seed)


def load_idx_dir(data_dir: str, seed: int) -> ImageData:
    """MNIST or Fashion-MNIST from the four standard IDX files in ``data_dir``."""
    splits = {}
    for split, (images, labels) in IDX_FILES.items():
        xi = read_idx(_find(data_dir, images))
        yi = read_idx(_find(data_dir, labels))
        if xi.shape[0] != yi.shape[0]:
            raise ValueError(f"{data_dir}: {split} has {xi.shape[0]} images but {yi.shape[0]} labels")
        splits[split] = (torch.tensor(xi, dtype=torch.float32)[:, None], torch.tensor(yi, dtype=torch.long))
    tx, vx = _normalise(splits["train"][0], splits["val"][0])
    return ImageData({"train": (tx, splits["train"][1]), "val": (vx, splits["val"][1])}, seed)
