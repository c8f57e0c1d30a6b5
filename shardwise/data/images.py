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
    """Read one IDX file (raw or .gz): magic 0x00 0x00 dtype ndim, then big-endian dims, data.
    A damaged file raises ValueError naming the file and what is wrong with it."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:     # gzip: BadGzipFile, a stream cut short
        raise ValueError(f"{os.path.basename(path)} cannot be read ({exc})") from None
    name = os.path.basename(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{name} is not an IDX file (bad magic number)")
    dtype = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.get(raw[2])
    if dtype is None:
        raise ValueError(f"{name} has an unknown IDX data type 0x{raw[2]:02x}")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{name} is cut short inside its header ({len(raw)} bytes)")
    dims = struct.unpack(">" + "I" * ndim, raw[4: 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim, count=-1) \
        if (len(raw) - 4 - 4 * ndim) % np.dtype(dtype).itemsize == 0 else np.zeros(0)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{name} is cut short or padded: its header says "
                         f"{' x '.join(f'{d:,}' for d in dims)} values, it holds {data.size:,}")
    return data.reshape(dims)


def check_idx(images: np.ndarray, labels: np.ndarray, split: str) -> None:
    """One split's arrays as LeNet takes them: (N, 28, 28) images, N labels in 0..9."""
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"the {split} images have shape {images.shape}, not (N, 28, 28) "
                         "(images and labels swapped?)")
    if labels.ndim != 1:
        raise ValueError(f"the {split} labels have shape {labels.shape}, not (N,)")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"the {split} split has {images.shape[0]:,} images but "
                         f"{labels.shape[0]:,} labels")
    if labels.size and not (0 <= int(labels.min()) and int(labels.max()) <= 9):
        raise ValueError(f"the {split} labels run {int(labels.min())}..{int(labels.max())}, "
                         "not 0..9")


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
    """MNIST or Fashion-MNIST from the four standard IDX files in ``data_dir``; a damaged one
    raises ConfigError (data.data_dir, which file, what is wrong)."""
    from shardwise.config import ConfigError
    splits = {}
    try:
        for split, (images, labels) in IDX_FILES.items():
            xi = read_idx(_find(data_dir, images))
            yi = read_idx(_find(data_dir, labels))
            check_idx(xi, yi, split)
            splits[split] = (torch.tensor(xi, dtype=torch.float32)[:, None],
                             torch.tensor(yi.astype(np.int64), dtype=torch.long))
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError("data.data_dir", data_dir, str(exc), "replace the damaged file with "
                          "a fresh copy of the data set's IDX files") from None
    tx, vx = _normalise(splits["train"][0], splits["val"][0])
    return ImageData({"train": (tx, splits["train"][1]), "val": (vx, splits["val"][1])}, seed)
