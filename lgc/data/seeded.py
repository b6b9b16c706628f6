"""Random augmentation that is a function of the sample's place in training, not of process history.

A resumed run must augment every sample exactly as an uninterrupted one. The random transforms of
torchvision draw from the torch generator of whichever process loads the sample: the training
process, or a DataLoader worker whose generator cannot be checkpointed and is reseeded whenever
workers start. :class:`EpochSeededDataset` makes each draw independent of that history: the sampler
(:class:`lgc.data.PartitionSampler` with ``keyed=True``) hands out keys that say which sample this
is *and* which draw of the rank's epoch, and the dataset loads the sample under a torch generator
seeded from ``(seed, draw, index)``. The same key gives the same augmented sample in any process,
with any number of loader workers, before or after a restart.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["EpochSeededDataset", "sample_key", "split_key"]


def sample_key(draw: int, index: int, dataset_size: int) -> int:
    """The key of the ``draw``-th sample a rank reads (counted over epochs), which is ``index``."""
    return draw * dataset_size + index


def split_key(key: int, dataset_size: int) -> tuple[int, int]:
    """``(draw, index)`` of a :func:`sample_key`."""
    return divmod(int(key), dataset_size)


class EpochSeededDataset(Dataset):
    """``dataset[index]`` for key ``sample_key(draw, index)``, augmented under a generator seeded by the key.

    The process's own generator is left as it was (``torch.random.fork_rng``), so loading in the
    training process does not disturb the model's random draws.

    Args:
        dataset: a map-style dataset whose transforms draw from torch's generator (torchvision's do).
        seed: the run's seed (every rank the same; ranks read different draws).
    """

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"EpochSeededDataset needs a map-style dataset with a length, got {type(dataset).__name__}")
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int) -> Any:
        draw, index = split_key(key, len(self.dataset))
        seed = int(np.random.SeedSequence([self.seed, draw, index]).generate_state(1, dtype=np.uint64)[0] >> 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]
