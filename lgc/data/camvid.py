"""CamVid road-scene segmentation in SegNet's layout, with joint image/mask transforms.

The widely used 11-class version prepared by Badrinarayanan et al. for SegNet (TPAMI 2017):
``root/{train,val,test}/*.png`` (367/101/233 RGB frames of 360x480) and
``root/{train,val,test}annot/*.png`` (label maps of the same file names, one byte per pixel:
0-10 are the classes below, 11 is void and ignored by the loss and the metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from lgc.data.folders import require_folder
from lgc.data.imagenet import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "CAMVID_CLASSES",
    "CAMVID_IGNORE_INDEX",
    "CAMVID_SPLITS",
    "CamVidDataset",
    "camvid_eval_transform",
    "camvid_pairs",
    "camvid_train_transform",
]

#: The 11 classes of SegNet's CamVid, in label order.
CAMVID_CLASSES = (
    "sky",
    "building",
    "pole",
    "road",
    "pavement",
    "tree",
    "sign_symbol",
    "fence",
    "car",
    "pedestrian",
    "bicyclist",
)
#: Label of void pixels: no loss, not counted by metrics (``ignore_index``).
CAMVID_IGNORE_INDEX = 11
CAMVID_SPLITS = ("train", "val", "test")


def camvid_pairs(root: str | Path, split: str) -> list[tuple[Path, Path]]:
    """``(image, label map)`` paths of ``split``, matched by file name; errors name the bad path.

    Raises ``FileNotFoundError`` when ``root``, ``root/<split>`` or ``root/<split>annot`` is
    missing or holds no PNG, and ``ValueError`` naming files that have no partner.
    """
    if split not in CAMVID_SPLITS:
        raise ValueError(f"split must be one of {', '.join(CAMVID_SPLITS)}; got {split!r}")
    path = require_folder(root, "CamVid")
    images_dir = require_folder(path / split, f"CamVid {split} images")
    labels_dir = require_folder(path / f"{split}annot", f"CamVid {split} label maps")
    images = {p.name: p for p in images_dir.glob("*.png")}
    labels = {p.name: p for p in labels_dir.glob("*.png")}
    if not images:
        raise FileNotFoundError(f"CamVid {split} image folder {str(images_dir)!r} holds no .png file")
    if images.keys() != labels.keys():
        no_label = sorted(images.keys() - labels.keys())[:5]
        no_image = sorted(labels.keys() - images.keys())[:5]
        raise ValueError(
            f"CamVid {split}: images in {str(images_dir)!r} and label maps in {str(labels_dir)!r} do not match "
            f"(no label map for {no_label}, no image for {no_image})"
        )
    return [(images[name], labels[name]) for name in sorted(images)]


class CamVidDataset(Dataset[tuple[Tensor, Tensor]]):
    """``(image[3, H, W] float, mask[H, W] int64)`` pairs of one CamVid split.

    Args:
        root: the folder holding ``train/``, ``trainannot/``, ``val/``, ... (checked here).
        split: ``"train"``, ``"val"`` or ``"test"``.
        transform: a joint transform ``(tv_tensors.Image, tv_tensors.Mask) -> (image, mask)``
            (:func:`camvid_train_transform`, :func:`camvid_eval_transform`); it must turn the
            uint8 image into a float tensor.
    """

    def __init__(self, root: str | Path, split: str, transform: Callable[..., Any] | None = None) -> None:
        self.pairs = camvid_pairs(root, split)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image_path, label_path = self.pairs[index]
        with Image.open(image_path) as image_file:
            image = tv_tensors.Image(torch.from_numpy(np.array(image_file.convert("RGB"))).permute(2, 0, 1))
        with Image.open(label_path) as label_file:
            # Indexed ("P") label maps hold class numbers as palette indices; RGB ones are the
            # original 32-class colour coding, a different dataset layout.
            if label_file.mode not in ("L", "P"):
                raise ValueError(
                    f"CamVid label map {str(label_path)!r} has PIL mode {label_file.mode!r}; expected one class "
                    "number per pixel (mode 'L' or 'P', SegNet's 11-class layout)"
                )
            mask = tv_tensors.Mask(torch.from_numpy(np.array(label_file)))
        if image.shape[-2:] != mask.shape:
            raise ValueError(
                f"CamVid image {str(image_path)!r} is {tuple(image.shape[-2:])} pixels but its label map "
                f"{str(label_path)!r} is {tuple(mask.shape)}"
            )
        if int(mask.max()) > CAMVID_IGNORE_INDEX:
            raise ValueError(
                f"CamVid label map {str(label_path)!r} holds label {int(mask.max())}; expected 0-10 and "
                f"{CAMVID_IGNORE_INDEX} (void)"
            )
        if self.transform is not None:
            image, mask = self.transform(image, mask)
        return image.as_subclass(Tensor), mask.as_subclass(Tensor).long()


def _to_normalized_tensor() -> list[v2.Transform]:
    # Only the image is scaled and normalized; v2 passes the mask through these unchanged.
    return [
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]


def camvid_train_transform(
    crop_size: tuple[int, int] = (360, 480), scale_range: tuple[float, float] = (0.5, 2.0), base_size: int = 360
) -> v2.Compose:
    """Random scale, random crop (padding with void) and horizontal flip, the same for image and mask.

    The recipe of torchvision's segmentation reference (and of PSPNet, Zhao et al. CVPR 2017):
    resize the shorter side to a random length in ``scale_range * base_size``, crop ``crop_size``
    at a random place (padding images with 0 and masks with the ignore index where the scaled
    frame is smaller), flip both horizontally with probability 1/2. torchvision's v2 transforms
    draw one set of random parameters per call and apply it to every input; masks are resized
    with nearest-neighbour interpolation, so no label is ever blended into another.

    Args:
        crop_size: ``(height, width)`` of the training crops.
        scale_range: smallest and largest scale relative to ``base_size``.
        base_size: the shorter side at scale 1 (CamVid's frames are 360x480).
    """
    low, high = scale_range
    if not 0 < low <= high:
        raise ValueError(f"scale_range must be 0 < low <= high, got {tuple(scale_range)!r}")
    height, width = crop_size
    if height < 1 or width < 1:
        raise ValueError(f"crop_size must be positive (height, width), got {tuple(crop_size)!r}")
    return v2.Compose(
        [
            # RandomResize draws from [min_size, max_size): + 1 makes the upper scale reachable.
            v2.RandomResize(max(1, round(low * base_size)), round(high * base_size) + 1),
            v2.RandomCrop(
                (height, width), pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: CAMVID_IGNORE_INDEX}
            ),
            v2.RandomHorizontalFlip(),
            *_to_normalized_tensor(),
        ]
    )


def camvid_eval_transform() -> v2.Compose:
    """Whole frames, normalized (evaluation at full resolution, as SegNet and PSPNet report)."""
    return v2.Compose(_to_normalized_tensor())
