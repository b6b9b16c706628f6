"""Exact evaluation across data-parallel ranks: every sample scored once, the same steps on every rank.

Lightning shards a validation set with ``DistributedSampler(shuffle=False)``, which pads every rank
to ``ceil(len / world)`` samples by repeating the set's first ones: with 10,000 images on 3 workers
two images are scored twice, and CamVid's 233 test images on 4 workers score three twice. The
metrics then average over a set that is not the validation set.

:class:`EvalShardSampler` keeps the padding (every rank must run as many batches: under FSDP each
forward pass is a collective) but hands out the padded positions as ``index + len(dataset)``, and
:class:`PaddedEvalDataset` serves such a position as its sample with the target ``ignore_index``
everywhere (a class label, or every pixel of a mask). Metrics that leave ``ignore_index`` out
(torchmetrics' ``ignore_index``, ``F.cross_entropy(..., ignore_index=...)``) then score the
validation set exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["CLASS_IGNORE_INDEX", "EvalShardSampler", "PaddedEvalDataset"]

#: The class label of a padded classification sample (``F.cross_entropy``'s default ``ignore_index``).
CLASS_IGNORE_INDEX = -100


class EvalShardSampler(DistributedSampler):
    """``DistributedSampler(shuffle=False)``'s shards, with every padded position marked.

    Rank ``r`` reads indices ``r, r + world, r + 2 world, ...`` of the set, then of its repetition,
    as ``DistributedSampler`` does; an index ``i`` read a second time (the padding) is yielded as
    ``i + len(dataset)``, which :class:`PaddedEvalDataset` serves with an ignored target. Every
    rank yields ``ceil(len(dataset) / world)`` indices.

    Why a ``DistributedSampler`` subclass: Lightning (``use_distributed_sampler=True``) replaces
    the sampler of every evaluation loader by its own ``DistributedSampler`` unless it already is
    one.

    Args:
        dataset: the evaluation set (only its length is read).
        num_replicas: number of ranks; by default ``torch.distributed``'s world size, or 1 when it
            is not initialized.
        rank: this rank; by default ``torch.distributed``'s, or 0.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        for position in range(self.rank, self.total_size, self.num_replicas):
            # Position p of the padded list holds sample p % size; p >= size is a repetition.
            yield position if position < size else position % size + size


class PaddedEvalDataset(Dataset):
    """``dataset`` as :class:`EvalShardSampler` reads it: ``i + len(dataset)`` is sample ``i`` ignored.

    Samples are ``(input, target)`` pairs. A padded one keeps its input (the model runs on it, so
    every rank runs the same batches) and gets ``ignore_index`` as target: an integer label becomes
    ``ignore_index``, a tensor target (a label or a segmentation mask) is filled with it, so that
    padded and real samples batch together.

    Args:
        dataset: the evaluation set.
        ignore_index: the target the metrics and the loss leave out (:data:`CLASS_IGNORE_INDEX` for
            classification; the data module's void label for segmentation).
    """

    def __init__(self, dataset: Dataset[Any], ignore_index: int) -> None:
        self.dataset = dataset
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        size = len(self)
        if not 0 <= index < 2 * size:
            raise IndexError(f"index {index} is outside the set of {size} samples and its padding")
        if index < size:
            return self.dataset[index]
        sample, target = self.dataset[index - size]
        if isinstance(target, torch.Tensor):  # a label tensor (0-dim) or a mask: the same type and shape
            return sample, torch.full_like(target, self.ignore_index)
        return sample, self.ignore_index
