"""Lightning data modules. Worker sharding is Lightning's ``DistributedSampler``."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset

from lgc.data.digits import load_digits_split

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "require_folder"]


def require_folder(root: str | Path, what: str) -> Path:
    """``root`` as a Path, or a clear error naming it when it is not an existing folder."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{what} data folder {str(path)!r} does not exist; set data.root to the dataset folder")
    return path


class _ClassificationDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int, num_workers: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class DigitsDataModule(_ClassificationDataModule):
    """scikit-learn's 8x8 digits (1 channel, 10 classes), fixed seeded split; needs no files.

    Args:
        batch_size: per-worker batch size.
        val_fraction: share of the 1,797 images held out for validation.
        split_seed: seed of the split (fixed, so every worker and every run sees the same split).
    """

    num_classes = 10
    in_channels = 1

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0, num_workers: int = 0):
        super().__init__(batch_size, num_workers)
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = load_digits_split(self.val_fraction, self.split_seed)


class CIFAR10DataModule(_ClassificationDataModule):
    """CIFAR-10 through torchvision's loader (``root`` holds ``cifar-10-batches-py``).

    Args:
        root: the folder torchvision's ``CIFAR10`` reads; checked before any worker starts.
        download: let torchvision download the archive (needs internet).
        augment: random crop with 4-pixel padding and horizontal flips (the standard recipe).
    """

    num_classes = 10
    in_channels = 3
    _MEAN, _STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

    def __init__(
        self, root: str, batch_size: int = 128, download: bool = False, augment: bool = True, num_workers: int = 2
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.root = str(root) if download else str(require_folder(root, "CIFAR-10"))
        self.download = download
        self.augment = augment

    def prepare_data(self) -> None:
        if self.download:
            from torchvision.datasets import CIFAR10

            CIFAR10(self.root, train=True, download=True)
            CIFAR10(self.root, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        from torchvision import transforms as T
        from torchvision.datasets import CIFAR10

        normalize = [T.ToTensor(), T.Normalize(self._MEAN, self._STD)]
        train_tf = T.Compose(
            ([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if self.augment else []) + normalize
        )
        self.train_set = CIFAR10(self.root, train=True, transform=train_tf)
        self.val_set = CIFAR10(self.root, train=False, transform=T.Compose(normalize))
