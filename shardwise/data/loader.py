"""A person's own Dataset, split over the data-parallel ranks, with a resumable position.

    loader = engine.loader(dataset, batch_size=32)      # 32 = the global batch
    for batch in loader:                                # one epoch, from where it stands
        engine.train_step(batch["x"], batch["y"])
    state = loader.state_dict()                         # save beside the checkpoint
    loader.load_state_dict(state)                       # a new run continues with the next batch

The same rule as the built-in data (shardwise/data/sampler.py): epoch ``e`` visits the dataset
in the order ``epoch_permutation(len, seed, e)`` (or 0..n-1 without shuffling), cut into global
batches of ``batch_size`` indices; data-parallel rank r of D takes rows [r*B/D, (r+1)*B/D) of
each. So the ranks' batches together are exactly the batch one process would see, whatever D,
and a position (epoch, batches done) names every later batch. The last global batch of an epoch
that would be short is dropped, so every rank takes as many rows at every step. Each rank reads
only its own items (``dataset[i]``), collated by ``collate_fn`` (torch's default: dicts and
tuples of tensors stay dicts and tuples) in a torch DataLoader (``num_workers``).
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from shardwise.data.sampler import epoch_permutation, shard_rows


class ShardedLoader:
    """Global batches of a map-style ``dataset`` (``len`` and ``dataset[i]``), this rank's rows."""

    def __init__(self, dataset, batch_size: int, dp_rank: int, dp_size: int, *,
                 shuffle: bool = True, seed: int = 0, collate_fn=None, num_workers: int = 0):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"loader: {type(dataset).__name__} is not a map-style dataset (len() "
                            "and dataset[i]); fix: give a torch.utils.data.Dataset with both "
                            "(an IterableDataset cannot be split by index)")
        if batch_size < 1 or batch_size % dp_size:
            raise ValueError(f"loader: batch_size {batch_size} must be a positive multiple of the "
                             f"data-parallel size {dp_size} (it is the global batch; each rank "
                             f"takes 1/{dp_size}); fix: use a multiple of {dp_size}")
        if len(dataset) < batch_size:
            raise ValueError(f"loader: the dataset has {len(dataset)} items, fewer than one global "
                             f"batch of {batch_size}; fix: a smaller batch_size")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.rows = shard_rows(batch_size, dp_rank, dp_size)
        self.collate_fn, self.num_workers = collate_fn, num_workers
        self.epoch, self.done = 0, 0          # the position: batches done in this epoch
        self._order = (None, None)

    def __len__(self) -> int:
        """Global batches per epoch (the short last one dropped)."""
        return len(self.dataset) // self.batch_size

    def indices(self, epoch: int, step: int) -> list[int]:
        """This rank's dataset indices in batch ``step`` of ``epoch``."""
        if self._order[0] != epoch:           # one permutation per epoch, kept while it runs
            n = len(self.dataset)
            order = epoch_permutation(n, self.seed, epoch) if self.shuffle else torch.arange(n)
            self._order = (epoch, order)
        start = step * self.batch_size
        return self._order[1][start:start + self.batch_size][self.rows].tolist()

    def __iter__(self):
        """The rest of the current epoch; afterwards the position is the next epoch's start."""
        sampler = _Batches(self, self.epoch, self.done)
        kwargs = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        for batch in DataLoader(self.dataset, batch_sampler=sampler,
                                num_workers=self.num_workers, **kwargs):
            self.done += 1                    # counted as batches come out (workers prefetch)
            yield batch
        self.epoch, self.done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.done, "seed": self.seed,
                "batch_size": self.batch_size, "dataset_len": len(self.dataset),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position; refused when the order it names would differ."""
        for key in ("seed", "batch_size", "dataset_len", "shuffle"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(f"loader.load_state_dict: {key} is {mine}, the state was saved "
                                 f"with {state[key]}, so its position names other batches; fix: "
                                 f"build the loader with the same {key}")
        self.epoch, self.done = state["epoch"], state["batches_done"]


class _Batches(Sampler):
    """The index lists of one epoch from batch ``start`` on (this rank's rows of each)."""

    def __init__(self, loader: ShardedLoader, epoch: int, start: int):
        self.loader, self.epoch, self.start = loader, epoch, start

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.start)

    def __iter__(self):
        for step in range(self.start, len(self.loader)):
            yield self.loader.indices(self.epoch, step)
