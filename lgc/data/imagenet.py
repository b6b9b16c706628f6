"""ImageNet (or any ImageFolder tree with ``train/`` and ``val/``) and its standard transforms.

Layout: ``root/train/<class>/<image>`` and ``root/val/<class>/<image>`` (the validation images
sorted into class folders, as e.g. the PyTorch ImageNet example expects). Classes are numbered
by sorted folder name, as torchvision's ``ImageFolder`` does, and both splits must hold the same
class folders, so that a label means the same class in both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.datasets.folder import find_classes
from torchvision.transforms import v2

from lgc.data.folders import require_folder

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "imagenet_classes", "imagenet_eval_transform", "imagenet_train_transform"]

#: Per-channel mean and standard deviation of ImageNet's training images (torchvision's values).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def imagenet_classes(root: str | Path, num_classes: int | None = None) -> list[str]:
    """The class folder names of ``root/train`` (sorted), checked against ``root/val`` and ``num_classes``.

    Lists only the two class levels (no image is opened or counted), so it is cheap enough to run
    in the launching process. Raises ``FileNotFoundError`` naming a missing folder and
    ``ValueError`` naming mismatching class folders or a class count other than ``num_classes``.
    """
    path = require_folder(root, "ImageNet")
    splits = {split: require_folder(path / split, f"ImageNet {split}") for split in ("train", "val")}
    classes = {}
    for split, folder in splits.items():
        try:
            classes[split], _ = find_classes(folder)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"ImageNet {split} folder {str(folder)!r} holds no class folders") from err
    if classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))[:5]
        only_val = sorted(set(classes["val"]) - set(classes["train"]))[:5]
        raise ValueError(
            f"{str(splits['train'])!r} and {str(splits['val'])!r} hold different class folders "
            f"(only in train: {only_train}, only in val: {only_val})"
        )
    if num_classes is not None and num_classes != len(classes["train"]):
        raise ValueError(
            f"num_classes={num_classes} but {str(splits['train'])!r} holds {len(classes['train'])} classes"
        )
    return classes["train"]


def _to_normalized_tensor() -> list[v2.Transform]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def imagenet_train_transform(crop_size: int = 224, augment: bool = True) -> v2.Compose:
    """Random-resized crop to ``crop_size`` and horizontal flip, then normalize.

    The Inception-style crop (Szegedy et al. 2015: 8-100 % of the area, aspect ratio 3/4-4/3) of
    torchvision's ImageNet reference recipe. ``augment=False`` takes the evaluation path instead.
    """
    if not augment:
        return imagenet_eval_transform(resize_size=round(crop_size * 256 / 224), crop_size=crop_size)
    return v2.Compose([v2.RandomResizedCrop(crop_size), v2.RandomHorizontalFlip(), *_to_normalized_tensor()])


def imagenet_eval_transform(resize_size: int = 256, crop_size: int = 224) -> v2.Compose:
    """Resize the shorter side to ``resize_size``, take the central ``crop_size`` square, normalize."""
    if crop_size > resize_size:
        raise ValueError(f"val_crop_size={crop_size} must not exceed val_resize_size={resize_size}")
    return v2.Compose([v2.Resize(resize_size), v2.CenterCrop(crop_size), *_to_normalized_tensor()])
