"""CIFAR-10 as torchvision reads it (``root/cifar-10-batches-py``) and its standard transforms."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.transforms import v2

from lgc.data.folders import require_files, require_folder

__all__ = ["CIFAR10_FILES", "CIFAR10_MEAN", "CIFAR10_STD", "check_cifar10_folder", "cifar10_transform"]

#: The files of the python version of CIFAR-10, as torchvision's ``CIFAR10`` expects them.
CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
#: Per-channel mean and standard deviation of the 50,000 training images.
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def check_cifar10_folder(root: str | Path) -> Path:
    """``root`` as a Path, or an error naming the missing folder or file.

    Only presence is checked here (cheap, in the launching process); torchvision's ``CIFAR10``
    verifies every file's MD5 checksum when it loads them.
    """
    path = require_folder(root, "CIFAR-10")
    batches = require_folder(path / "cifar-10-batches-py", "CIFAR-10 (python version)")
    require_files(batches, CIFAR10_FILES, "CIFAR-10")
    return path


def cifar10_transform(augment: bool) -> v2.Compose:
    """PIL image -> normalized float tensor; ``augment`` adds the standard random crop and flip.

    The augmentation of He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016),
    section 4.2: pad 4 pixels on each side, take a random 32x32 crop, flip horizontally at random.
    """
    augmentation = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if augment else []
    to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    return v2.Compose([*augmentation, *to_tensor])
