"""The sampler that gives each data-parallel rank its own partition of the training set."""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lgc.data.partition import check_partition, dirichlet_partition, iid_partition, resample_to_length
from lgc.data.seeded import sample_key

__all__ = ["PartitionSampler"]


class PartitionSampler(DistributedSampler):
    """This rank's indices of an IID or Dirichlet (non-IID) partition, the same number on every rank.

    * ``partition="iid"``: every epoch a fresh permutation of the whole dataset (seeded with
      ``seed + epoch``) is dealt out round-robin (:func:`lgc.data.iid_partition`), as
      ``DistributedSampler(shuffle=True)`` does.
    * ``partition="dirichlet"``: a fixed non-IID partition (:func:`lgc.data.dirichlet_partition`
      with ``alpha`` and ``partition_seed``), computed identically on every rank from the labels;
      each epoch the rank reads its own shard in a new order.

    Equal steps on every rank: Dirichlet shards differ in size, and a rank that runs out of
    batches early would leave the others waiting in DDP's allreduce forever. So every rank yields
    exactly ``ceil(len(dataset) / num_replicas)`` indices per epoch (``DistributedSampler``'s
    length, so an epoch has as many steps under both partitions): a larger shard contributes a
    fresh random subset each epoch, a smaller one is cycled in whole shuffled passes
    (:func:`lgc.data.resample_to_length`). The label mix of each worker is kept; what changes is
    how often a worker sees each of its samples.

    Why a ``DistributedSampler`` subclass: Lightning (``Trainer(use_distributed_sampler=True)``, the
    default) replaces the sampler of every training ``DataLoader`` with its own
    ``DistributedSampler`` unless the sampler already is one
    (``pytorch_lightning/trainer/connectors/data_connector.py``, ``_requires_distributed_sampler``),
    and it calls ``set_epoch`` on it at the start of every epoch.

    Args:
        dataset: the training set (only its length is read).
        labels: the class of every sample; needed by ``"dirichlet"``
            (:func:`lgc.data.dataset_labels` reads them without loading images).
        partition: ``"iid"`` or ``"dirichlet"``.
        alpha: Dirichlet concentration (> 0; small is skewed, about 100 is close to IID).
        partition_seed: seed of the Dirichlet partition (the same on every rank and every run).
        seed: seed of the order within an epoch (Lightning passes ``PL_GLOBAL_SEED``).
        num_replicas: number of ranks; by default the world size of ``torch.distributed``, or 1
            when it is not initialized.
        rank: this rank; by default ``torch.distributed``'s, or 0.
        min_shard_size: the fewest samples a Dirichlet shard may hold (re-drawn otherwise; 10 as
            NIID-Bench's ``min_require_size``, so that no worker trains on a handful of samples).
        keyed: hand out :func:`lgc.data.seeded.sample_key` keys (which sample, and which draw of
            this rank it is) instead of plain indices, for :class:`lgc.data.EpochSeededDataset`,
            whose random augmentation then does not depend on which process loads the sample.

    Example::

        >>> sampler = PartitionSampler(train_set, dataset_labels(train_set), partition="dirichlet", alpha=0.1)
        >>> loader = StatefulDataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)

    It is stateful (:meth:`state_dict`: epoch and position), so torchdata's ``StatefulDataLoader``
    resumes it mid-epoch exactly; a plain ``DataLoader`` works too but restarts epochs.
    """

    def __init__(
        self,
        dataset: Sized,
        labels: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        partition: str = "iid",
        alpha: float = 1.0,
        partition_seed: int = 0,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        min_shard_size: int = 10,
        keyed: bool = False,
    ) -> None:
        check_partition(partition, alpha)
        distributed = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        # drop_last=False: num_samples = ceil(len / num_replicas), the length every rank yields.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.partition = partition
        self.alpha = alpha
        self.partition_seed = partition_seed
        self.keyed = keyed
        # Indices of the current epoch handed out so far, and where a restored iterator starts.
        self.yielded = 0
        self._resume_at = 0
        # The fixed Dirichlet shard of this rank (None under IID, whose shards change every epoch).
        self.shard: np.ndarray | None = None
        # Every rank's shard size, for reporting how uneven the partition is.
        self.shard_sizes: list[int] = [
            len(dataset) // num_replicas + (r < len(dataset) % num_replicas) for r in range(num_replicas)
        ]
        if partition == "dirichlet":
            if labels is None:
                raise ValueError("partition='dirichlet' needs the labels of the training set")
            if len(labels) != len(dataset):
                raise ValueError(f"got {len(labels)} labels for a dataset of {len(dataset)} samples")
            shards = dirichlet_partition(labels, num_replicas, alpha, partition_seed, min_size=min_shard_size)
            self.shard = shards[rank]
            self.shard_sizes = [len(shard) for shard in shards]

    def indices(self, epoch: int) -> np.ndarray:
        """The indices this rank reads in ``epoch``, in order (``num_samples`` of them)."""
        if self.shard is None:
            shard = iid_partition(len(self.dataset), self.num_replicas, self.seed + epoch)[self.rank]
        else:
            shard = self.shard
        # Seeded by (seed, epoch, rank): reproducible, different on every rank and every epoch.
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        return resample_to_length(shard, self.num_samples, rng)

    def __iter__(self) -> Iterator[int]:
        # A generator: the epoch is read at the first index, after Lightning's ``set_epoch`` (a
        # restored data loader creates its iterator before that call).
        skip, self._resume_at = self._resume_at, 0
        self.yielded = skip
        size = len(self.dataset)
        for index in self.indices(self.epoch)[skip:].tolist():
            draw = self.epoch * self.num_samples + self.yielded
            self.yielded += 1
            yield sample_key(draw, index, size) if self.keyed else index

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: the epoch and how many indices of it were handed out.

        With torchdata's ``StatefulDataLoader`` (which Lightning checkpoints and restores) a run
        resumed from a mid-epoch checkpoint goes on with the next sample, not with the epoch's first.
        """
        return {"epoch": int(self.epoch), "yielded": int(self.yielded), "replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on from ``state`` (from :meth:`state_dict` of any rank of the same partition).

        Lightning writes rank 0's loader state and loads it on every rank; that is exact here because
        the state is the same on every rank (every rank yields as many indices per epoch).
        """
        if state.get("replicas") != self.num_replicas:
            raise ValueError(
                f"sampler state of a {state.get('replicas')}-worker run cannot resume a {self.num_replicas}-worker run"
            )
        if not 0 <= state["yielded"] <= self.num_samples:
            raise ValueError(f"sampler state yielded={state['yielded']} is outside 0..{self.num_samples}")
        self.set_epoch(int(state["epoch"]))
        self._resume_at = int(state["yielded"])

    def __len__(self) -> int:
        return self.num_samples
