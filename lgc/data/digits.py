"""scikit-learn's bundled 8x8 handwritten digits: the offline default task.

1,797 grayscale images of 10 classes, shipped inside scikit-learn, so runs and tests need no
download. A fixed seeded split gives the same 1,437 training and 360 validation images on every
machine and in every worker.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["DIGITS_CLASSES", "DIGITS_IMAGES", "load_digits_split"]

#: Images and classes of the set.
DIGITS_IMAGES, DIGITS_CLASSES = 1797, 10

#: Pixel statistics of the digits after scaling to [0, 1] (the whole set; fixed, not refit).
_MEAN, _STD = 0.3046, 0.3776


def load_digits_split(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets of ``(image[1, 8, 8], label)``, normalized, split with ``seed``.

    The split is stratified by label so both sets hold every class in the same proportion.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - _MEAN) / _STD
    train_x, val_x, train_y, val_y = train_test_split(
        images, digits.target, test_size=val_fraction, random_state=seed, stratify=digits.target
    )

    def to_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long())

    return to_dataset(train_x, train_y), to_dataset(val_x, val_y)
