"""Lightning data modules: digits, CIFAR-10, Fashion-MNIST, ImageNet (classification); CamVid and
Fashion scenes (segmentation).

Every module has ``num_classes``, ``in_channels`` and ``task`` (``"classification"`` or
``"segmentation"``), readable right after construction, and checks its folders at construction:
``lgc.train.train`` builds the data module in the launching process, so a bad path is reported
before any worker process starts.

Training data of the classification modules is split among the data-parallel workers by
:class:`lgc.data.PartitionSampler`: ``partition="iid"`` (default; a fresh disjoint random shard
per rank every epoch, like Lightning's ``DistributedSampler``) or ``partition="dirichlet"``
(non-IID label skew with concentration ``alpha``). Validation and test data: the whole set in
order, sharded across ranks so that every sample is scored exactly once
(:mod:`lgc.data.eval_shard`; Lightning's own sharding scores some samples twice).

Training loaders are torchdata's ``StatefulDataLoader`` over a stateful
:class:`~lgc.data.PartitionSampler`: Lightning saves their position in every checkpoint, so a run
resumed from a mid-epoch checkpoint reads the same batches as one that never stopped.

Why one module: every task's data module (digits, CIFAR-10, Fashion-MNIST, ImageNet, CamVid,
Fashion scenes) shares the resumable loader, the per-worker partition and the evaluation loader;
each is short, and they are read side by side.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lgc.data.camvid import (
    CAMVID_CLASSES,
    CAMVID_IGNORE_INDEX,
    CamVidDataset,
    camvid_eval_transform,
    camvid_pairs,
    camvid_train_transform,
)
from lgc.data.cifar10 import check_cifar10_folder, cifar10_transform
from lgc.data.digits import DIGITS_CLASSES, DIGITS_IMAGES, load_digits_split
from lgc.data.eval_shard import CLASS_IGNORE_INDEX, EvalShardSampler, PaddedEvalDataset
from lgc.data.fashion_mnist import fashion_mnist_cache, fashion_mnist_transform, prepare_fashion_mnist
from lgc.data.fashion_scenes import FASHION_SCENE_CLASSES, FashionScenes, check_scene_settings
from lgc.data.folders import require_folder
from lgc.data.imagenet import imagenet_classes, imagenet_eval_transform, imagenet_train_transform
from lgc.data.partition import check_partition, dataset_labels
from lgc.data.sampler import PartitionSampler
from lgc.data.seeded import EpochSeededDataset
from lgc.validation import NonNegativeInt, OpenFraction, PositiveFloat, PositiveInt, RunSeed, check

__all__ = [
    "CIFAR10DataModule",
    "CamVidDataModule",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "FashionScenesDataModule",
    "ImageNetDataModule",
    "require_folder",
]


def _resumable_loader(
    dataset: Dataset, sampler: PartitionSampler, batch_size: int, num_workers: int
) -> StatefulDataLoader:
    """A training loader whose every checkpoint resumes bit-identically, also in mid-epoch.

    * Lightning saves and restores a ``StatefulDataLoader``'s position (the sampler's epoch and
      count, :meth:`lgc.data.PartitionSampler.state_dict`).
    * With ``sampler.keyed`` the samples' random augmentation is seeded by their place in training
      (:class:`lgc.data.EpochSeededDataset`), not by the generator of the process that loads them.
    * The loader's own generator draws the workers' base seed, so creating an iterator never
      consumes the training process's global generator (which checkpoints restore).
    """
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return StatefulDataLoader(
        EpochSeededDataset(dataset, seed) if sampler.keyed else dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def _eval_loader(dataset: Dataset[Any] | None, batch_size: int, num_workers: int, ignore_index: int) -> DataLoader:
    """A validation or test loader: this rank's shard of the whole set in order, every sample scored
    once over all ranks (:mod:`lgc.data.eval_shard`: the positions that pad the ranks to as many
    batches carry ``ignore_index`` as target). Built after the process group exists (Lightning asks
    for it on every rank), so that the sampler sees the real rank."""
    assert dataset is not None, "call setup() first"
    return DataLoader(
        PaddedEvalDataset(dataset, ignore_index),
        batch_size=batch_size,
        sampler=EvalShardSampler(dataset),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


class _ClassificationDataModule(pl.LightningDataModule):
    """Training batches from this rank's partition; validation through Lightning's default sharding.

    Args:
        batch_size: per-worker batch size.
        num_workers: DataLoader worker processes per rank.
        partition: ``"iid"`` or ``"dirichlet"`` (see :class:`lgc.data.PartitionSampler`).
        alpha: Dirichlet concentration (> 0); only read by ``"dirichlet"``.
        partition_seed: seed of the Dirichlet partition, the same on every rank.
    """

    task = "classification"

    def __init__(
        self,
        batch_size: PositiveInt,
        num_workers: NonNegativeInt,
        partition: str = "iid",
        alpha: PositiveFloat = 1.0,
        partition_seed: RunSeed = 0,
    ) -> None:
        super().__init__()
        check("batch_size", batch_size, PositiveInt)
        check("num_workers", num_workers, NonNegativeInt)
        check("partition_seed", partition_seed, RunSeed)
        check_partition(partition, alpha)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.partition = partition
        self.alpha = alpha
        self.partition_seed = partition_seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def train_labels(self) -> np.ndarray:
        """The class of every training sample (after ``setup``), read without loading images."""
        if self.train_set is None:
            raise RuntimeError("call setup() before train_labels()")
        return dataset_labels(self.train_set)

    #: Whether training samples are randomly augmented (then loaded through EpochSeededDataset).
    augments = False

    def train_sampler(self, num_replicas: int | None = None, rank: int | None = None) -> PartitionSampler:
        """This rank's :class:`PartitionSampler`; rank and world size from ``torch.distributed`` by default."""
        if self.train_set is None:
            raise RuntimeError("call setup() before train_sampler()")
        return PartitionSampler(
            self.train_set,
            labels=self.train_labels() if self.partition == "dirichlet" else None,
            partition=self.partition,
            alpha=self.alpha,
            partition_seed=self.partition_seed,
            # The order seed Lightning gives its own DistributedSampler (set by seed_everything).
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            num_replicas=num_replicas,
            rank=rank,
            keyed=self.augments,
        )

    def train_dataloader(self) -> StatefulDataLoader:
        # Built by Lightning after the process group exists, so the sampler sees the real rank.
        assert self.train_set is not None
        return _resumable_loader(self.train_set, self.train_sampler(), self.batch_size, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return _eval_loader(self.val_set, self.batch_size, self.num_workers, CLASS_IGNORE_INDEX)


class DigitsDataModule(_ClassificationDataModule):
    """scikit-learn's 8x8 digits (1 channel, 10 classes), fixed seeded split; needs no files.

    Args:
        batch_size: per-worker batch size.
        val_fraction: share of the 1,797 images held out for validation.
        split_seed: seed of the split (fixed, so every worker and every run sees the same split).
        num_workers: DataLoader worker processes per rank (0: load in the training process).
        partition: ``"iid"`` or ``"dirichlet"`` split of the training set among workers.
        alpha: Dirichlet concentration (> 0), for ``partition="dirichlet"``.
        partition_seed: seed of the Dirichlet partition.
    """

    num_classes = 10
    in_channels = 1

    def __init__(
        self,
        batch_size: PositiveInt = 32,
        val_fraction: OpenFraction = 0.2,
        split_seed: int = 0,
        num_workers: NonNegativeInt = 0,
        partition: str = "iid",
        alpha: PositiveFloat = 1.0,
        partition_seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, partition, alpha, partition_seed)
        check("val_fraction", val_fraction, OpenFraction)
        check("split_seed", split_seed, RunSeed)
        held_out = math.ceil(val_fraction * DIGITS_IMAGES)  # as scikit-learn's split counts it
        if min(held_out, DIGITS_IMAGES - held_out) < DIGITS_CLASSES:
            raise ValueError(
                f"val_fraction={val_fraction} holds out {held_out} of the {DIGITS_IMAGES:,} images: the stratified "
                f"split needs each part to hold at least one image of each of the {DIGITS_CLASSES} classes"
            )
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = load_digits_split(self.val_fraction, self.split_seed)


class _TorchvisionDataModule(_ClassificationDataModule):
    """A torchvision dataset's train split (partitioned) and test split (validation).

    Subclasses set ``root``, ``download`` and ``augment`` and say how to build the dataset
    (:meth:`_dataset`) and its transform (:meth:`_transform`).
    """

    def __init__(
        self,
        root: str,
        download: bool,
        augment: bool,
        batch_size: PositiveInt,
        num_workers: NonNegativeInt,
        partition: str,
        alpha: PositiveFloat,
        partition_seed: int,
    ) -> None:
        super().__init__(batch_size, num_workers, partition, alpha, partition_seed)
        self.root = root
        self.download = download
        self.augment = augment
        self.augments = augment

    def _dataset(self, train: bool, **kwargs: Any) -> Dataset:
        raise NotImplementedError

    def _transform(self, augment: bool) -> Any:
        raise NotImplementedError

    def prepare_data(self) -> None:
        if self.download:
            self._dataset(train=True, download=True)
            self._dataset(train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self._dataset(train=True, transform=self._transform(self.augment))
            self.val_set = self._dataset(train=False, transform=self._transform(augment=False))


class CIFAR10DataModule(_TorchvisionDataModule):
    """CIFAR-10 through torchvision's loader (``root`` holds ``cifar-10-batches-py``).

    Args:
        root: the folder torchvision's ``CIFAR10`` reads; its files are checked at construction
            (torchvision verifies their MD5 checksums when it loads them).
        batch_size: per-worker batch size.
        download: let torchvision download the archive into ``root`` (needs internet).
        augment: random crop with 4-pixel padding and horizontal flips (the standard recipe).
        num_workers: DataLoader worker processes per rank.
        partition: ``"iid"`` or ``"dirichlet"`` split of the training set among workers.
        alpha: Dirichlet concentration (> 0), for ``partition="dirichlet"``.
        partition_seed: seed of the Dirichlet partition.
    """

    num_classes = 10
    in_channels = 3

    def __init__(
        self,
        root: str,
        batch_size: PositiveInt = 128,
        download: bool = False,
        augment: bool = True,
        num_workers: NonNegativeInt = 2,
        partition: str = "iid",
        alpha: PositiveFloat = 1.0,
        partition_seed: int = 0,
    ) -> None:
        folder = Path(root).expanduser() if download else check_cifar10_folder(root)
        super().__init__(str(folder), download, augment, batch_size, num_workers, partition, alpha, partition_seed)

    def _dataset(self, train: bool, **kwargs: Any) -> Dataset:
        from torchvision.datasets import CIFAR10

        return CIFAR10(self.root, train=train, **kwargs)

    def _transform(self, augment: bool) -> Any:
        return cifar10_transform(augment)


class FashionMNISTDataModule(_TorchvisionDataModule):
    """Fashion-MNIST (28x28 grey, 10 classes) through torchvision's own ``FashionMNIST``.

    60,000 training images (partitioned among the workers) and the 10,000 test images for
    validation. The files are found and checked at construction, in the launching process
    (:func:`lgc.data.fashion_mnist.prepare_fashion_mnist`: ``root``, else Debian's
    ``dataset-fashion-mnist`` package), and decompressed into a cache where torchvision needs them so.

    Args:
        root: a folder holding the four IDX files (gzipped or not, or torchvision's
            ``FashionMNIST/raw`` layout); None: the Debian package's folder.
        batch_size: per-worker batch size.
        download: let torchvision download the files (needs internet) into ``root``, or into the
            cache when ``root`` is None.
        augment: random crop of the 2-pixel padded image and horizontal flips.
        cache: where files are decompressed (None: ``$XDG_CACHE_HOME/lgc/fashion_mnist``).
        num_workers: DataLoader worker processes per rank.
        partition: ``"iid"`` or ``"dirichlet"`` split of the training set among workers.
        alpha: Dirichlet concentration (> 0), for ``partition="dirichlet"``.
        partition_seed: seed of the Dirichlet partition.
    """

    num_classes = 10
    in_channels = 1

    def __init__(
        self,
        root: str | None = None,
        batch_size: PositiveInt = 64,
        download: bool = False,
        augment: bool = False,
        cache: str | None = None,
        num_workers: NonNegativeInt = 0,
        partition: str = "iid",
        alpha: PositiveFloat = 1.0,
        partition_seed: int = 0,
    ) -> None:
        if download:
            folder = Path(root if root is not None else (cache or fashion_mnist_cache())).expanduser()
        else:
            folder = prepare_fashion_mnist(root, cache)
        super().__init__(str(folder), download, augment, batch_size, num_workers, partition, alpha, partition_seed)

    def _dataset(self, train: bool, **kwargs: Any) -> Dataset:
        from torchvision.datasets import FashionMNIST

        return FashionMNIST(self.root, train=train, **kwargs)

    def _transform(self, augment: bool) -> Any:
        return fashion_mnist_transform(augment)


class ImageNetDataModule(_ClassificationDataModule):
    """ImageNet, or any ``root/{train,val}/<class>/<image>`` tree, through torchvision's ``ImageFolder``.

    ``num_classes`` is the number of class folders in ``root/train`` (``val`` must hold the same).

    Args:
        root: the folder holding ``train/`` and ``val/``; checked at construction.
        batch_size: per-worker batch size.
        num_classes: expected number of classes (1000 for ImageNet-1k), checked against the
            folders; None accepts what the folders hold.
        train_crop_size: side of the random-resized training crops (224 in the standard recipe).
        val_resize_size: validation images' shorter side is resized to this (256)...
        val_crop_size: ...and the central square of this side is kept (224).
        augment: random-resized crop and flips for training; False trains on the validation crops.
        num_workers: DataLoader worker processes per rank (JPEG decoding is the bottleneck).
        partition: ``"iid"`` or ``"dirichlet"`` split of the training set among workers.
        alpha: Dirichlet concentration (> 0), for ``partition="dirichlet"``.
        partition_seed: seed of the Dirichlet partition.
    """

    in_channels = 3

    def __init__(
        self,
        root: str,
        batch_size: PositiveInt = 256,
        num_classes: int | None = None,
        train_crop_size: int = 224,
        val_resize_size: int = 256,
        val_crop_size: int = 224,
        augment: bool = True,
        num_workers: NonNegativeInt = 8,
        partition: str = "iid",
        alpha: PositiveFloat = 1.0,
        partition_seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, partition, alpha, partition_seed)
        self.root = str(require_folder(root, "ImageNet"))
        self.classes = imagenet_classes(self.root, num_classes)
        # Built here so that bad sizes are reported at construction too.
        self.train_transform = imagenet_train_transform(train_crop_size, augment)
        self.augments = augment
        self.val_transform = imagenet_eval_transform(val_resize_size, val_crop_size)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        from torchvision.datasets import ImageFolder

        if self.train_set is None:
            self.train_set = ImageFolder(str(Path(self.root) / "train"), transform=self.train_transform)
            self.val_set = ImageFolder(str(Path(self.root) / "val"), transform=self.val_transform)


class CamVidDataModule(pl.LightningDataModule):
    """CamVid road scenes (SegNet's 11-class layout): ``(image[3, H, W], mask[H, W])`` batches.

    Pixels labelled ``ignore_index`` (11, void) must be ignored by the loss and the metrics
    (``F.cross_entropy(..., ignore_index=datamodule.ignore_index)``). Training batches are random
    crops of randomly scaled and flipped frames (:func:`lgc.data.camvid_train_transform`);
    validation and test use whole frames. Workers get IID shards (a fresh random split every epoch,
    :class:`lgc.data.PartitionSampler`): a Dirichlet split over labels is not defined for dense labels.

    Args:
        root: the folder holding ``train/``, ``trainannot/``, ``val/``, ``valannot/``, ``test/``,
            ``testannot/``; every split's images and label maps are matched at construction.
        batch_size: per-worker batch size.
        crop_size: ``(height, width)`` of training crops.
        scale_range: random scale of training frames, relative to a shorter side of ``base_size``.
        base_size: shorter side at scale 1 (CamVid's frames are 360x480).
        augment: random scale, crop and flip for training; False trains on whole frames.
        num_workers: DataLoader worker processes per rank.
    """

    num_classes = len(CAMVID_CLASSES)
    in_channels = 3
    ignore_index = CAMVID_IGNORE_INDEX
    task = "segmentation"
    classes = CAMVID_CLASSES

    def __init__(
        self,
        root: str,
        batch_size: PositiveInt = 8,
        crop_size: Sequence[int] = (360, 480),
        scale_range: Sequence[float] = (0.5, 2.0),
        base_size: PositiveInt = 360,
        augment: bool = True,
        num_workers: NonNegativeInt = 2,
    ) -> None:
        super().__init__()
        check("batch_size", batch_size, PositiveInt)
        check("num_workers", num_workers, NonNegativeInt)
        if len(crop_size) != 2 or len(scale_range) != 2:
            raise ValueError(f"crop_size and scale_range take two values, got {crop_size!r} and {scale_range!r}")
        check("base_size", base_size, PositiveInt)
        self.root = str(require_folder(root, "CamVid"))
        for split in ("train", "val", "test"):
            camvid_pairs(self.root, split)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.augment = augment
        self.train_transform = (
            camvid_train_transform((int(crop_size[0]), int(crop_size[1])), (scale_range[0], scale_range[1]), base_size)
            if augment
            else camvid_eval_transform()
        )
        self.eval_transform = camvid_eval_transform()
        self.train_set: CamVidDataset | None = None
        self.val_set: CamVidDataset | None = None
        self.test_set: CamVidDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = CamVidDataset(self.root, "train", self.train_transform)
            self.val_set = CamVidDataset(self.root, "val", self.eval_transform)
            self.test_set = CamVidDataset(self.root, "test", self.eval_transform)

    def _loader(self, dataset: Dataset[Any] | None) -> DataLoader:
        return _eval_loader(dataset, self.batch_size, self.num_workers, self.ignore_index)

    def train_dataloader(self) -> StatefulDataLoader:
        # Built after the process group exists, so that the sampler sees the real rank.
        assert self.train_set is not None
        sampler = PartitionSampler(self.train_set, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), keyed=self.augment)
        return _resumable_loader(self.train_set, sampler, self.batch_size, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)


class FashionScenesDataModule(pl.LightningDataModule):
    """Fashion scenes (:mod:`lgc.data.fashion_scenes`): garments of Fashion-MNIST pasted on a canvas,
    every pixel labelled with the class on top or background (11 labels, none void).

    Training scenes are composed from Fashion-MNIST's training images only, validation scenes from
    its test images only; both are fixed by ``seed`` (not by the run's seed, so runs of different
    seeds are scored on the same scenes). The files are found and checked at construction, as
    :class:`FashionMNISTDataModule` finds them (``root``, else Debian's ``dataset-fashion-mnist``).
    Workers get IID shards of the training scenes (a fresh random split every epoch).

    Args:
        root: a folder holding Fashion-MNIST's four IDX files; None: the Debian package's folder.
        batch_size: per-worker batch size.
        size: the canvas side in pixels.
        garments: ``[fewest, most]`` garments per scene.
        scale: ``[smallest, largest]`` resize factor of a garment's 28 pixels.
        threshold: a garment's pixels brighter than this (of full white) are its shape.
        train_scenes: training scenes (20,000 at 3 garments each uses each training image once on average).
        val_scenes: validation scenes.
        seed: the scenes' seed.
        cache: where files are decompressed (None: ``$XDG_CACHE_HOME/lgc/fashion_mnist``).
        num_workers: DataLoader worker processes per rank.
    """

    num_classes = len(FASHION_SCENE_CLASSES)
    in_channels = 1
    # No pixel is void; the loss and metrics get a label no pixel has.
    ignore_index = 255
    task = "segmentation"
    classes = FASHION_SCENE_CLASSES

    def __init__(
        self,
        root: str | None = None,
        batch_size: PositiveInt = 32,
        size: PositiveInt = 64,
        garments: Sequence[int] = (2, 4),
        scale: Sequence[float] = (0.75, 1.5),
        threshold: float = 0.1,
        train_scenes: PositiveInt = 20_000,
        val_scenes: PositiveInt = 5_000,
        seed: int = 0,
        cache: str | None = None,
        num_workers: NonNegativeInt = 0,
    ) -> None:
        super().__init__()
        check("batch_size", batch_size, PositiveInt)
        check("num_workers", num_workers, NonNegativeInt)
        self.garments, self.scale = check_scene_settings(
            size, garments, scale, threshold, {"train_scenes": train_scenes, "val_scenes": val_scenes}
        )
        self.root = str(prepare_fashion_mnist(root, cache))
        self.batch_size, self.num_workers = batch_size, num_workers
        self.size, self.threshold, self.seed = size, float(threshold), int(seed)
        self.scenes = {"train": train_scenes, "val": val_scenes}
        self.train_set: FashionScenes | None = None
        self.val_set: FashionScenes | None = None

    def _split(self, split: str) -> FashionScenes:
        from torchvision.datasets import FashionMNIST

        garments = FashionMNIST(self.root, train=split == "train")
        return FashionScenes(
            garments.data,
            garments.targets,
            self.scenes[split],
            split,
            seed=self.seed,
            size=self.size,
            garments=self.garments,
            scale=self.scale,
            threshold=self.threshold,
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._split("train"), self._split("val")

    def train_dataloader(self) -> StatefulDataLoader:
        # Built after the process group exists, so that the sampler sees the real rank.
        assert self.train_set is not None
        sampler = PartitionSampler(self.train_set, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        return _resumable_loader(self.train_set, sampler, self.batch_size, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return _eval_loader(self.val_set, self.batch_size, self.num_workers, self.ignore_index)
