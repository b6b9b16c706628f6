"""Fashion scenes: a segmentation task composed offline from Fashion-MNIST's real garment images.

Each scene is a ``size x size`` grey canvas (black, like Fashion-MNIST's own background) on which
``garments`` images of Fashion-MNIST are pasted, each resized by a random factor in ``scale`` (of
its 28 pixels) at a random position that keeps it inside the canvas, one after the other. A
garment's shape is its pixels brighter than ``threshold`` (of full white) after resizing; pasting
writes those pixels, image and label together, over whatever lay there, so every pixel is labelled
with the class of the garment seen on top there, or background. Labels: 0 background, ``c + 1``
for Fashion-MNIST's class ``c`` (:data:`FASHION_SCENE_CLASSES`); no pixel is void.

These are real pixels (photographs of garments, Zalando's) in made-up layouts: garments on a plain
background, never natural scenes. What the task asks of a network is what segmentation asks
(find the objects, tell their classes apart, draw their boundaries where they overlap) at a size a
CPU can train on.

Splits never share a garment: training scenes draw only from Fashion-MNIST's 60,000 training
images, validation scenes only from its 10,000 test images. Scene ``i`` of a split is a function of
``(seed, split, i)`` alone (numpy's ``SeedSequence``), so every worker, every run with the same
seed and every resumed run sees the same scenes, whatever order they are read in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from lgc.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD

__all__ = ["FASHION_SCENE_CLASSES", "FashionScenes", "check_scene_settings"]

#: The 11 labels of a scene: background, then Fashion-MNIST's 10 classes in its label order.
FASHION_SCENE_CLASSES = (
    "background",
    "T-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
#: Fashion-MNIST's image side.
GARMENT_SIZE = 28
#: The ids numpy's SeedSequence mixes with the seed and the scene's index, one per split.
_SPLIT_IDS = {"train": 0, "val": 1}


def check_scene_settings(
    size: int, garments: Sequence[int], scale: Sequence[float], threshold: float, scenes: dict[str, int]
) -> tuple[tuple[int, int], tuple[float, float]]:
    """``(garments, scale)`` as pairs, after checking every setting; a ValueError names the bad one.

    ``scenes`` maps each count's setting name (``train_scenes``...) to its value.
    """
    for name, value in {"size": size, **scenes}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if len(garments) != 2 or any(isinstance(g, bool) or not isinstance(g, int) for g in garments):
        raise ValueError(f"garments must be two integers [fewest, most] per scene, got {list(garments)!r}")
    low, high = int(garments[0]), int(garments[1])
    if not 1 <= low <= high:
        raise ValueError(f"garments must satisfy 1 <= fewest <= most, got {[low, high]!r}")
    if len(scale) != 2 or any(isinstance(s, bool) or not isinstance(s, (int, float)) for s in scale):
        raise ValueError(f"scale must be two numbers [smallest, largest], got {list(scale)!r}")
    smallest, largest = float(scale[0]), float(scale[1])
    if not 0 < smallest <= largest:
        raise ValueError(f"scale must satisfy 0 < smallest <= largest, got {[smallest, largest]!r}")
    if round(GARMENT_SIZE * largest) > size:
        raise ValueError(
            f"scale's largest factor {largest:g} makes a garment {round(GARMENT_SIZE * largest)} pixels wide, "
            f"more than the canvas (size={size}): lower it or raise size"
        )
    if round(GARMENT_SIZE * smallest) < 2:
        raise ValueError(f"scale's smallest factor {smallest:g} leaves a garment under 2 pixels wide")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a number in [0, 1), got {threshold!r}")
    return (low, high), (smallest, largest)


class FashionScenes(Dataset):
    """``(image[1, size, size], mask[size, size])`` scenes composed from one split's garments.

    Args:
        images: the split's garments, ``(N, 28, 28)`` uint8 (torchvision's ``FashionMNIST.data``).
        labels: their classes ``0..9`` (``FashionMNIST.targets``).
        num_scenes: how many scenes the split has (the dataset's length).
        split: ``"train"`` or ``"val"``; with ``seed`` it fixes every scene.
        seed: the scenes' seed.
        size: the canvas side in pixels.
        garments: ``(fewest, most)`` garments per scene, the count drawn uniformly.
        scale: ``(smallest, largest)`` resize factor of a garment, drawn uniformly.
        threshold: a garment's pixels above this (of full white) are its shape.

    Images are normalised with Fashion-MNIST's training mean and deviation, as the classification
    task is; masks are ``int64``.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        num_scenes: int,
        split: str,
        seed: int = 0,
        size: int = 64,
        garments: Sequence[int] = (2, 4),
        scale: Sequence[float] = (0.75, 1.5),
        threshold: float = 0.1,
    ) -> None:
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
        if images.ndim != 3 or tuple(images.shape[1:]) != (GARMENT_SIZE, GARMENT_SIZE) or images.dtype != torch.uint8:
            raise ValueError(f"images must be (N, 28, 28) uint8, got {tuple(images.shape)} {images.dtype}")
        if labels.shape != images.shape[:1] or len(labels) == 0:
            raise ValueError(f"labels must hold one class per image ({len(images)}), got shape {tuple(labels.shape)}")
        self.garments, self.scale = check_scene_settings(size, garments, scale, threshold, {"num_scenes": num_scenes})
        self.images, self.labels = images, labels.long()
        self.num_scenes, self.split, self.seed = num_scenes, split, int(seed)
        self.size, self.threshold = size, float(threshold)

    def __len__(self) -> int:
        return self.num_scenes

    def layout(self, index: int) -> list[tuple[int, int, int, int]]:
        """Scene ``index``'s garments, bottom first: ``(garment index, side in pixels, top, left)``."""
        if not 0 <= index < self.num_scenes:
            raise IndexError(f"scene {index} of a split of {self.num_scenes}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, _SPLIT_IDS[self.split], index]))
        count = int(rng.integers(self.garments[0], self.garments[1] + 1))
        placed = []
        for _ in range(count):
            garment = int(rng.integers(len(self.images)))
            side = round(GARMENT_SIZE * float(rng.uniform(*self.scale)))
            top, left = (int(v) for v in rng.integers(0, self.size - side + 1, size=2))
            placed.append((garment, side, top, left))
        return placed

    def compose(self, index: int) -> tuple[Tensor, Tensor]:
        """Scene ``index`` before normalisation: pixels in ``[0, 1]`` ``(size, size)`` and the label map."""
        canvas = torch.zeros(self.size, self.size)
        mask = torch.zeros(self.size, self.size, dtype=torch.long)
        for garment, side, top, left in self.layout(index):
            pixels = self.images[garment].float().div(255)
            if side != GARMENT_SIZE:
                # antialias: a shrunk garment averages its pixels instead of skipping some.
                pixels = F.interpolate(pixels[None, None], size=(side, side), mode="bilinear", antialias=True)[0, 0]
            shape = pixels > self.threshold
            window = (slice(top, top + side), slice(left, left + side))
            canvas[window] = torch.where(shape, pixels, canvas[window])
            mask[window] = torch.where(shape, self.labels[garment] + 1, mask[window])
        return canvas, mask

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        canvas, mask = self.compose(int(index))
        image = (canvas - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
        return image[None], mask
