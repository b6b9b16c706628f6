"""Splitting a training set among data-parallel workers: IID shards and Dirichlet label skew.

Pure functions of ``(labels or size, workers, seed)``: every rank calls them with the same
arguments and gets the same partition without any communication. :class:`lgc.data.PartitionSampler`
turns a partition into the indices one rank reads.

* :func:`iid_partition`: a random permutation dealt out round-robin, the assignment of
  ``torch.utils.data.DistributedSampler(shuffle=True)`` before it pads.
* :func:`dirichlet_partition`: non-IID label skew by the recipe of Hsu, Qi and Brown, "Measuring
  the Effects of Non-Identical Data Distribution for Federated Visual Classification"
  (arXiv:1909.06335, 2019) in the form most code uses (Li et al., NIID-Bench, ICDE 2022): each
  class's samples are split among the workers in proportions drawn from a symmetric Dirichlet
  distribution ``Dir(alpha)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lgc.validation import PositiveFloat, PositiveInt, check

__all__ = [
    "PARTITIONS",
    "check_partition",
    "dataset_labels",
    "dirichlet_partition",
    "iid_partition",
    "label_histogram",
    "resample_to_length",
]

#: Names accepted by the ``partition`` knob of the data modules.
PARTITIONS = ("iid", "dirichlet")


def check_partition(partition: str, alpha: PositiveFloat) -> None:
    """Raise ``ValueError`` naming the value when ``partition`` or ``alpha`` is not usable."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")
    check("alpha", alpha, PositiveFloat)


def iid_partition(num_samples: int, num_workers: PositiveInt, seed: int) -> list[np.ndarray]:
    """Disjoint random shards that together cover ``range(num_samples)``.

    Shard sizes differ by at most one. The assignment is ``DistributedSampler``'s with
    ``shuffle=True`` and this ``seed`` (``torch.randperm`` dealt out round-robin), without its padding.

    Args:
        num_samples: size of the dataset.
        num_workers: number of shards (data-parallel workers).
        seed: seed of the permutation; ``DistributedSampler`` uses ``seed + epoch``.

    Returns:
        ``num_workers`` int64 index arrays, shard ``w`` for worker ``w``.
    """
    check("num_workers", num_workers, PositiveInt)
    permutation = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).numpy()
    return [permutation[worker::num_workers] for worker in range(num_workers)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray | torch.Tensor,
    num_workers: PositiveInt,
    alpha: PositiveFloat,
    seed: int,
    min_size: int = 1,
    max_draws: int = 1000,
) -> list[np.ndarray]:
    """Non-IID shards: each class is split among the workers in ``Dir(alpha)`` proportions.

    Algorithm (Hsu et al. 2019, as in NIID-Bench's ``partition_data`` for ``noniid-labeldir``, less its
    cap that stops giving a class to workers that already hold ``N / W`` samples: shard sizes are
    evened out by the sampler instead, which keeps the drawn label mix intact):

    1. For every class ``c``, shuffle the indices of its samples.
    2. Draw proportions ``p ~ Dir(alpha * 1_W)`` and cut the shuffled indices at
       ``floor(cumsum(p) * n_c)``: worker ``w`` gets the ``w``-th piece.
    3. If some worker got fewer than ``min_size`` samples in total, draw everything again.

    Tuning ``alpha``: 100 and more is close to IID; 1 gives a visibly uneven mix; 0.1 leaves most
    workers with one or two dominant classes (the setting most papers call "highly non-IID").
    Shard sizes differ too (a worker may get much more data than another); the sampler evens
    that out (see :class:`lgc.data.PartitionSampler`).

    Args:
        labels: the class of every sample, in dataset order.
        num_workers: number of shards.
        alpha: Dirichlet concentration, > 0.
        seed: seed of the shuffles and draws; the same seed gives the same shards on every rank.
        min_size: the fewest samples a worker may get; small ``alpha`` with many workers and few
            samples may need several draws.
        max_draws: give up (``ValueError``) after this many draws.

    Returns:
        ``num_workers`` sorted int64 index arrays, disjoint and covering every sample.
    """
    check_partition("dirichlet", alpha)
    check("num_workers", num_workers, PositiveInt)
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one label per sample (1-D), got shape {labels.shape}")
    if len(labels) < num_workers * min_size:
        raise ValueError(f"{len(labels)} samples cannot give {num_workers} workers {min_size} sample(s) each")
    # Group the indices by class once (argsort), instead of one scan of all labels per class.
    order = np.argsort(labels, kind="stable")
    boundaries = np.flatnonzero(np.diff(labels[order])) + 1
    per_class = np.split(order, boundaries)
    rng = np.random.default_rng(seed)
    for _ in range(max_draws):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
        for indices in per_class:
            shuffled = rng.permutation(indices)
            proportions = rng.dirichlet(np.full(num_workers, float(alpha)))
            cuts = (np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
            for worker, piece in enumerate(np.split(shuffled, cuts)):
                pieces[worker].append(piece)
        shards = [np.sort(np.concatenate(worker_pieces)).astype(np.int64) for worker_pieces in pieces]
        if min(len(shard) for shard in shards) >= min_size:
            return shards
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) partition of {len(labels)} samples gave each of {num_workers} workers "
        f"{min_size} sample(s) in {max_draws} draws; use a larger alpha or fewer workers"
    )


def resample_to_length(indices: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """``length`` indices drawn from ``indices``: a random subset, or whole shuffled passes cycled.

    A shard longer than ``length`` yields a fresh random subset without repeats; a shorter one is
    repeated in whole shuffled passes and topped up with part of one more, so every index appears
    ``floor`` or ``ceil`` of ``length / len(indices)`` times (as even as repeating can be).
    """
    if len(indices) == 0:
        raise ValueError("cannot draw from an empty shard")
    passes = -(-length // len(indices))
    return np.concatenate([rng.permutation(indices) for _ in range(passes)])[:length]


def label_histogram(labels: Sequence[int] | np.ndarray, shards: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Samples per (worker, class): an int64 array of shape ``[len(shards), num_classes]``."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[shard], minlength=num_classes) for shard in shards])


def dataset_labels(dataset: Dataset[Any]) -> np.ndarray:
    """The class of every sample of a classification dataset, without loading any image.

    Reads ``dataset.targets`` (torchvision's ``CIFAR10``, ``ImageFolder``) or the second tensor of
    a ``TensorDataset``; ``Subset`` is followed to its dataset.
    """
    if isinstance(dataset, torch.utils.data.Subset):
        return dataset_labels(dataset.dataset)[np.asarray(dataset.indices)]
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return np.asarray(targets)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[1].cpu().numpy()
    raise TypeError(
        f"cannot read the labels of a {type(dataset).__name__} without loading it; "
        "give it a .targets attribute or pass the labels explicitly"
    )
